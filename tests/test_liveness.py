"""Liveness from the client's side: a node whose agent stops answering (here SIGSTOP, as a
frozen process or VM would) is declared lost within the heartbeat timeout and replaced, and
a call's timeout is enforced by the client even when the agent cannot enforce it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import wait

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
