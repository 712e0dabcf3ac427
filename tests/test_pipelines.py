"""Managed pipelines (``flotilla jobs launch`` of a multi-document task file, SkyPilot's
format): parsing and its errors, serial pipelines on real local clusters (order, failure,
task ids), a controller killed with SIGKILL while each task runs, and job groups whose
tasks reach each other."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _procs import alive, assert_all_gone, processes_in, wait_until
from test_managed import Jobs, token_processes
from test_managed import jobs as jobs  # the fixture

from flotilla.cli.managed.group import group_env
from flotilla.cli.managed.state import ManagedJobRecord
from flotilla.cli.taskfile import Pipeline, Task, TaskError, load_task, load_tasks


def write(tmp_path: Path, text: str, name: str = "pipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# -- the format ----------------------------------------------------------------------------------
def test_a_multi_document_file_is_a_pipeline_with_skypilots_header(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        name: train-eval
        execution: parallel
        ---
        name: trainer
        num_nodes: 2
        run: python train.py
        ---
        run: python eval.py
        """,
    )
    loaded = load_tasks(path)
    assert isinstance(loaded, Pipeline)
    assert (loaded.name, loaded.execution) == ("train-eval", "parallel")
    assert [(t.name, t.num_nodes, t.run) for t in loaded.tasks] == [
        ("trainer", 2, "python train.py"),
        ("pipe-2", None, "python eval.py"),  # unnamed: the file's stem and its position
    ]
    serial = load_tasks(write(tmp_path, "run: echo a\n---\nrun: echo b\n", "two.yaml"))
    assert isinstance(serial, Pipeline)  # no header: every document is a task
    assert (serial.name, serial.execution, len(serial.tasks)) == ("two", "serial", 2)
    single = load_tasks(write(tmp_path, "run: echo one\n", "one.yaml"))
    assert isinstance(single, Task)


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("name: p\n---\n- a\n- b\n", 3, "document 2 of the pipeline is not a task"),
        ("name: p\n---\nrun: echo a\n---\nname: b\nrnu: echo b\n", 6, "unknown field 'rnu'"),
        ("name: p\nexecution: sideways\n---\nrun: echo a\n", 2, "serial or parallel"),
        ("name: p\n---\nrun: echo a\n---\nname: x\nenvs: {A: b}\n---\n", 5, "nothing to run"),
        ("name: p\n---\nname: a\nrun: x\n---\nname: a\nrun: y\n", 6, "two tasks of the"),
        ("name: p\nexecution: serial\n---\n", 1, "has a header but no task"),
        (
            "name: p\nexecution: parallel\nprimary_tasks: [a]\n---\nname: a\nrun: x\n",
            3,
            "unknown field 'primary_tasks' (known fields: execution, name)",
        ),
    ],
)
def test_a_bad_pipeline_names_the_file_and_line(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TaskError) as info:
        load_tasks(path)
    assert str(info.value).startswith(f"{path}:{line}: "), info.value
    assert message in str(info.value)


def test_a_recovered_group_task_gets_its_new_addresses_and_the_others_latest() -> None:
    """A job-group task recovered on new nodes runs again with its new addresses (the
    controller's ``_regroup`` before every attempt), and a task that runs again after it
    moved is told that task's new address, not the one from the barrier."""
    import threading

    from flotilla.cli.managed.group import GroupBarrier

    group = GroupBarrier("rl", ["server", "trainer"])
    never = threading.Event()
    arrived: dict[str, dict[str, str]] = {}
    waiter = threading.Thread(
        target=lambda: arrived.update(server=group.arrive("server", ["10.0.0.1"], never))
    )
    waiter.start()
    arrived["trainer"] = group.arrive("trainer", ["10.0.0.2", "10.0.0.3"], never)
    waiter.join(60)
    assert arrived["server"]["FLOTILLA_JOBGROUP_TRAINER_HEAD_IP"] == "10.0.0.2"
    again = group.moved("trainer", ["10.0.0.7", "10.0.0.3"])  # its head node was replaced
    assert again["FLOTILLA_JOBGROUP_TRAINER_HEAD_IP"] == "10.0.0.7"
    assert again["FLOTILLA_JOBGROUP_TRAINER_IPS"] == "10.0.0.7\n10.0.0.3"
    assert again["FLOTILLA_JOBGROUP_SERVER_HEAD_IP"] == "10.0.0.1"
    server = group.moved("server", ["10.0.0.1"])  # the server's next attempt
    assert server["FLOTILLA_JOBGROUP_TRAINER_HEAD_IP"] == "10.0.0.7"
    assert server["FLOTILLA_JOBGROUP_HOSTS"] == (
        '{"server": ["10.0.0.1"], "trainer": ["10.0.0.7", "10.0.0.3"]}'
    )


