"""Managed jobs (``flotilla jobs ...``): job_recovery parsing, the recovery policy, and real
controllers running real local clusters whose agents are killed under them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from _hosts import Lab
from _hosts import ssh_lab_fixture as ssh_lab_fixture  # the fixture
from _procs import (
    agent_above,
    alive,
    all_pids,
    assert_all_gone,
    kill_quietly,
    processes_in,
    wait_until,
)
from test_cli import ssh_flags

from flotilla._errors import ConfigurationError
from flotilla._system import procs
from flotilla.cli.managed.recovery import (
    Cause,
    JobRecovery,
    RecoveryPolicy,
    parse_job_recovery,
)
from flotilla.cli.managed.state import JobsHome, ManagedJobRecord, ManagedJobState
from flotilla.cli.taskfile import TaskError, load_task


# -- job_recovery, as SkyPilot writes it ---------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, JobRecovery()),
        ("FAILOVER", JobRecovery(strategy="FAILOVER")),
        ("failover", JobRecovery(strategy="FAILOVER")),
        ("eager_next_region", JobRecovery(strategy="EAGER_NEXT_REGION")),
        ({"strategy": None, "max_restarts_on_errors": 3}, JobRecovery(max_restarts_on_errors=3)),
        ({"recover_on_exit_codes": 33}, JobRecovery(recover_on_exit_codes=(33,))),
        (
            {"strategy": "FAILOVER", "max_restarts_on_errors": 1, "recover_on_exit_codes": [3, 4]},
            JobRecovery("FAILOVER", 1, (3, 4)),
        ),
    ],
)
def test_job_recovery_accepts_skypilots_forms(value: object, expected: JobRecovery) -> None:
    assert parse_job_recovery(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("NEXT_CLOUD", "'NEXT_CLOUD' is not a recovery strategy: use FAILOVER or EAGER_NEXT"),
        ({"max_restarts": 3}, "unknown field 'max_restarts'"),
        ({"max_restarts_on_errors": -1}, "0 or more, got -1"),
        ({"max_restarts_on_errors": True}, "0 or more, got True"),
        ({"recover_on_exit_codes": [33, 256]}, "0-255, got 256"),
        ({"recover_on_exit_codes": [33, 33]}, "lists 33 twice"),
        (5, "must be a strategy name or a mapping"),
    ],
)
def test_bad_job_recovery_says_what_is_wrong(value: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=r"resources\.job_recovery") as info:
        parse_job_recovery(value)
    assert message in str(info.value)


def test_task_file_job_recovery_is_parsed_and_its_mistakes_name_the_line(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        "run: echo hi\nresources:\n  job_recovery:\n    max_restarts_on_errors: 2\n"
        "    recover_on_exit_codes: 33\n"
    )
    assert load_task(str(good)).resources.job_recovery == JobRecovery(
        max_restarts_on_errors=2, recover_on_exit_codes=(33,)
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: echo hi\nresources:\n  job_recovery:\n    max_restarts_on_error: 2\n")
    with pytest.raises(TaskError) as info:
        load_task(str(bad))
    assert str(info.value).startswith(f"{bad}:4: `resources.job_recovery`: unknown field")


# -- the policy --------------------------------------------------------------------------------
def test_lost_nodes_never_count_against_max_restarts_on_errors() -> None:
    policy = RecoveryPolicy(JobRecovery(max_restarts_on_errors=0))
    for _ in range(5):
        decision = policy.decide(Cause.NODE_LOST, [])
        assert decision.recover and not decision.counted
    assert (policy.recoveries, policy.restarts_on_errors) == (5, 0)
    last = policy.decide(Cause.PROGRAM_FAILED, [1])
    assert not last.recover
    assert "allows no restarts on errors" in last.reason


def test_program_failures_count_until_the_limit() -> None:
    policy = RecoveryPolicy(JobRecovery(max_restarts_on_errors=2))
    assert policy.decide(Cause.PROGRAM_FAILED, [1]).recover
    assert policy.decide(Cause.PROGRAM_FAILED, [1]).recover
    third = policy.decide(Cause.PROGRAM_FAILED, [1])
    assert not third.recover
    assert "after 2 restart(s): max_restarts_on_errors=2 reached" in third.reason
    assert (policy.recoveries, policy.restarts_on_errors) == (2, 2)


def test_recover_on_exit_codes_restart_without_counting() -> None:
    policy = RecoveryPolicy(JobRecovery(max_restarts_on_errors=0, recover_on_exit_codes=(33,)))
    for _ in range(3):
        decision = policy.decide(Cause.PROGRAM_FAILED, [1, 33])
        assert decision.recover and not decision.counted
        assert "exit code 33 is in recover_on_exit_codes" in decision.reason
    assert not policy.decide(Cause.PROGRAM_FAILED, [34]).recover


def test_restarts_on_exit_codes_back_off_exponentially_up_to_a_cap() -> None:
    policy = RecoveryPolicy(JobRecovery(recover_on_exit_codes=(33,)))
    delays = [policy.decide(Cause.PROGRAM_FAILED, [33]).delay for _ in range(9)]
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert "restarting in 60 s" in policy.decide(Cause.PROGRAM_FAILED, [33]).reason
    assert policy.decide(Cause.NODE_LOST, []).delay == 0  # another cause ends the streak
    assert policy.decide(Cause.PROGRAM_FAILED, [33]).delay == 1


# -- records -----------------------------------------------------------------------------------
def test_records_live_in_a_private_folder_and_names_resolve(tmp_path: Path) -> None:
    home = JobsHome(tmp_path / "home")
    a = home.create(ManagedJobRecord(id=0, name="train", state="SUCCEEDED"))
    b = home.create(ManagedJobRecord(id=0, name="train", state="SUCCEEDED"))
    c = home.create(ManagedJobRecord(id=0, name="eval", state="SUCCEEDED"))
    assert (a.id, b.id, c.id) == (1, 2, 3)
    assert (home.root.stat().st_mode & 0o777) == 0o700
    assert home.resolve("train").id == 2  # the newest of that name
    assert home.resolve("3").name == "eval"
    with pytest.raises(ConfigurationError, match="no managed job named 'nope'"):
        home.resolve("nope")


def test_a_job_whose_controller_is_gone_shows_failed(tmp_path: Path) -> None:
    home = JobsHome(tmp_path / "home")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    rec = home.create(ManagedJobRecord(id=0, name="x", state="RUNNING", pid=proc.pid))
    assert rec.controller_gone()
    assert rec.observed_state() is ManagedJobState.FAILED


# -- real controllers ----------------------------------------------------------------------------
class Jobs:
    """Runs ``python -m flotilla jobs ...`` with FLOTILLA_HOME in a test's folder."""

    def __init__(self, tmp: Path) -> None:
        self.cwd = tmp
        self.home = tmp / "home"
        self.ckpt = tmp / "ckpt"  # the program's checkpoints: outside the nodes' folders
        self.ckpt.mkdir()
        self.env = dict(os.environ)
        self.env.pop("COMPUTE_POOL", None)
        self.env["FLOTILLA_HOME"] = str(self.home)

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "flotilla", "jobs", *args]

    def __call__(self, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv(*args),
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def task(self, name: str, text: str) -> str:
        path = self.cwd / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    def records(self) -> list[ManagedJobRecord]:
        return JobsHome(self.home).all()

    def record(self, job_id: int = 1) -> ManagedJobRecord:
        rec = JobsHome(self.home).load(job_id)
        assert rec is not None
        return rec


def token_processes(token: str) -> list[int]:
    """Live processes whose FLOTILLA_RUN_TOKEN starts with ``token``."""
    wanted = f"FLOTILLA_RUN_TOKEN={token}.".encode()
    return [pid for pid in all_pids() if procs.has_env(pid, wanted) and alive(pid)]


def assert_nothing_left(jobs: Jobs) -> None:
    """The controllers have exited and nothing of their clusters or jobs runs."""
    for rec in jobs.records():
        if rec.pid:
            assert_all_gone([rec.pid], 30, "managed-job controller")
        assert rec.token and not token_processes(rec.token), "the job's processes still run"
    assert not processes_in(jobs.home)


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    runner = Jobs(tmp_path)
    try:
        yield runner
    finally:
        left = [r.pid for r in runner.records() if r.pid and alive(r.pid)]
        if left:
            runner("cancel", "-a", timeout=90)
        left += processes_in(runner.home)
        left += [p for r in runner.records() if r.token for p in token_processes(r.token)]
        kill_quietly(left)


RESUMABLE = """\
    name: resumable
    num_nodes: 2
    setup: echo "setup rank $SKYPILOT_NODE_RANK" >> $CKPT/setup.log
    run: |
      echo "$SKYPILOT_TASK_ID" >> $CKPT/ids-$SKYPILOT_NODE_RANK
      if [ ! -e $CKPT/step-$SKYPILOT_NODE_RANK ]; then
        echo 1 > $CKPT/step-$SKYPILOT_NODE_RANK     # the checkpoint of the first attempt
        echo $$ > $CKPT/pid-$SKYPILOT_NODE_RANK
        exec sleep 300                                # works until its node is lost
      fi
      echo "rank $SKYPILOT_NODE_RANK resumed from step $(cat $CKPT/step-$SKYPILOT_NODE_RANK)"
      echo finished > $CKPT/done-$SKYPILOT_NODE_RANK
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["EAGER_NEXT_REGION", "FAILOVER"])
def test_a_managed_job_recovers_by_itself_when_a_node_loses_its_agent(
    jobs: Jobs, strategy: str
) -> None:
    recovery = f"num_nodes: 2\n    resources:\n      job_recovery: {strategy}\n"
    text = RESUMABLE.replace("num_nodes: 2\n", recovery)
    task = jobs.task("resumable.yaml", text)
    launch = jobs.popen("launch", task, "--env", f"CKPT={jobs.ckpt}")
    try:
        pid_files = [jobs.ckpt / "pid-0", jobs.ckpt / "pid-1"]
        assert wait_until(
            lambda: all(p.exists() and p.read_text().strip() for p in pid_files), 60
        ), "the ranks never started"
        pid_file = pid_files[1]
        assert wait_until(lambda: jobs.record().state == "RUNNING", 30)
        agent = agent_above(int(pid_file.read_text()))
        os.kill(agent, signal.SIGKILL)  # node 1's agent is lost mid-run
        out, err = launch.communicate(timeout=90)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    rec = jobs.record()
    assert (rec.state, rec.recoveries, rec.restarts_on_errors) == ("SUCCEEDED", 1, 0)
    for rank in (0, 1):  # both ranks finished, and every attempt had the same task id
        assert (jobs.ckpt / f"done-{rank}").read_text() == "finished\n"
        assert (jobs.ckpt / f"ids-{rank}").read_text().splitlines() == [rec.task_id] * 2
        assert f"rank {rank} resumed from step 1" in out
    setups = sorted((jobs.ckpt / "setup.log").read_text().splitlines())
    assert setups == ["setup rank 0"] * 2 + ["setup rank 1"] * 2  # again on the new nodes
    assert "recovery 1: node(s) 1 lost; a node was lost: recovering (not counted)" in err, err
    if strategy == "FAILOVER":  # the pool replaced node 1 at its rank: no new cluster
        assert "node 1 lost (its agent was killed by SIGKILL), replacing" in err
        assert err.count("node(s) up in") == 1
    else:  # a new cluster
        assert err.count("node(s) up in") == 2
    queue = jobs("queue")
    row = next(line for line in queue.stdout.splitlines() if line.startswith("1 "))
    assert row.split()[-2:] == ["1", "SUCCEEDED"]
    assert_nothing_left(jobs)


FAILS_TWICE = """\
    name: flaky
    num_nodes: 2
    resources:
      job_recovery:
        max_restarts_on_errors: {restarts}
    run: |
      if [ "$SKYPILOT_NODE_RANK" = 0 ]; then
        echo x >> $CKPT/attempts
        if [ $(wc -l < $CKPT/attempts) -le 2 ]; then echo "attempt failing"; exit 1; fi
      fi
      echo "rank $SKYPILOT_NODE_RANK ok with token $TOKEN"
"""


@pytest.mark.timeout(90)
def test_a_program_that_fails_twice_succeeds_with_two_restarts(jobs: Jobs) -> None:
    task = jobs.task("flaky.yaml", FAILS_TWICE.format(restarts=2))
    secret = "hunter2-secret-value"
    done = jobs("launch", task, "--env", f"CKPT={jobs.ckpt}", "--secret", f"TOKEN={secret}")
    assert done.returncode == 0, done.stderr
    assert (jobs.ckpt / "attempts").read_text().count("x") == 3
    assert "rank 0 ok with token ***" in done.stdout and "rank 1 ok with token ***" in done.stdout
    assert secret not in done.stdout + done.stderr
    for path in jobs.home.rglob("*"):  # never on disk: records, logs
        assert not path.is_file() or secret not in path.read_text(errors="replace"), path
    rec = jobs.record()
    assert (rec.state, rec.recoveries, rec.restarts_on_errors) == ("SUCCEEDED", 2, 2)
    assert "restart 2 of max_restarts_on_errors=2" in done.stderr
    events = subprocess.run(  # its state changes are events (`flotilla events ID`)
        [sys.executable, "-m", "flotilla", "events", "1", "--json"],
        env=jobs.env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    states = [json.loads(line)["state"] for line in events.splitlines()]
    assert states[0] == "STARTING" and states[-1] == "SUCCEEDED"
    assert states.count("RECOVERING") == 2 and "RUNNING" in states
    assert_nothing_left(jobs)


@pytest.mark.timeout(90)
def test_with_one_restart_it_fails_and_says_why(jobs: Jobs) -> None:
    task = jobs.task("flaky.yaml", FAILS_TWICE.format(restarts=1))
    done = jobs("launch", task, "--env", f"CKPT={jobs.ckpt}", "--env", "TOKEN=t")
    assert done.returncode == 1, done.stderr
    assert (jobs.ckpt / "attempts").read_text().count("x") == 2
    rec = jobs.record()
    assert (rec.state, rec.recoveries, rec.exit_code) == ("FAILED", 1, 1)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flotilla: managed job 1 FAILED: job 1 (flaky) failed in run: node-0")
    assert "exited with status 1" in last
    assert "after 1 restart(s): max_restarts_on_errors=1 reached" in last
    assert rec.error in last
    assert_nothing_left(jobs)


@pytest.mark.timeout(90)
def test_cancel_stops_a_detached_job_and_its_cluster(jobs: Jobs) -> None:
    task = jobs.task(
        "long.yaml",
        """\
        name: long
        num_nodes: 2
        run: |
          echo started > $CKPT/started-$SKYPILOT_NODE_RANK
          setsid sleep 300 &                 # a process that leaves the job's group
          sleep 300
        """,
    )
    launched = jobs("launch", task, "-d", "--env", f"CKPT={jobs.ckpt}")
    assert launched.returncode == 0, launched.stderr
    assert "jobs logs 1 --follow" in launched.stderr  # it returned; the job goes on
    started = [jobs.ckpt / "started-0", jobs.ckpt / "started-1"]
    assert wait_until(lambda: all(p.exists() for p in started), 60)
    rec = jobs.record()
    assert alive(rec.pid) and token_processes(rec.token)
    follower = jobs.popen("logs", "long", "--follow")
    cancelled = jobs("cancel", "long")
    assert cancelled.returncode == 0, cancelled.stderr
    _, err = follower.communicate(timeout=30)
    assert follower.returncode == 130  # it followed the job to its end
    assert "flotilla: managed job 1 CANCELLED: cancelled" in err
    assert "managed job 1: CANCELLED" in cancelled.stderr
    assert jobs.record().state == "CANCELLED"
    logs = jobs("logs", "1")
    assert "managed job 1 CANCELLED" in logs.stdout
    assert_nothing_left(jobs)
    again = jobs("cancel", "1")
    assert "had already ended (CANCELLED)" in again.stderr


def test_a_bad_job_recovery_is_refused_before_anything_starts(jobs: Jobs) -> None:
    task = jobs.task(
        "bad.yaml",
        """\
        run: echo hi
        resources:
          job_recovery: NEXT_CLOUD
        """,
    )
    done = jobs("launch", task)
    assert done.returncode == 2
    assert f"{task}:3: `resources.job_recovery`: 'NEXT_CLOUD' is not a recovery" in done.stderr
    assert jobs.records() == []


@pytest.mark.timeout(90)
def test_a_killed_controller_shows_failed_and_cancel_cleans_up(jobs: Jobs) -> None:
    task = jobs.task(
        "long.yaml",
        """\
        name: orphaned
        run: |
          setsid sleep 300 &                 # a process that leaves the job's group
          echo started > $CKPT/started
          sleep 300
        """,
    )
    assert jobs("launch", task, "-d", "--env", f"CKPT={jobs.ckpt}").returncode == 0
    assert wait_until((jobs.ckpt / "started").exists, 60)
    rec = jobs.record()
    os.kill(rec.pid, signal.SIGKILL)
    assert_all_gone([rec.pid], 10, "controller")
    queue = jobs("queue")
    assert f"1: its controller (pid {rec.pid}) is gone" in queue.stdout
    assert queue.stdout.splitlines()[1].split()[-1] == "FAILED"
    done = jobs("cancel", "1")
    assert "managed job 1: CANCELLED" in done.stderr, done.stderr
    assert jobs.record().error == "cancelled (its controller was gone)"
    assert_nothing_left(jobs)


@pytest.mark.timeout(120)
def test_a_managed_job_on_ssh_hosts_recovers_when_a_hosts_agent_is_killed(
    jobs: Jobs, ssh_lab: Lab
) -> None:
    hosts = ssh_lab.hosts[:2]
    ckpt = ssh_lab.shared / f"ckpt-{jobs.cwd.name}"  # checkpoints on a shared file system
    ckpt.mkdir()
    task = jobs.task("resumable.yaml", RESUMABLE)
    launch = jobs.popen(
        "launch",
        task,
        "--env",
        f"CKPT={ckpt}",
        *ssh_flags(ssh_lab, hosts, jobs.cwd / "remote-workdir"),
    )
    try:
        pid_files = [ckpt / "pid-0", ckpt / "pid-1"]
        assert wait_until(lambda: all(p.exists() and p.read_text().strip() for p in pid_files), 60)
        agent = agent_above(int(pid_files[1].read_text()))
        assert agent in ssh_lab.agent_pids([hosts[1]])[hosts[1].addr]  # node 1's host
        os.kill(agent, signal.SIGKILL)
        out, err = launch.communicate(timeout=90)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    rec = jobs.record()
    assert (rec.state, rec.recoveries) == ("SUCCEEDED", 1)
    for rank in (0, 1):
        assert (ckpt / f"ids-{rank}").read_text().splitlines() == [rec.task_id] * 2
        assert f"rank {rank} resumed from step 1" in out
    assert ssh_lab.wait_no_agents(hosts, timeout=10.0) == {}
    for h in hosts:  # the job's folder on each host went with it
        assert not h.path(jobs.cwd / "remote-workdir" / "managed" / str(rec.id)).exists()
    assert_nothing_left(jobs)
