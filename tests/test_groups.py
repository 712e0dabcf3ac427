"""Pools whose processes form one group (torch process group): a broken group is restarted
whole, so no rank waits forever for a peer that is gone (real torch, gloo, local nodes)."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _procs import wait_until

import flotilla as sky
from flotilla._client.outcome import results
from flotilla._errors import NodeLostError, WorkerDiedError
from flotilla._node.eventloop import Poller

pytest.importorskip("torch")


@sky.function
def all_reduce(value: float) -> tuple[float, int]:
    """The sum of ``value`` over the group, and this process's pid."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value])
    dist.all_reduce(t)
    return float(t.item()), os.getpid()


@sky.function
def rank_fails(bad_rank: int, how: str) -> float:
    """Rank ``bad_rank`` fails (``how``: raise, exit, hang); the others enter a collective."""
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        if how == "raise":
            raise ValueError("bad batch on this rank")
        if how == "hang":
            time.sleep(120)
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)  # waits for bad_rank, which never comes
    return float(t.item())


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.Compute]:
    with sky.Compute(nodes=2, plugins=[sky.plugins.torch()]) as p:
        yield p


def test_a_rank_raising_does_not_leave_the_others_waiting(pool: sky.Compute) -> None:
    before = {pid for _, pid in all_reduce(1.0) @ pool}
    futures = pool.submit_broadcast(rank_fails(0, "raise"))
    with pytest.raises(ValueError, match="bad batch"):  # the root cause, from rank 0
        futures[0].result(timeout=60)
    with pytest.raises(WorkerDiedError) as info:  # rank 1 no longer waits in all_reduce
        futures[1].result(timeout=60)
    assert "node 0: rank_fails(...) raised ValueError: bad batch" in str(info.value)
    assert "all of them were restarted" in str(info.value)
    after = all_reduce(2.0) @ pool  # a fresh group, new processes on every node
    assert [value for value, _ in after] == [4.0, 4.0]
    assert not before & {pid for _, pid in after}


def test_a_rank_dying_restarts_the_whole_group(pool: sky.Compute) -> None:
    before = {pid for _, pid in all_reduce(1.0) @ pool}
    agents = agent_pid() @ pool
    futures = pool.submit_broadcast(rank_fails(1, "exit"))
    with pytest.raises(WorkerDiedError, match=r"node 1: .*exited with status 3"):
        futures[1].result(timeout=60)
    with pytest.raises(Exception) as info:  # gloo's own error, or the restart's
        futures[0].result(timeout=60)
    assert not isinstance(info.value, ValueError)
    said = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert "node 1" in said  # the restart's cause, or a note on gloo's error naming the death
    with pytest.raises(WorkerDiedError, match=r"node 1: .*exited with status 3"):
        results(futures)  # the root cause first, not rank 0's error from it
    after = all_reduce(3.0) @ pool
    assert [value for value, _ in after] == [6.0, 6.0]
    assert not before & {pid for _, pid in after}
    assert agent_pid() @ pool == agents  # the restart was the processes', not the agents'


def test_the_agents_poller_skips_a_descriptor_unregistered_earlier_in_the_same_wake_up() -> None:
    """An executor's end can close another executor's pipes (a group restart) while that
    one's readiness came in the same wake-up: its callback must not run on a closed (or
    reused) descriptor. (An agent read one and died: EBADF, exit 70.)"""
    sel = Poller()
    (r1, w1), (r2, w2) = os.pipe(), os.pipe()
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        sel.unregister(r2)  # what the group restart does to the other executor's pipe
        os.close(r2)

    sel.register(r1, False, first, first=True)
    sel.register(r2, False, lambda: ran.append("second"))
    os.write(w1, b"x")
    os.write(w2, b"x")
    try:
        for callback in sel.poll(1.0):
            callback()
        assert ran == ["first"]
    finally:
        sel.close()
        for fd in (r1, w1, w2):
            os.close(fd)


def test_an_error_on_every_rank_needs_no_restart(pool: sky.Compute) -> None:
    before = sorted(pid for _, pid in all_reduce(1.0) @ pool)
    with pytest.raises(ZeroDivisionError):
        sky.function(lambda: 1 / 0)() @ pool
    assert sorted(pid for _, pid in all_reduce(1.0) @ pool) == before  # same processes


def test_one_rank_of_a_broadcast_is_not_retried_alone(pool: sky.Compute, tmp_path: Path) -> None:
    marker = str(tmp_path / "died-once")
    futures = pool.submit_broadcast(once_dies_then_reduces(marker))
    # retried alone, rank 1 would wait in all_reduce for a rank 0 that has moved on
    with pytest.raises(WorkerDiedError, match="killed by SIGKILL"):
        futures[1].result(timeout=60)
    assert all_reduce(1.0) @ pool is not None


@sky.function(retries=2)
def once_dies_then_reduces(marker: str) -> float:
    """Rank 1 dies the first time (leaving ``marker``); then every rank reduces."""
    import signal

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


