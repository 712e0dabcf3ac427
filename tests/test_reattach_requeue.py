"""A daemon that re-attaches to a cluster queues again the jobs its dead predecessor had
queued or was setting up: a queued job runs after the running one, a job in ``setup``
starts again from its setup (what the first setup left running is stopped first).

Real processes: a one-node local cluster with one stand-in GPU (``test_job_queue``), so
that a job asking for the GPU waits while another holds it.
"""

from __future__ import annotations

from pathlib import Path

from _procs import processes_in, wait_until
from test_cli import CLI
from test_job_queue import gpu_cli as gpu_cli  # the fixture
from test_reattach import kill_daemon, read

from flotilla.cli.state import ClusterState, JobStatus, Paths

SETUP = """\
resources:
  accelerators: A100:1
setup: |
  echo "setup $$" >> {shared}/setups
  until [ -e {shared}/go ]; do sleep 0.1; done
run: echo "ran after its setup"
"""


def test_queued_and_setting_up_jobs_are_queued_again_by_the_daemon_that_re_attaches(
    gpu_cli: CLI, tmp_path: Path
) -> None:
    cli = gpu_cli
    shared = tmp_path / "shared"
    shared.mkdir()
    stop = shared / "stop"
    cli.ok("launch", "echo up", "-c", "rq", "--nodes", "1")
    # job 2 holds the node's GPU, job 3 waits for it (queued); on a second cluster a job
    # is in its setup
    cli.ok("exec", "rq", "-d", "--gpus", "A100:1", "--env", f"STOP={stop}", _TICK)
    cli.ok("exec", "rq", "-d", "--gpus", "A100:1", "echo queued-ran")
    cli.ok("launch", "echo up", "-c", "rs", "--nodes", "1")
    setup = cli.task("setup.yaml", SETUP.format(shared=shared))
    cli.ok("launch", "-c", "rs", "-d", setup)
    setups = shared / "setups"
    assert wait_until(lambda: len(read(setups).splitlines()) == 1, 60)
    log = Paths("rq", cli.home).job_dir(2) / "job.log"
    assert wait_until(lambda: "tick-0-2" in read(log), 60)
    rec = cli.record("rq")
    assert rec is not None and [j.status for j in rec.jobs[1:]] == ["RUNNING", "PENDING"]
    kill_daemon(cli, "rq")
    kill_daemon(cli, "rs")

    cli.ok("start", "rq", "rs")
    queued = cli.record("rq")
    assert queued is not None and queued.observed_state() is ClusterState.UP
    assert queued.job(3).status == JobStatus.PENDING.value  # type: ignore[union-attr]
    stop.touch()  # job 2 ends: job 3 runs after it
    assert "queued-ran" in cli.ok("logs", "rq", "3").stdout

    def status(name: str, job: int) -> str:
        now = cli.record(name)
        found = now.job(job) if now is not None else None
        return found.status if found is not None else ""

    assert wait_until(lambda: status("rq", 3) == JobStatus.SUCCEEDED.value, 60)
    assert status("rq", 2) == JobStatus.SUCCEEDED.value
    # the job in setup: its first setup was stopped, the setup ran again, then its run
    assert wait_until(lambda: len(read(setups).splitlines()) == 2, 60), read(setups)
    first = int(read(setups).split()[1])
    assert wait_until(lambda: not Path(f"/proc/{first}").exists(), 30)
    (shared / "go").touch()
    assert "ran after its setup" in cli.ok("logs", "rs", "2").stdout
    assert wait_until(lambda: status("rs", 2) == JobStatus.SUCCEEDED.value, 60)
    cli.ok("down", "rq", "rs")
    assert wait_until(lambda: processes_in(cli.home) == [], 30), processes_in(cli.home)


_TICK = 'i=0; while [ ! -e "$STOP" ]; do echo "tick-0-$i"; i=$((i+1)); sleep 0.2; done'
