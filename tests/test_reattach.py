"""A named cluster whose daemon died (kill -9) while its nodes ran is re-attached to.

Real processes: the CLI, its daemons and the agents of local clusters. The job prints a
line per short interval until a file the test writes appears, so the test waits on what
it printed (conditions with generous deadlines), never on time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from _hosts import Lab
from _hosts import ssh_lab_fixture as ssh_lab_fixture  # the fixture
from _procs import alive, processes_in, wait_until
from test_cli import CLI, ssh_flags
from test_cli import cli as cli  # the fixture

from flotilla import Compute, function
from flotilla.cli.state import ClusterState, JobStatus, Paths

TICKS = (
    'i=0; while [ ! -e "$STOP" ]; do echo "tick-$FLOTILLA_NODE_RANK-$i $API_TOKEN"; '
    'i=$((i+1)); sleep 0.2; done; echo "done-$FLOTILLA_NODE_RANK"'
)
"""The job: a numbered line per node every fifth of a second until ``$STOP`` exists (with
its secret, which must never be shown)."""
SECRET = "s3cr3t-ticking-4711"


def read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def last_tick(text: str, rank: int) -> int:
    """The highest tick node ``rank`` printed in ``text`` (-1: none)."""
    found = [int(n) for n in re.findall(rf"tick-{rank}-(\d+)", text)]
    return max(found, default=-1)


def kill_daemon(cli: CLI, name: str) -> None:
    rec = cli.record(name)
    assert rec is not None and rec.pid
    os.kill(rec.pid, signal.SIGKILL)
    assert wait_until(lambda: not alive(rec.pid), 30)
    now = cli.record(name)
    assert now is not None and now.observed_state() is ClusterState.STALE


def start_ticking(cli: CLI, name: str, stop: Path) -> Path:
    """Run the ticking job on every node; its job.log once both nodes ticked."""
    cli.ok("exec", name, "--detach", "--env", f"STOP={stop}", "--env", f"API_TOKEN={SECRET}", TICKS)
    rec = cli.record(name)
    assert rec is not None
    log = Paths(name, cli.home).job_dir(rec.jobs[-1].id) / "job.log"
    assert wait_until(lambda: min(last_tick(read(log), r) for r in (0, 1)) >= 2, 60)
    return log


def test_a_killed_daemons_cluster_is_re_attached_and_its_job_goes_on(
    cli: CLI, tmp_path: Path
) -> None:
    stop = tmp_path / "stop"
    cli.ok("launch", "echo up", "-c", "ra", "--nodes", "2")
    before = cli.record("ra")
    assert before is not None
    agents = [n.agent_pid for n in before.nodes]
    log = start_ticking(cli, "ra", stop)
    kill_daemon(cli, "ra")
    assert all(alive(p) for p in agents), "the agents ended with their daemon"
    # a client without the cluster's key is refused, and the agent still waits
    wrong = subprocess.run(
        before.nodes[0].reattach, input=b"00" * 32 + b"\n", capture_output=True, timeout=60
    )
    assert wrong.returncode == 4, wrong.stderr
    seen = {r: last_tick(read(log), r) for r in (0, 1)}

    started = cli.ok("start", "ra")
    assert "re-attached to its 2 node(s)" in started.stderr
    after = cli.record("ra")
    assert after is not None and after.observed_state() is ClusterState.UP
    assert after.pid != before.pid
    assert [n.agent_pid for n in after.nodes] == agents  # nothing was provisioned again
    # the job's output goes on in its log: lines printed after the daemon died
    assert wait_until(lambda: all(last_tick(read(log), r) > seen[r] + 2 for r in (0, 1)), 60)
    job = after.jobs[-1]
    assert job.status == JobStatus.RUNNING.value
    stop.touch()
    followed = cli.ok("logs", "ra", str(job.id))
    assert "done-0" in followed.stdout and "done-1" in followed.stdout
    done = cli.record("ra")
    assert done is not None and done.job(job.id).status == JobStatus.SUCCEEDED.value  # type: ignore[union-attr]
    assert done.job(job.id).exit_code == 0  # type: ignore[union-attr]
    # the cluster's key is never shown, nor the job's secret (before or after the re-attach)
    shown = cli.ok("status", "--json").stdout + read(Paths("ra", cli.home).daemon_log)
    assert before.reattach_secret and before.reattach_secret not in shown
    assert SECRET not in read(log) + followed.stdout and "***" in read(log)
    for path in Paths("ra", cli.home).dir.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
    # the cluster serves as before, on the same agents
    assert cli.ok("exec", "ra", "echo again").stdout.count("again") == 2
    final = cli.record("ra")
    assert final is not None and [n.agent_pid for n in final.nodes] == agents
    cli.ok("down", "ra")
    assert wait_until(lambda: processes_in(cli.home) == [], 30), processes_in(cli.home)
    assert not any(alive(p) for p in agents)


def test_an_ssh_clusters_nodes_are_re_attached_through_ssh(
    cli: CLI, ssh_lab: Lab, tmp_path: Path
) -> None:
    hosts = ssh_lab.hosts[:2]
    stop = ssh_lab.shared / f"stop-{tmp_path.name}"  # a file the hosts see
    flags = ssh_flags(ssh_lab, hosts, tmp_path / "remote-workdir")
    cli.ok("launch", "echo up", "-c", "rs", "--nodes", "2", *flags)
    before = cli.record("rs")
    assert before is not None
    agents = [n.agent_pid for n in before.nodes]
    log = start_ticking(cli, "rs", stop)
    kill_daemon(cli, "rs")
    seen = {r: last_tick(read(log), r) for r in (0, 1)}
    started = cli.ok("start", "rs")
    assert "re-attached to its 2 node(s)" in started.stderr
    after = cli.record("rs")
    assert after is not None and [n.agent_pid for n in after.nodes] == agents
    running = ssh_lab.agent_pids(hosts)
    assert all(p in running[h.addr] for p, h in zip(agents, hosts, strict=True)), running
    assert wait_until(lambda: all(last_tick(read(log), r) > seen[r] + 2 for r in (0, 1)), 60)
    stop.touch()
    followed = cli.ok("logs", "rs", str(after.jobs[-1].id))
    assert "done-0" in followed.stdout and "done-1" in followed.stdout
    cli.ok("down", "rs")
    stop.unlink()
    assert ssh_lab.wait_no_agents(hosts, timeout=30.0) == {}


def test_any_command_that_finds_the_cluster_stale_re_attaches_and_down_cleans_up(
    cli: CLI, tmp_path: Path
) -> None:
    stop = tmp_path / "stop"
    cli.ok("launch", "echo up", "-c", "rb", "--nodes", "2")
    log = start_ticking(cli, "rb", stop)
    rec = cli.record("rb")
    assert rec is not None
    agents = [n.agent_pid for n in rec.nodes]
    kill_daemon(cli, "rb")
    seen = last_tick(read(log), 1)
    queued = cli.ok("exec", "rb", "--detach", "echo queued-after")  # finds it stale
    assert "re-attaching" in queued.stderr
    assert wait_until(lambda: last_tick(read(log), 1) > seen + 2, 60)
    down = cli.ok("down", "rb")
    assert "down" in down.stderr
    assert wait_until(lambda: processes_in(cli.home) == [], 30), processes_in(cli.home)
    assert not any(alive(p) for p in agents)
    assert not stop.exists()  # the job was stopped by down, not by its end


def test_the_server_re_attaches_to_a_stale_cluster_as_it_starts(cli: CLI, tmp_path: Path) -> None:
    from test_server import start_server

    stop = tmp_path / "stop"
    cli.ok("launch", "echo up", "-c", "rv", "--nodes", "2")
    rec = cli.record("rv")
    assert rec is not None
    log = start_ticking(cli, "rv", stop)
    kill_daemon(cli, "rv")
    seen = last_tick(read(log), 0)
    server = start_server(cli)
    try:

        def up() -> bool:
            now = cli.record("rv")
            return now is not None and now.observed_state() is ClusterState.UP

        assert wait_until(up, 120)
        assert wait_until(lambda: last_tick(read(log), 0) > seen + 2, 60)
        now = cli.record("rv")
        assert now is not None and [n.agent_pid for n in now.nodes] == [
            n.agent_pid for n in rec.nodes
        ]
    finally:
        cli("server", "stop", timeout=60)
    assert wait_until(lambda: not alive(server.pid), 60)
    stop.touch()
    cli.ok("down", "rv")
    assert wait_until(lambda: processes_in(cli.home) == [], 30), processes_in(cli.home)


def test_a_node_that_died_meanwhile_is_reported_and_down_cleans_up(cli: CLI) -> None:
    cli.ok("launch", "echo up", "-c", "rc", "--nodes", "2")
    rec = cli.record("rc")
    assert rec is not None
    kill_daemon(cli, "rc")
    lost = rec.nodes[1].agent_pid
    os.kill(lost, signal.SIGKILL)
    assert wait_until(lambda: not alive(lost), 30)
    refused = cli("start", "rc")
    assert refused.returncode != 0
    assert "node 1 (" in refused.stderr and "is gone" in refused.stderr, refused.stderr
    assert "node(s) [0] were stopped" in refused.stderr, refused.stderr
    now = cli.record("rc")
    assert now is not None and "node 1 (" in now.error
    assert wait_until(lambda: not alive(rec.nodes[0].agent_pid), 30)
    cli.ok("down", "rc")
    assert wait_until(lambda: processes_in(cli.home) == [], 30), processes_in(cli.home)


def test_a_cluster_nobody_re_attaches_to_ends_after_the_grace(cli: CLI, tmp_path: Path) -> None:
    grace = {"FLOTILLA_REATTACH_GRACE": "3"}
    cli.ok("launch", "echo up", "-c", "rd", "--nodes", "2", env=grace)
    rec = cli.record("rd")
    assert rec is not None
    start_ticking(cli, "rd", tmp_path / "stop")
    assert processes_in(cli.home)
    kill_daemon(cli, "rd")
    # past the grace the agents end, with every process their job started
    assert wait_until(lambda: processes_in(cli.home) == [], 120), processes_in(cli.home)
    assert not any(alive(n.agent_pid) for n in rec.nodes)
    refused = cli("start", "rd")
    assert refused.returncode != 0 and "is gone" in refused.stderr
    cli.ok("down", "rd")


def test_a_python_pool_ends_its_agents_with_its_client() -> None:
    """A ``Compute`` pool (not a cluster) keeps today's behaviour: no re-attach socket."""
    with Compute(nodes=1) as pool:
        assert pool.broadcast(_agent_address()) == [None]


