"""Liveness from the client's side: a node whose agent stops answering (here SIGSTOP, as a
frozen process or VM would) is declared lost within the heartbeat timeout and replaced, and
a call's timeout is enforced by the client even when the agent cannot enforce it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import CancelledError, wait
from pathlib import Path

import pytest
from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from _procs import alive, wait_until

import flotilla as sky


@sky.function
def rank() -> int:
    return sky.instance_info().node


@sky.function(timeout=5)
def long_nap() -> int:
    import time

    time.sleep(60)
    return sky.instance_info().node


@sky.function(timeout=1)
def short_nap() -> int:
    import time

    time.sleep(60)
    return 0


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """``pid`` stopped with SIGSTOP; resumed (or killed, if it no longer matters) after."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def agent_pid(pool: sky.Compute, node: int) -> int:
    return int(pool._nodes[node].hello_info["pid"])


def test_a_frozen_agent_is_declared_lost_and_replaced(caplog: pytest.LogCaptureFixture) -> None:
    options = sky.Options(heartbeat_timeout=2)
    with sky.Compute(nodes=3, options=options) as pool:
        assert rank() @ pool == [0, 1, 2]
        frozen = agent_pid(pool, 1)
        try:
            with caplog.at_level(logging.WARNING, logger="flotilla"):
                futures = pool.submit_broadcast(long_nap())
                with stopped(frozen):
                    done, _ = wait([futures[1]], timeout=60)
                    assert done, "the frozen node's call never ended"
                    err = futures[1].exception()
                    assert isinstance(err, sky.NodeLostError)
                    assert err.node == 1
                    assert "node 1" in str(err) and "stopped answering" in str(err)
                    assert "nothing heard from its agent for" in str(err)
                    for f in (futures[0], futures[2]):  # the live nodes enforce the timeout
                        assert isinstance(f.exception(timeout=60), sky.TaskTimeoutError)
                    assert rank() @ pool == [0, 1, 2]  # every node answers: node 1 is new
            assert agent_pid(pool, 1) != frozen
            assert not alive(frozen)  # the frozen agent was stopped with its node
            messages = [r.getMessage() for r in caplog.records]
            assert any(m.startswith("node 1 lost (it stopped answering for") for m in messages)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGKILL)


def test_a_call_timeout_is_enforced_by_the_client_when_the_agent_is_frozen() -> None:
    options = sky.Options(heartbeat_timeout=120)  # the node is not declared lost meanwhile
    with sky.Compute(nodes=1, options=options) as pool:
        pid = agent_pid(pool, 0)
        future = pool.submit(short_nap())
        with stopped(pid):
            with pytest.raises(sky.TaskTimeoutError) as info:
                future.result(timeout=60)
            assert "timeout of 1 s on node 0" in str(info.value)
        # resumed, the agent reads what waited in its stdin (the cancel) and goes on
        assert (rank() >> pool) == 0
        assert agent_pid(pool, 0) == pid


@sky.function
def size(data: bytes) -> int:
    return len(data)


def close_while_a_send_waits_for_a_frozen_agent(pool: sky.Compute, nbytes: int) -> None:
    """Node 0's agent is frozen; another thread sends it a call with an ``nbytes``
    argument, which waits for the agent to read; ``pool.close()`` still returns, and the
    waiting send ends (with an error)."""
    node = pool._nodes[0]
    frozen = agent_pid(pool, 0)
    ended: list[BaseException | int] = []

    def send() -> None:
        try:
            ended.append(pool.submit(size(b"x" * nbytes)).result(timeout=300))
        except BaseException as e:
            ended.append(e)

    with stopped(frozen):
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        assert wait_until(lambda: node.write_lock.locked() and bool(node.inflight), 30)
        closer = threading.Thread(target=pool.close, daemon=True)
        closer.start()
        closer.join(timeout=120)  # a guard against a hang, not a timing assertion
        assert not closer.is_alive(), "pool.close() hangs"
        sender.join(timeout=120)
        assert not sender.is_alive(), "the send to the frozen agent never ended"
    assert len(ended) == 1 and isinstance(ended[0], sky.FlotillaError), ended
    assert wait_until(lambda: not alive(frozen), 30)  # resumed, a remote one sees the end


def test_close_ends_while_a_send_to_a_frozen_local_agent_waits() -> None:
    pool = sky.Compute(nodes=2).__enter__()  # closed by the test; default heartbeat (60 s)
    assert rank() @ pool == [0, 1]
    close_while_a_send_waits_for_a_frozen_agent(pool, nbytes=2_000_000)


def test_close_ends_while_a_send_to_a_frozen_ssh_agent_waits(ssh_lab: Lab) -> None:
    hosts = ssh_lab.hosts[:2]
    pool = sky.Compute(provider=ssh_lab.provider(hosts), nodes=2).__enter__()
    assert rank() @ pool == [0, 1]
    close_while_a_send_waits_for_a_frozen_agent(pool, nbytes=64_000_000)  # past ssh's buffers
    assert ssh_lab.wait_no_agents(hosts, timeout=10.0) == {}


@sky.function
def size_and_node(data: bytes) -> tuple[int, int]:
    return len(data), sky.instance_info().node