def test_launch_of_a_pipeline_points_at_jobs_launch(tmp_path: Path) -> None:
    path = write(tmp_path, "name: p\n---\nrun: echo a\n---\nrun: echo b\n")
    with pytest.raises(TaskError, match="flotilla jobs launch FILE"):
        load_task(path)


def test_a_bad_pipeline_is_refused_before_anything_starts(jobs: Jobs) -> None:
    task = jobs.task("bad.yaml", "name: p\n---\nrun: echo a\n---\nname: b\nrnu: echo b\n")
    done = jobs("launch", task)
    assert done.returncode == 2, done.stderr
    assert f"{task}:6: unknown field 'rnu'" in done.stderr
    assert jobs.records() == [] and not processes_in(jobs.home)


def test_job_group_variables_name_every_tasks_addresses() -> None:
    env = group_env("rl", {"data-server": ["10.0.0.1"], "trainer": ["10.0.0.2", "10.0.0.3"]})
    assert env["SKYPILOT_JOBGROUP_NAME"] == env["FLOTILLA_JOBGROUP_NAME"] == "rl"
    assert env["FLOTILLA_JOBGROUP_TASKS"] == "data-server,trainer"
    assert env["FLOTILLA_JOBGROUP_DATA_SERVER_HEAD_IP"] == "10.0.0.1"
    assert env["FLOTILLA_JOBGROUP_TRAINER_HEAD_IP"] == "10.0.0.2"
    assert env["FLOTILLA_JOBGROUP_TRAINER_IPS"] == "10.0.0.2\n10.0.0.3"


# -- serial pipelines on real clusters -------------------------------------------------------------
def tasks_of(jobs: Jobs, pipeline: ManagedJobRecord) -> list[ManagedJobRecord]:
    return [jobs.record(t) for t in pipeline.tasks]


def assert_pipeline_left_nothing(jobs: Jobs) -> None:
    for rec in jobs.records():
        if rec.pid:
            assert_all_gone([rec.pid], 30, "pipeline controller")
        if rec.token:
            assert not token_processes(rec.token), f"job {rec.id}'s processes still run"
    assert not processes_in(jobs.home)


FAILING = """\
    name: etl
    ---
    name: extract
    run: echo "extract $SKYPILOT_TASK_ID" >> $CKPT/log
    ---
    name: transform
    run: |
      echo "transform $SKYPILOT_TASK_ID" >> $CKPT/log
      exit 3
    ---
    name: load
    run: echo "load $SKYPILOT_TASK_ID" >> $CKPT/log
"""


@pytest.mark.timeout(120)
def test_a_failed_task_stops_the_ones_after_it(jobs: Jobs) -> None:
    task = jobs.task("etl.yaml", FAILING)
    done = jobs("launch", task, "--env", f"CKPT={jobs.ckpt}", timeout=110)
    assert done.returncode == 1, done.stderr
    lines = (jobs.ckpt / "log").read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["extract", "transform"]  # load never ran
    ids = [line.split()[1] for line in lines]
    pipeline = jobs.record(1)
    extract, transform, load = tasks_of(jobs, pipeline)
    assert ids == [extract.task_id, transform.task_id] and ids[0] != ids[1]
    assert (pipeline.state, extract.state, transform.state, load.state) == (
        "FAILED",
        "SUCCEEDED",
        "FAILED",
        "CANCELLED",
    )
    assert pipeline.error.startswith("task 2/3 (transform, job 3) FAILED: job 3 (transform)")
    assert load.error.startswith("not run: task 2/3 (transform")
    queue = jobs("queue").stdout.splitlines()
    assert queue[1].split()[:2] == ["1", "etl"] and queue[1].split()[-1] == "FAILED"
    assert [row.split()[1] for row in queue[2:5]] == ["1/extract", "2/transform", "3/load"]
    assert [row.split()[-1] for row in queue[2:5]] == ["SUCCEEDED", "FAILED", "CANCELLED"]
    assert_pipeline_left_nothing(jobs)


