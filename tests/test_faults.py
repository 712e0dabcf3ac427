"""Faults: remote exceptions, dying worker processes, retries, timeouts, failed start-up,
and remote output while a task runs. Real pools, real processes, no mocks."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _procs import (
    Client,
    alive,
    assert_all_gone,
    cmdline,
    kill_quietly,
    processes_in,
    wait_until,
)

import flotilla as sky


class Boom(Exception):
    """A user exception the client can import (this module is importable on the nodes)."""


class BrokenPlugin:
    """A plugin whose per-process hook fails, so no executor can start."""

    def around_process(self, info: sky.InstanceInfo) -> None:
        raise RuntimeError("plugin broke")


# -- tasks -----------------------------------------------------------------------------


@sky.function
def boom_on(node: int, message: str) -> int:
    me = sky.instance_info().node
    if me == node:
        raise Boom(message)
    return me


@sky.function
def raise_node_only(message: str) -> None:
    """Raise an exception whose class lives in a module that exists only on the node."""
    name = f"node_only_{os.getpid()}_{time.monotonic_ns()}"
    Path(f"{name}.py").write_text("class NodeOnlyError(Exception):\n    pass\n")
    sys.path.insert(0, os.getcwd())
    module = __import__(name)
    raise module.NodeOnlyError(message)


@sky.function
def getpid() -> int:
    return os.getpid()


@sky.function
def die(how: str, line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    if how == "exit3":
        os._exit(3)
    elif how == "segfault":
        ctypes.string_at(0)
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("still alive")


def _attempt(counter: str) -> int:
    """Count this attempt in ``counter`` (one line per attempt); the attempt's number."""
    with open(counter, "a") as f:
        f.write("x\n")
    return len(Path(counter).read_text().splitlines())


@sky.function(retries=2)
def die_first_time(counter: str) -> str:
    if _attempt(counter) == 1:
        os._exit(3)
    return "second time lucky"


@sky.function(retries=2)
def always_die(counter: str) -> None:
    _attempt(counter)
    print("dying again", file=sys.stderr, flush=True)
    os._exit(3)


@sky.function(retries=2)
def user_error(counter: str) -> None:
    _attempt(counter)
    raise Boom("not a crash")


@sky.function(timeout=0.5)
def sleeps_too_long(pid_file: str, child_file: str) -> None:
    Path(pid_file).write_text(str(os.getpid()))
    child = subprocess.Popen(["sleep", "60"])
    Path(child_file).write_text(str(child.pid))
    time.sleep(60)


# -- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def duo() -> Iterator[sky.Compute]:
    """A 2-node pool for calls that leave their node usable."""
    with sky.Compute(nodes=2) as pool:
        yield pool


@pytest.fixture
def solo() -> Iterator[sky.Compute]:
    """A fresh 1-node pool: whatever happens to a call happens to this very node."""
    with sky.Compute(nodes=1) as pool:
        yield pool


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# -- errors ----------------------------------------------------------------------------


def test_remote_exception_keeps_its_type_message_traceback_and_node(duo: sky.Compute) -> None:
    with pytest.raises(Boom) as info:
        boom_on(1, "bad input 42") @ duo
    err = info.value
    assert type(err) is Boom
    assert str(err) == "bad input 42"
    assert getattr(err, "node", None) == 1
    notes = "\n".join(getattr(err, "__notes__", []))
    assert "remote traceback (node 1)" in notes
    remote = str(err.__cause__)  # printed before the client's frames
    assert "boom_on" in remote  # the frame of the task that raised
    assert "raise Boom(message)" in remote
    assert "Boom: bad input 42" in remote
    # the node is still usable
    assert boom_on(-1, "") @ duo == [0, 1]


def test_exception_of_a_type_unknown_here_becomes_remote_error(duo: sky.Compute) -> None:
    with pytest.raises(sky.RemoteError) as info:
        raise_node_only("only the node knows") >> duo
    err = info.value
    assert isinstance(err, sky.FlotillaError)
    assert re.fullmatch(r"node_only_\d+_\d+\.NodeOnlyError", err.type_name), err.type_name
    assert err.remote_message == "only the node knows"
    assert err.node in (0, 1)
    assert f"(raised on node {err.node})" in str(err)
    assert "only the node knows" in str(err)
    assert "NodeOnlyError: only the node knows" in err.remote_traceback
    assert "raise_node_only" in err.remote_traceback


# -- dying worker processes -------------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "exitcode", "signame", "described"),
    [
        ("exit3", 3, None, "status 3"),
        ("segfault", -signal.SIGSEGV, "SIGSEGV", "SIGSEGV"),
        ("sigkill", -signal.SIGKILL, "SIGKILL", "SIGKILL"),
    ],
)
def test_dead_worker_raises_worker_died_and_node_stays_usable(
    solo: sky.Compute, how: str, exitcode: int, signame: str | None, described: str
) -> None:
    before = getpid() >> solo
    line = f"last words of a {how} worker"
    with pytest.raises(sky.WorkerDiedError) as info:
        die(how, line) >> solo
    err = info.value
    assert not isinstance(err, sky.NodeLostError)  # the process died, not the node
    assert err.node == 0
    assert err.exitcode == exitcode
    assert err.signal == signame
    message = str(err)
    assert "node 0" in message
    assert described in message
    assert line in message
    assert line in err.stderr_tail
    assert not alive(before)
    # the same (only) node takes the next call, in a fresh process, and a broadcast
    after = getpid() >> solo
    assert after != before
    assert getpid() @ solo == [after]