def test_a_send_to_a_frozen_agent_is_given_up_when_the_node_is_lost() -> None:
    """A call with a large argument waits for a frozen agent to read it; once the node is
    declared lost (heartbeat timeout), the write is given up and the call, which never
    reached the agent whole, runs on the other node."""
    options = sky.Options(heartbeat_timeout=2)
    with sky.Compute(nodes=2, options=options) as pool:
        assert rank() @ pool == [0, 1]
        frozen = agent_pid(pool, 0)
        with stopped(frozen):
            future = pool.submit(size_and_node(b"x" * 2_000_000))  # to node 0: the least busy
            assert future.result(timeout=120) == (2_000_000, 1)
        assert wait_until(lambda: agent_pid(pool, 0) != frozen, 60)  # node 0 was replaced
        assert rank() @ pool == [0, 1]


_TRACER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(0x4206, int(sys.argv[1]), None, None) != 0:  # PTRACE_SEIZE
    print(os.strerror(ctypes.get_errno()), flush=True)
    sys.exit(1)
print("held", flush=True)
sys.stdin.read()  # once released (or the test gone), its end is its parent's to reap
"""


@contextlib.contextmanager
def death_held(pid: int) -> Iterator[None]:
    """The end of process ``pid`` is held back from its parent: a tracer (ptrace) that
    never waits for it holds it, as the kernel holds a process slow to die (a large one on
    a busy machine, a thread stuck in the kernel): the parent's ``waitpid`` does not
    return until the tracer lets go, when this ends."""
    tracer = subprocess.Popen(
        [sys.executable, "-c", _TRACER, str(pid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert tracer.stdin and tracer.stdout
    try:
        said = tracer.stdout.readline().strip()
        if said != "held":
            pytest.skip(f"cannot trace an executor here (ptrace: {said})")
        yield
    finally:
        tracer.stdin.close()
        tracer.wait(timeout=60)


def _written(path: str) -> bool:
    """Whether ``path`` holds something (``pid_then_wait`` creates it empty, then writes:
    CI run 30 read one in between)."""
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


@sky.function
def pid_then_wait(path: str) -> int:
    """Write this process's pid to ``path.pid``, then wait until ``path`` exists."""
    import pathlib
    import time

    pathlib.Path(f"{path}.pid").write_text(str(os.getpid()))
    while not os.path.exists(path):
        time.sleep(0.01)
    return os.getpid()


@sky.function
def slot_and_pid(_: int, parties: int) -> tuple[int, int]:
    """The slot and process of a call that meets the others (they run at once)."""
    assert sky.barrier("slots", parties).wait(timeout=120), "the calls did not run at once"
    return sky.instance_info().worker, os.getpid()


def test_an_executor_slow_to_die_does_not_stop_its_agent(tmp_path: Path) -> None:
    """A killed executor whose end is slow to come (its parent cannot reap it yet) leaves
    its agent serving: the other slot's call is answered, the node beats on and is not
    lost; the slot gets a new process once the old one is gone. (The agent used to wait
    for the killed process in its loop: nothing, not even a beat, until it was gone, and
    past the heartbeat timeout the node was lost: issue of CI run 22.)"""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with sky.Compute(nodes=1, worker=sky.Worker(concurrency=2)) as pool:
        agent = agent_pid(pool, 0)
        first, second = pid_then_wait(a) > pool, pid_then_wait(b) > pool  # a slot each
        assert wait_until(lambda: _written(f"{a}.pid") and _written(f"{b}.pid"), 120)
        killed, other = (int(Path(f"{p}.pid").read_text()) for p in (a, b))
        assert killed != other
        with death_held(killed):
            pool.cancel([first])  # its process is killed; its end is held back
            with pytest.raises(CancelledError):
                first.result(timeout=120)
            Path(b).touch()
            assert second.result(timeout=120) == other  # the agent answered for the other
        Path(a).touch()
        slots = pool.map(slot_and_pid, range(2), [2, 2])
        pids = {pid for _, pid in slots}
        assert sorted(slot for slot, _ in slots) == [0, 1]
        assert len(pids) == 2 and killed not in pids  # the slot has a new process...
        assert agent_pid(pool, 0) == agent  # ...on the same node: it was never lost


def test_a_slot_whose_killed_process_does_not_end_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A killed executor that has not ended ``FLOTILLA_STUCK_WARNING`` seconds later (30 by
    default; 1 here) leaves its slot without a process: the agent names the slot and the
    process to the client, which prints it as the node's stderr, once; the slot gets a new
    process once the old one is gone."""
    monkeypatch.setenv("FLOTILLA_STUCK_WARNING", "1")  # the local agents' environment
    a = str(tmp_path / "a")
    said: list[str] = []

    def warned() -> list[str]:
        said.extend(capsys.readouterr().err.splitlines())
        return [line for line in said if "slot 0 has no process" in line]

    with sky.Compute(nodes=1) as pool:
        call = pid_then_wait(a) > pool
        assert wait_until(lambda: _written(f"{a}.pid"), 120)
        killed = int(Path(f"{a}.pid").read_text())
        with death_held(killed):
            pool.cancel([call])  # its process is killed; its end is held back
            with pytest.raises(CancelledError):
                call.result(timeout=120)
            assert wait_until(lambda: bool(warned()), 60), said
        Path(a).touch()
        assert rank() >> pool == 0  # the slot serves again, with a new process
        (line,) = warned()
    assert f"(pid {killed}, state " in line and "was killed" in line, line