def test_a_pool_without_a_group_replaces_only_the_dead_process() -> None:
    with sky.Compute(nodes=2) as plain:
        pids = pid() @ plain
        with pytest.raises(WorkerDiedError):
            plain.submit_broadcast(exit_on(1))[1].result(timeout=30)
        after = pid() @ plain
    assert after[0] == pids[0] and after[1] != pids[1]


@sky.function
def pid() -> int:
    return os.getpid()


@sky.function
def exit_on(node: int) -> None:
    if sky.instance_info().node == node:
        os._exit(3)


@sky.function
def agent_pid() -> int:
    return os.getppid()


def test_a_lost_node_restarts_the_whole_group_on_a_fresh_agent_everywhere(
    pool: sky.Compute,
) -> None:
    before = {pid for _, pid in all_reduce(1.0) @ pool}
    agents = agent_pid() @ pool
    reducing = pool.submit_broadcast(rank_fails(1, "hang"))  # rank 0 waits in all_reduce
    node = pool._nodes[1]
    os.kill(agents[1], 9)  # node 1's agent is gone: rank 0 would wait forever
    # rank 0 no longer waits: stopped by the group's restart, or failed in gloo by itself
    # (node 1's process ended with its agent; whichever comes first), naming the loss
    with pytest.raises(Exception) as info:
        reducing[0].result(timeout=60)
    assert "node 1 was lost" in "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    with pytest.raises(NodeLostError, match="node 1 was lost"):  # its agent was killed
        reducing[1].result(timeout=60)
    with pytest.raises(NodeLostError, match="node 1 was lost"):  # the root cause first
        results(reducing)
    assert node.state.value == "lost"
    after = all_reduce(5.0) @ pool  # a fresh group of the new agents
    assert [value for value, _ in after] == [10.0, 10.0]
    assert not before & {pid for _, pid in after}
    assert not set(agents) & set(agent_pid() @ pool)  # every node has a new agent


@sky.function
def ok() -> int:
    return sky.instance_info().node


@pytest.mark.timeout(600)  # eight torch group restarts on a busy 2-core machine
def test_a_broadcast_right_after_a_failed_one_never_pairs_with_a_stale_collective() -> None:
    """Rank 1 raises while the others all_reduce; at once, ok() on every node: the failed
    broadcast returns only once its siblings ended (the group restarted), so the next
    one runs on the fresh group. Many rounds: no round hangs, every ok() answers."""
    with sky.Compute(nodes=3, plugins=[sky.plugins.torch()]) as pool:
        for _ in range(8):
            with pytest.raises(ValueError, match="bad batch"):
                rank_fails(1, "raise") @ pool
            assert ok() @ pool == [0, 1, 2]
            assert [total for total, _ in all_reduce(1.0) @ pool] == [3.0, 3.0, 3.0]


def test_a_rank_restarted_while_the_old_groups_head_still_runs_joins_the_new_group() -> None:
    """Node 1's process dies while node 0's agent is held (SIGSTOP), so the group restarts
    on node 1 first: its new rank finds the old group's store on the head's port (the old
    rank 0 still runs). It must wait for the new group's head, not join the old group: it
    did, and the new rank 0 then waited for it for good (CI run 47's hang)."""
    options = sky.Options(heartbeat_timeout=120)  # node 0 is not declared lost meanwhile
    with sky.Compute(nodes=2, plugins=[sky.plugins.torch()], options=options) as pool:
        before = [pid for _, pid in all_reduce(1.0) @ pool]
        agents = agent_pid() @ pool
        port = pool._bringup.head_port
        os.kill(agents[0], signal.SIGSTOP)
        try:
            os.kill(before[1], signal.SIGKILL)
            new: list[int] = []

            def on_old_store() -> bool:  # node 1's new process is connected to the old store
                new[:] = [p for p in _children(agents[1]) if p != before[1]]
                return bool(new) and port in _connected_ports(new[0])

            assert wait_until(on_old_store, timeout=60), "node 1's process was not restarted"
        finally:
            os.kill(agents[0], signal.SIGCONT)
        after = all_reduce(2.0) @ pool
        assert [value for value, _ in after] == [4.0, 4.0]
        assert after[1][1] == new[0] and not set(before) & {pid for _, pid in after}


def _children(pid: int) -> list[int]:
    """``pid``'s child processes (/proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _connected_ports(pid: int) -> set[int]:
    """The remote ports of ``pid``'s established TCP connections (/proc)."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # (it ended)
        return set()
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and fields[9] in inodes:  # ESTABLISHED
                ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


