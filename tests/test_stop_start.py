"""``flotilla stop`` / ``flotilla start`` / ``launch --autostop`` on local and SSH-lab
clusters: agents stopped, node folders (and what jobs left there) kept, STOPPED in
``status``; providers whose nodes cannot stop are refused with ``down`` offered."""

from __future__ import annotations

import secrets
import time

from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from _procs import processes_in, wait_until
from test_cli import CLI, node_lines, ssh_flags
from test_cli import cli as cli  # the fixture

from flotilla.cli.state import ClusterRecord, Paths, save


def _wait_record(cli: CLI, name: str, wanted: str | None, timeout: float = 60) -> None:
    """Poll the record until its state is ``wanted`` (None: until it is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        rec = cli.record(name)
        state = None if rec is None else rec.observed_state().value
        if state == wanted:
            return
        assert time.monotonic() < deadline, f"cluster {name} is {state}, not {wanted}"
        time.sleep(0.05)


def test_stop_keeps_the_node_folders_and_start_brings_the_cluster_back(cli: CLI) -> None:
    cli.ok("launch", "-c", "st", "--nodes", "2", "echo kept-$SKYPILOT_NODE_RANK > ~/kept.txt")
    cli.ok("stop", "st")
    status = cli.ok("status").stdout
    assert "STOPPED" in next(line for line in status.splitlines() if line.startswith("st "))
    assert processes_in(cli.home) == []  # no daemon, agent or job left
    refused = cli("exec", "st", "true")
    assert refused.returncode != 0 and "flotilla start st" in refused.stderr
    cli.ok("start", "st")
    _wait_record(cli, "st", "UP", 1)
    done = cli.ok("exec", "st", 'echo "found: $(cat ~/kept.txt)"')
    assert node_lines(done.stdout, "found: ") == {0: "kept-0", 1: "kept-1"}
    again = cli.ok("start", "st")
    assert "already UP" in again.stderr


def test_autostop_stops_an_idle_cluster_and_with_down_removes_it(cli: CLI) -> None:
    cli.ok("launch", "-c", "auto", "--autostop", "0.01", "echo one")
    _wait_record(cli, "auto", "STOPPED")
    cli.ok("launch", "-c", "gone", "--autostop", "0.01", "--down", "echo two")
    _wait_record(cli, "gone", None)  # torn down: its record, then its folder, removed
    folder = cli.home / "clusters" / "gone"
    assert wait_until(lambda: not folder.exists(), 30), list(folder.rglob("*"))


def test_stop_is_refused_where_nodes_cannot_stop(cli: CLI) -> None:
    paths = Paths("batch", cli.home)
    paths.ensure()
    save(paths, ClusterRecord(name="batch", provider={"kind": "slurm"}, num_nodes=1))
    done = cli("stop", "batch")
    assert done.returncode == 2
    assert "cannot be stopped and started again" in done.stderr
    assert "flotilla down batch" in done.stderr


def test_stop_and_start_on_ssh_hosts(cli: CLI, ssh_lab: Lab) -> None:
    hosts = ssh_lab.hosts[:2]
    mark = f"kept-{secrets.token_hex(4)}"
    flags = ssh_flags(ssh_lab, hosts, cli.cwd / "ssh-work")
    out = cli.cwd / "out"  # (the lab's hosts share this machine's disk)
    out.mkdir()
    run = f"echo {mark}-$SKYPILOT_NODE_RANK > {out}/m-$SKYPILOT_NODE_RANK"
    cli.ok("launch", "-c", "sst", "--nodes", "2", *flags, run)
    cli.ok("stop", "sst")
    _wait_record(cli, "sst", "STOPPED", 1)
    assert ssh_lab.wait_no_agents(hosts) == {}
    assert "STOPPED" in cli.ok("status", "sst").stdout
    cli.ok("start", "sst")
    assert len(ssh_lab.agent_pids(hosts)) == 2  # an agent on each host again
    done = cli.ok("exec", "sst", f'echo "found: $(cat {out}/m-$SKYPILOT_NODE_RANK)"')
    assert node_lines(done.stdout, "found: ") == {0: f"{mark}-0", 1: f"{mark}-1"}