def test_calls_queued_behind_a_dying_call_still_run(solo: sky.Compute) -> None:
    dying = die("exit3", "queue test") > solo
    queued = [getpid() > solo for _ in range(3)]  # all on the same node, behind it
    with pytest.raises(sky.WorkerDiedError, match="status 3"):
        dying.result(timeout=30)
    pids = {f.result(timeout=30) for f in queued}
    assert len(pids) == 1
    assert alive(pids.pop())


# -- retries ---------------------------------------------------------------------------


@pytest.fixture(params=[1, 2], ids=["1-node", "2-node"])
def retry_pool(request: pytest.FixtureRequest, duo: sky.Compute) -> Iterator[sky.Compute]:
    """A retried call goes back to the same node (1 node) or to another one (2 nodes)."""
    if request.param == 2:
        yield duo
    else:
        with sky.Compute(nodes=1) as fresh:
            yield fresh


def test_retry_after_a_death_returns_the_value(retry_pool: sky.Compute, tmp_path: Path) -> None:
    counter = tmp_path / "attempts"
    assert die_first_time(str(counter)) >> retry_pool == "second time lucky"
    assert lines_of(counter) == 2


def test_call_that_always_dies_fails_after_exactly_three_attempts(
    retry_pool: sky.Compute, tmp_path: Path
) -> None:
    counter = tmp_path / "attempts"
    with pytest.raises(sky.WorkerDiedError) as info:
        always_die(str(counter)) >> retry_pool
    assert "status 3" in str(info.value)
    assert "dying again" in info.value.stderr_tail
    assert lines_of(counter) == 3
    assert getpid() @ retry_pool  # and the pool is still usable


def test_user_exception_is_not_retried(retry_pool: sky.Compute, tmp_path: Path) -> None:
    counter = tmp_path / "attempts"
    with pytest.raises(Boom, match="not a crash"):
        user_error(str(counter)) >> retry_pool
    assert lines_of(counter) == 1


# -- timeouts --------------------------------------------------------------------------


def test_timeout_stops_the_task_and_its_children(solo: sky.Compute, tmp_path: Path) -> None:
    pid_file, child_file = tmp_path / "pid", tmp_path / "child"
    pids: list[int] = []
    try:
        # warm up: this module is imported in the executor before the 0.5 s clock starts
        getpid() >> solo
        slow = sleeps_too_long(str(pid_file), str(child_file)) > solo
        queued = getpid() > solo  # waits on the same node behind the slow call
        with pytest.raises(sky.TaskTimeoutError) as info:
            slow.result()
        err = info.value
        assert isinstance(err, TimeoutError)
        assert err.node == 0
        assert err.timeout == 0.5
        assert "sleeps_too_long" in str(err)
        pids = [int(pid_file.read_text()), int(child_file.read_text())]
        assert_all_gone(pids, timeout=5, what="the timed-out task and its child")
        # the call queued behind it and the next call run in the replacement process
        replacement = queued.result(timeout=30)
        assert replacement not in pids
        assert getpid() >> solo == replacement
    finally:
        kill_quietly(pids)


# -- a pool that cannot start --------------------------------------------------------------


def test_executor_that_cannot_start_is_a_provision_error_leaving_nothing(
    tmp_path: Path,
) -> None:
    nodes_dir = tmp_path / "nodes"
    nodes_dir.mkdir()
    pool = sky.Compute(sky.Local(workdir=str(nodes_dir)), nodes=2, plugins=[BrokenPlugin()])
    try:
        with pytest.raises(sky.ProvisionError) as info, pool:
            raise AssertionError("the block must not run")
        message = str(info.value)
        assert "plugin broke" in message
        assert re.search(r"\bnode [01]\b", message), message
        assert pool.state is sky.PoolState.CLOSED
        assert wait_until(lambda: not processes_in(nodes_dir), timeout=5), [
            (pid, cmdline(pid)) for pid in processes_in(nodes_dir)
        ]
        assert list(nodes_dir.iterdir()) == []  # the nodes' working directories are gone
    finally:
        kill_quietly(processes_in(nodes_dir))


# -- output ----------------------------------------------------------------------------


@sky.function
def say(word: str) -> None:
    print(f"{word} from {sky.instance_info().node}")


def test_remote_lines_are_prefixed_with_their_node(
    duo: sky.Compute, capfd: pytest.CaptureFixture[str]
) -> None:
    say("ahoy") @ duo
    out = capfd.readouterr().out
    assert sorted(line for line in out.splitlines() if "ahoy" in line) == [
        "(node-0, rank=0) ahoy from 0",
        "(node-1, rank=1) ahoy from 1",
    ]


OUTPUT_CLIENT = """
    import os, time
    import flotilla as sky

    @sky.function
    def chatty(go: str) -> str:
        print("started")
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("finished")
        return "done" if os.path.exists(go) else "gave up"

    with sky.Compute(nodes=1) as pool:
        print("result:", chatty(GO_FILE) >> pool, flush=True)
"""


def test_output_streams_while_the_task_runs(tmp_path: Path) -> None:
    go = tmp_path / "go"
    client = Client(OUTPUT_CLIENT.replace("GO_FILE", repr(str(go))), tmp_path)
    try:
        client.expect(lambda line: line == "(node-0, rank=0) started")
        # seen while the task still waits for the go file
        assert not go.exists()
        assert client.proc.poll() is None
        assert not any("finished" in line for line in client.lines)
        go.touch()
        client.expect(lambda line: line == "(node-0, rank=0) finished")
        assert client.wait() == 0, client.stderr()
        assert client.rest_of_stdout()[-1] == "result: done"
    finally:
        client.kill()