BLOCKING = """\
    ---
    name: {name}
    setup: echo "setup {name}" >> $CKPT/log
    run: |
      echo "start {name} $SKYPILOT_TASK_ID" >> $CKPT/log
      until [ -e $CKPT/go-{name} ]; do sleep 0.1; done
      echo "end {name}" >> $CKPT/log
"""


@pytest.mark.timeout(300)
def test_a_controller_killed_at_each_task_resumes_and_never_reruns_a_finished_one(
    jobs: Jobs,
) -> None:
    names = ["prep", "train", "eval"]
    text = "name: pipe\n" + "".join(textwrap.dedent(BLOCKING.format(name=n)) for n in names)
    task = jobs.task("pipe.yaml", text)
    launched = jobs("launch", task, "-d", "--env", f"CKPT={jobs.ckpt}")
    assert launched.returncode == 0, launched.stderr
    log = jobs.ckpt / "log"

    def starts(name: str) -> int:
        return log.read_text().count(f"start {name} ") if log.exists() else 0

    killed: list[int] = []
    for name in names:
        assert wait_until(lambda n=name: starts(n) == 1, 90), f"{name} never started"
        pid = jobs.record(1).pid
        os.kill(pid, signal.SIGKILL)  # the pipeline's controller, while `name` runs
        assert_all_gone([pid], 10, "controller")
        killed.append(pid)
        queue = jobs("queue")  # finds the controller gone: a new one resumes the pipeline
        assert f"managed pipeline 1: its controller (pid {pid}) is gone" in queue.stderr
        assert queue.stdout.splitlines()[1].split()[-1] == "RUNNING", queue.stdout
        assert wait_until(lambda n=name: starts(n) == 2, 90), f"{name} was not run again"
        (jobs.ckpt / f"go-{name}").touch()
    assert wait_until(lambda: jobs.record(1).state == "SUCCEEDED", 90), jobs.record(1)
    lines = log.read_text().splitlines()
    events = [" ".join(line.split()[:2]) for line in lines]
    assert events == [
        "setup prep",
        "start prep",
        "setup prep",  # the killed attempt was reaped: no "end prep" before the rerun
        "start prep",
        "end prep",
        "setup train",
        "start train",
        "setup train",
        "start train",
        "end train",
        "setup eval",
        "start eval",
        "setup eval",
        "start eval",
        "end eval",
    ]
    pipeline = jobs.record(1)
    records = tasks_of(jobs, pipeline)
    ids = {line.split()[1]: set() for line in lines if line.startswith("start")}
    for line in lines:
        if line.startswith("start"):
            ids[line.split()[1]].add(line.split()[2])
    assert ids == {r.name: {r.task_id} for r in records}  # same id across reruns...
    assert len({r.task_id for r in records}) == 3  # ...and one per task
    assert pipeline.recoveries == 3 and [r.recoveries for r in records] == [1, 1, 1]
    assert [r.state for r in records] == ["SUCCEEDED"] * 3
    assert pipeline.pid not in killed
    request = jobs.home / "managed" / "1" / "request.json"  # removed once its end is recorded
    assert wait_until(lambda: not request.exists(), 30), "the finished pipeline's request stayed"
    assert_pipeline_left_nothing(jobs)


def test_cancel_of_a_pipeline_whose_controller_is_gone_cleans_up(jobs: Jobs) -> None:
    text = "name: pipe\n" + "".join(
        textwrap.dedent(BLOCKING.format(name=n)) for n in ("only", "next")
    )
    task = jobs.task("pipe.yaml", text)
    assert jobs("launch", task, "-d", "--env", f"CKPT={jobs.ckpt}").returncode == 0
    log = jobs.ckpt / "log"
    assert wait_until(lambda: log.exists() and "start only" in log.read_text(), 90)
    pipeline = jobs.record(1)
    os.kill(pipeline.pid, signal.SIGKILL)
    assert_all_gone([pipeline.pid], 10, "controller")
    done = jobs("cancel", "1")
    assert "managed job 1: CANCELLED" in done.stderr, done.stderr
    only, after = tasks_of(jobs, jobs.record(1))
    assert (only.state, after.state) == ("CANCELLED", "CANCELLED")
    assert "start next" not in log.read_text()
    assert_pipeline_left_nothing(jobs)