@function
def _agent_address() -> str | None:
    return os.environ.get("FLOTILLA_AGENT_ADDRESS")


# -- the providers that re-attach through their own shell (srun, kubectl exec, exec): their
# tests run in the provider's CLI test file, on its lab, with these two checks.


def check_survives_its_daemon(
    cli: CLI, name: str, flags: list[str], stop: Path, held: Callable[[], list[str]]
) -> None:
    """A 2-node cluster launched with ``flags`` runs the ticking job (until ``stop``
    exists, a file its nodes see); its daemon is killed -9: what holds its nodes
    (``held()``: the SLURM job, the pods, the containers) stays, ``start`` re-attaches to
    the same agents, the job's output goes on and it ends with its real status, and
    ``down`` leaves nothing held."""
    cli.ok("launch", "echo up", "-c", name, "--nodes", "2", *flags, timeout=300)
    before = cli.record(name)
    assert before is not None and all(n.reattach for n in before.nodes), before.nodes
    agents = [n.agent_pid for n in before.nodes]
    holding = held()
    assert holding, "nothing holds the cluster's nodes"
    log = start_ticking(cli, name, stop)
    kill_daemon(cli, name)
    seen = {r: last_tick(read(log), r) for r in (0, 1)}
    started = cli.ok("start", name, timeout=300)
    assert "re-attached to its 2 node(s)" in started.stderr, started.stderr
    after = cli.record(name)
    assert after is not None and after.observed_state() is ClusterState.UP
    assert [n.agent_pid for n in after.nodes] == agents  # nothing was provisioned again
    assert held() == holding
    assert wait_until(lambda: all(last_tick(read(log), r) > seen[r] + 2 for r in (0, 1)), 60)
    job = after.jobs[-1]
    stop.touch()
    followed = cli.ok("logs", name, str(job.id), timeout=120)
    assert "done-0" in followed.stdout and "done-1" in followed.stdout, followed.stdout
    done = cli.record(name)
    assert done is not None and done.job(job.id).status == JobStatus.SUCCEEDED.value  # type: ignore[union-attr]
    assert done.job(job.id).exit_code == 0  # type: ignore[union-attr]
    assert cli.ok("exec", name, "echo again").stdout.count("again") == 2  # the same agents
    cli.ok("down", name, timeout=180)
    assert wait_until(lambda: held() == [], 120), held()
    # and no process of the cluster's is left here (the dead daemon's salloc, srun, exec)
    assert wait_until(lambda: processes_in(cli.home) == [], 60), processes_in(cli.home)


def check_ends_after_the_grace(
    cli: CLI, name: str, flags: list[str], stop: Path, held: Callable[[], list[str]]
) -> None:
    """The same cluster, its daemon killed, nobody re-attaching: past the grace what held
    its nodes is given back by itself; ``start`` then says the nodes are gone and ``down``
    removes the cluster."""
    grace = {"FLOTILLA_REATTACH_GRACE": "3"}
    cli.ok("launch", "echo up", "-c", name, "--nodes", "2", *flags, timeout=300, env=grace)
    rec = cli.record(name)
    assert rec is not None and all(n.reattach for n in rec.nodes), rec.nodes
    assert held()
    start_ticking(cli, name, stop)
    kill_daemon(cli, name)
    assert wait_until(lambda: held() == [], 180), held()
    refused = cli("start", name, timeout=300)
    assert refused.returncode != 0 and "is gone" in refused.stderr, refused.stderr
    cli.ok("down", name, timeout=180)
    assert held() == []
    assert wait_until(lambda: processes_in(cli.home) == [], 60), processes_in(cli.home)
