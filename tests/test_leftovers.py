"""Everything a task starts is stopped with the pool, also processes that left the
executor's process group (a new session, a double fork): local and SSH nodes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from _procs import assert_all_gone, wait_until

import flotilla as sky


@sky.function
def start_daemons() -> list[int]:
    """A `setsid` process and a double-forked one that outlive the call; their pids."""
    import subprocess

    session = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    script = "(sleep 1000 >/dev/null 2>&1 & echo $!) &"  # its parent exits: an orphan
    orphan = int(subprocess.check_output(["sh", "-c", script]))
    return [session.pid, orphan]


def test_daemons_a_task_started_are_gone_after_a_local_pool(tmp_path: Path) -> None:
    with sky.Compute(nodes=2) as pool:
        pids = [pid for node in start_daemons() @ pool for pid in node]
    assert len(pids) == 4
    assert_all_gone(pids, timeout=10, what="daemons started by tasks")


def test_daemons_a_task_started_are_gone_after_an_ssh_pool(ssh_lab: Lab) -> None:
    hosts = ssh_lab.hosts[:2]
    with sky.Compute(provider=ssh_lab.provider(hosts), nodes=2) as pool:
        pids = [pid for node in start_daemons() @ pool for pid in node]
    assert len(pids) == 4
    assert_all_gone(pids, timeout=10, what="daemons started by tasks on SSH hosts")


CLIENT = """
import sys, time
import flotilla as sky
with sky.Compute(sky.Local(workdir=sys.argv[1]), nodes=2):
    print("ready", flush=True)
    time.sleep(600)
"""


def test_node_folders_are_removed_when_the_client_is_killed(tmp_path: Path) -> None:
    nodes_dir = tmp_path / "nodes"
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    client = subprocess.Popen(
        [sys.executable, str(script), str(nodes_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout is not None and client.stdout.readline() == "ready\n"
        assert len(list(nodes_dir.iterdir())) == 2
        client.kill()  # no close: the agents see the end of their stdin and clean up
        client.wait()
        assert wait_until(lambda: list(nodes_dir.iterdir()) == [], timeout=15)
    finally:
        client.kill()
        client.wait()