# -- job groups ----------------------------------------------------------------------------------
GROUP = """\
    name: serve-and-ask
    execution: parallel
    ---
    name: web-server
    run: |
      cd $CKPT && echo "hello from the server" > index.html
      python3 -m http.server $PORT --bind 0.0.0.0 > /dev/null 2>&1 &
      server=$!
      until [ -e $CKPT/asked ]; do sleep 0.1; done
      kill $server
    ---
    name: client
    run: |
      echo "group $SKYPILOT_JOBGROUP_NAME tasks $FLOTILLA_JOBGROUP_TASKS"
      python3 - <<'EOF'
      import os, time, urllib.request
      url = f"http://{os.environ['FLOTILLA_JOBGROUP_WEB_SERVER_HEAD_IP']}:{os.environ['PORT']}/"
      deadline = time.monotonic() + 60
      while True:
          try:
              print("got", urllib.request.urlopen(url, timeout=5).read().decode().strip())
              break
          except OSError:
              if time.monotonic() > deadline:
                  raise
              time.sleep(0.2)
      EOF
      touch $CKPT/asked
"""


@pytest.mark.timeout(150)
def test_a_job_groups_tasks_run_at_once_and_find_each_other(jobs: Jobs) -> None:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    task = jobs.task("group.yaml", GROUP)
    done = jobs("launch", task, "--env", f"CKPT={jobs.ckpt}", "--env", f"PORT={port}", timeout=140)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(client) " in done.stdout  # each task's lines, labelled
    assert "group serve-and-ask tasks web-server,client" in done.stdout
    assert "got hello from the server" in done.stdout  # the client reached the server
    pipeline = jobs.record(1)
    assert pipeline.state == "SUCCEEDED"
    assert [r.state for r in tasks_of(jobs, pipeline)] == ["SUCCEEDED", "SUCCEEDED"]
    assert_pipeline_left_nothing(jobs)
    assert all(not alive(r.pid) for r in jobs.records() if r.pid)


@pytest.mark.timeout(120)
def test_a_pipeline_whose_controller_died_between_tasks_resumes_with_the_next(
    jobs: Jobs,
) -> None:
    """The state a controller killed right after a task succeeded leaves (that task
    SUCCEEDED, the next PENDING, the controller gone), written as the records are."""
    from flotilla.cli.backends import registry
    from flotilla.cli.jobspec import JobSpec
    from flotilla.cli.managed.recovery import JobRecovery
    from flotilla.cli.managed.state import JobsHome
    from flotilla.cli.state import write_json

    home = JobsHome(jobs.home)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    now = time.time()
    head = ManagedJobRecord(
        id=0, name="pipe", execution="serial", state="RUNNING", pid=gone.pid, submitted=now
    )
    common = {
        "provider": registry.DEFAULT.spec_type().to_dict(),
        "recovery": JobRecovery().to_dict(),
        "submitted": now,
    }
    first = ManagedJobRecord(id=0, name="first", state="SUCCEEDED", exit_code=0, **common)
    second = ManagedJobRecord(id=0, name="second", index=1, **common)
    home.create_many([head, first, second])
    with home.locked():
        for task in (first, second):
            task.pipeline, task.task_id = head.id, f"task-{task.id}"
            home.save(task)
        head.tasks = [first.id, second.id]
        home.save(head)
    log = jobs.ckpt / "log"
    specs = [
        JobSpec(name=n, run=f"echo {n} $SKYPILOT_TASK_ID >> {log}") for n in ("first", "second")
    ]
    write_json(home.request(head.id), {"tasks": [{"job": s.to_dict()} for s in specs]})
    queue = jobs("queue")
    assert f"managed pipeline 1: its controller (pid {gone.pid}) is gone" in queue.stderr
    assert wait_until(lambda: jobs.record(1).state == "SUCCEEDED", 90), jobs.record(1)
    assert log.read_text().splitlines() == ["second task-3"]  # the first never ran again
    assert [r.state for r in tasks_of(jobs, jobs.record(1))] == ["SUCCEEDED", "SUCCEEDED"]
    assert_pipeline_left_nothing(jobs)