class HangsOnceMarked:
    """A plugin whose processes, once ``marker`` exists, never end their set-up (as a
    rendezvous whose peer never comes)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def around_process(self, info: sky.InstanceInfo) -> None:
        if os.path.exists(self.marker):
            threading.Event().wait()


def test_a_replacement_process_that_never_starts_fails_its_calls_saying_so(
    tmp_path: Path,
) -> None:
    """The client waits for no READY from a replacement process (a group's restart, a dead
    one's): one whose set-up never ends is killed past the start timeout, and the calls
    waiting for it fail saying why, instead of waiting for good."""
    marker = tmp_path / "hang"
    options = sky.Options(start_timeout=15)
    with sky.Compute(nodes=1, plugins=[HangsOnceMarked(str(marker))], options=options) as pool:
        marker.touch()
        with pytest.raises(WorkerDiedError):
            exit_on(0) @ pool
        with pytest.raises(NodeLostError, match=r"the process did not start within 15 s"):
            pid() @ pool


def test_a_restart_that_finds_the_groups_port_taken_says_so() -> None:
    """Another process takes the group's port (MASTER_PORT) between the old rank 0's end and
    the new one's start (as another pool's could): the new rank 0 fails at once saying so,
    and nothing waits for good (the node is then replaced as a lost one, on fresh agents
    with a new port)."""
    options = sky.Options(heartbeat_timeout=120, start_timeout=30)
    with sky.Compute(nodes=2, plugins=[sky.plugins.torch()], options=options) as pool:
        before = [pid for _, pid in all_reduce(1.0) @ pool]
        agents = agent_pid() @ pool
        port, generation = pool._bringup.head_port, pool._dispatcher.generation
        with socket.socket() as taken:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            os.kill(agents[0], signal.SIGSTOP)  # the old rank 0 is not restarted meanwhile
            try:
                os.kill(before[0], signal.SIGKILL)

                def bound() -> bool:  # once the old rank 0's sockets are closed
                    try:
                        taken.bind(("", port))
                    except OSError:
                        return False
                    return True

                assert wait_until(bound, timeout=60), f"port {port} stayed taken"
                taken.listen()
            finally:
                os.kill(agents[0], signal.SIGCONT)
            assert wait_until(lambda: pool._dispatcher.generation > generation, timeout=60)
            futures = pool.submit_broadcast(all_reduce(2.0))  # (sent after the RESTART)
            said = f"cannot start the torch group's store on port {port}"
            with pytest.raises(NodeLostError, match=said):
                futures[0].result(timeout=60)
            with pytest.raises(Exception):  # noqa: B017 (the group's restart, or the loss, says)
                futures[1].result(timeout=60)


def test_a_rank_does_not_join_the_store_of_an_older_generation_of_its_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store on the group's port is the old group's (generation 2, its rank 0 not
    ended): a rank of generation 3 waits for its own group's store, and past the start
    timeout fails naming what it waited for, where."""
    from datetime import timedelta

    import torch.distributed as dist

    from flotilla.plugins._torch import GROUP_KEY, group_store

    old = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    old.set(GROUP_KEY.format(2), "2")
    port = old.port
    info = sky.InstanceInfo(
        node=1, total_nodes=2, is_head=False, head_addr="127.0.0.1", head_port=port,
        accelerators=0, peers=(), pool_id="p",
    )  # fmt: skip
    monkeypatch.setenv("COMPUTE_POOL", '{"generation": 3, "start_timeout": 2}')
    said = rf"rank 1 found no store of its group \(generation 3\) at 127.0.0.1:{port} .*within 2 s"
    with pytest.raises(RuntimeError, match=said):
        group_store(info, 1, 2, "gloo")


def test_a_restart_asked_while_a_nodes_channel_is_busy_reaches_it_before_the_next_call(
    pool: sky.Compute,
) -> None:
    """The loop writes RESTART without waiting; while node 1's channel was busy, a worker
    thread wrote it later, and a call of the new group sent meanwhile could reach the agent
    first: the restart then aborted it, and node 0's rank waited in all_reduce for it for
    good (CI run 47's hang). Here the channel is held and the loop's worker threads are busy
    until the call is sent: the restart must still reach node 1 first."""
    from flotilla._client.loop import get_loop

    loop, d, node = get_loop(), pool._dispatcher, pool._nodes[1]
    generation = d.generation
    gate, busy = threading.Event(), threading.Semaphore(0)
    previous: list[Any] = []  # the loop's own worker threads, given back at the end

    def occupy() -> None:  # (the loop's thread: run_in_executor)
        previous.append(getattr(loop, "_default_executor", None))
        loop.set_default_executor(ThreadPoolExecutor(max_workers=4))
        for _ in range(4):
            loop.run_in_executor(None, lambda: (busy.release(), gate.wait()))

    futures: list[Any] = []
    sender = threading.Thread(target=lambda: futures.extend(pool.submit_broadcast(all_reduce(2.0))))
    try:
        with node.write_lock:  # (another thread's long write to node 1)
            loop.call_soon_threadsafe(occupy)
            for _ in range(4):
                assert busy.acquire(timeout=60)
            loop.call_soon_threadsafe(d.recovery.restart_group, "a test's restart", generation)
            assert wait_until(lambda: d.generation > generation, timeout=60)
            sender.start()  # node 0 gets its call at once, node 1 once the channel is free
            assert wait_until(lambda: bool(pool._nodes[0].inflight), timeout=60)
        sender.join()
    finally:
        gate.set()
        mine = previous[0] if previous and previous[0] is not None else ThreadPoolExecutor()
        loop.call_soon_threadsafe(loop.set_default_executor, mine)
    assert [f.result(timeout=60)[0] for f in futures] == [4.0, 4.0]
