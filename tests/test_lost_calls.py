"""Calls that had not started on a node that is lost go back to the queue, without
``retries=``: broadcasts wait for the replacement, single calls go to another node; only a
call that was running counts as lost (NodeLostError). Real agents killed with SIGKILL and no
pause after the kill, on the local provider and on SSH test hosts."""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future
from pathlib import Path

from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from _procs import wait_until

import flotilla as sky


@sky.function
def who() -> tuple[int, int]:
    """This node's rank and its agent's pid."""
    return sky.instance_info().node, os.getppid()


@sky.function
def mark(folder: str, i: int) -> int:
    """Create ``folder/i``, failing if it exists (the call ran before); then wait until
    ``folder/go`` exists: ``i``."""
    import time

    os.close(os.open(os.path.join(folder, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.001)
    return i


def kill_now(pool: sky.Compute, rank: int) -> int:
    """SIGKILL node ``rank``'s agent, without waiting for anything; its pid."""
    pid = int(pool._nodes[rank].hello_info["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


def broadcast_right_after_kills(pool: sky.Compute, rounds: int) -> None:
    for r in range(rounds):
        rank = r % pool.nodes
        killed = kill_now(pool, rank)
        after = who() @ pool
        assert [node for node, _ in after] == list(range(pool.nodes))
        assert after[rank][1] != killed


def single_calls_right_after_kills(pool: sky.Compute, rounds: int) -> None:
    for r in range(rounds):
        kill_now(pool, r % pool.nodes)
        assert [who() >> pool for _ in range(4)]  # none lost: they go elsewhere
        who() @ pool  # the replacement is back


def queued_calls_survive(pool: sky.Compute, folder: Path, calls: int, rank: int) -> None:
    """``calls`` calls in flight, the first on each node running (waiting for ``go``),
    the others queued; node ``rank``'s agent is killed: the call it was running is lost,
    every other one runs exactly once."""
    futures: list[Future[int]] = [pool.submit(mark(str(folder), i)) for i in range(calls)]
    assert wait_until(lambda: len(os.listdir(folder)) == pool.nodes, timeout=60)
    kill_now(pool, rank)
    (folder / "go").touch()
    lost = []
    for i, fut in enumerate(futures):
        try:
            assert fut.result(timeout=120) == i
        except sky.NodeLostError as e:
            assert e.node == rank
            lost.append(i)
    assert len(lost) == 1, lost  # one process per node: one call was running
    assert len(os.listdir(folder)) == calls + 1  # each ran once (and "go")


# -- local ---------------------------------------------------------------------------------


def test_a_broadcast_right_after_a_local_kill_waits_for_the_replacement() -> None:
    with sky.Compute(nodes=2) as pool:
        who() @ pool
        broadcast_right_after_kills(pool, rounds=4)


def test_single_calls_right_after_a_local_kill_go_to_another_node() -> None:
    with sky.Compute(nodes=2) as pool:
        who() @ pool
        single_calls_right_after_kills(pool, rounds=4)


def test_thousands_of_queued_calls_survive_a_local_kill(tmp_path: Path) -> None:
    with sky.Compute(nodes=4) as pool:
        queued_calls_survive(pool, tmp_path, calls=4000, rank=2)


def test_calls_queued_behind_a_running_call_run_on_the_replacement(tmp_path: Path) -> None:
    with sky.Compute(nodes=1) as pool:
        queued_calls_survive(pool, tmp_path, calls=5, rank=0)


@sky.function
def once(folder: str, i: int) -> int:
    """Create ``folder/i``, failing if it exists (the call ran before): ``i``."""
    os.close(os.open(os.path.join(folder, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    return i


def test_quick_calls_given_ahead_lose_at_most_a_window_when_the_agent_is_killed(
    tmp_path: Path,
) -> None:
    """Quick calls are given to the process a few at a time (announced as started): when
    the agent is killed, at most that many count as lost; every other one runs once."""
    from flotilla._node.supervisor import WINDOW

    calls = 3000
    with sky.Compute(nodes=2) as pool:
        futures = [pool.submit(once(str(tmp_path), i)) for i in range(calls)]
        assert wait_until(lambda: len(os.listdir(tmp_path)) > 300, timeout=60)
        kill_now(pool, 1)
        lost = []
        for i, fut in enumerate(futures):
            try:
                assert fut.result(timeout=120) == i
            except sky.NodeLostError as e:
                assert e.node == 1
                lost.append(i)
        assert len(lost) <= WINDOW, lost
        assert calls - len(lost) <= len(os.listdir(tmp_path)) <= calls


# -- SSH test hosts --------------------------------------------------------------------------


def test_calls_right_after_an_ssh_kill_are_not_lost(ssh_lab: Lab, tmp_path: Path) -> None:
    hosts = ssh_lab.hosts[:2]
    with sky.Compute(provider=ssh_lab.provider(hosts), nodes=2) as pool:
        who() @ pool
        broadcast_right_after_kills(pool, rounds=2)
        single_calls_right_after_kills(pool, rounds=2)
        folder = ssh_lab.shared / f"marks-{tmp_path.name}"  # the hosts' and this machine's
        folder.mkdir()
        queued_calls_survive(pool, folder, calls=1000, rank=1)
    assert ssh_lab.wait_no_agents(hosts, timeout=5.0) == {}
