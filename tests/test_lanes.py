"""Lanes: a lone ``>>`` call straight between a Local client and an executor, past the
node's agent (``_node/lanes.py``, ``_client/lanes.py``), on real local pools.

``laned`` watches the real :func:`flotilla._client.lanes.send` (the ids of the calls it
sent on a lane): a test that needs a call to take a lane first waits until one does
(:func:`_lane_ready`: a replaced executor's lane comes a moment after its start)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _procs import _stat_state, alive, wait_until

import flotilla as sky
from flotilla._client import lanes as client_lanes
from flotilla._wire.frames import iter_frames


@sky.function
def noop(x: Any = None) -> Any:
    return x


@sky.function
def whose() -> tuple[int, int]:
    """The executor's pid and its agent's."""
    return os.getpid(), os.getppid()


@sky.function
def hold(path: str) -> int:
    """Say it runs (``path``.in, its pid), then run until ``path`` exists."""
    Path(path + ".in").write_text(str(os.getpid()))
    while not os.path.exists(path):
        time.sleep(0.01)
    return os.getpid()


@sky.function
def die(how: str) -> None:
    if how == "exit":
        os._exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


@sky.function(retries=1)
def once(marker: str) -> str:
    """Dies the first time (no ``marker`` yet), returns the next."""
    if not os.path.exists(marker):
        Path(marker).touch()
        os._exit(3)
    return "again"


@sky.function
def boom(x: int) -> None:
    raise ValueError(f"bad {x}")


@sky.function
def shout(i: int) -> int:
    print(f"line {i}", flush=True)
    subprocess.run(["echo", f"sub {i}"], check=True)  # (a child's write on fd 1)
    return i


@sky.function
def stdout_to(path: str) -> None:
    """Point fd 1 at ``path`` (a regular file: its unread count is 0, as an empty pipe's)."""
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 1)


@sky.function(timeout=1)
def brief() -> int:
    return os.getpid()


class Group:
    """A plugin whose processes form one group (as torch's do)."""

    forms_group = True

    def around_process(self, info: sky.InstanceInfo) -> None:
        return None


@pytest.fixture
def laned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the calls sent on a lane from now on."""
    sent: list[int] = []
    real = client_lanes.send

    def send(d: Any, call: Any, taken: list[Any]) -> Any:
        try:
            return real(d, call, taken)
        finally:  # (also when interrupted: Ctrl-C once the call runs)
            sent.extend(sub.tid for sub in taken if sub.lane is not None)

    monkeypatch.setattr(client_lanes, "send", send)
    return sent


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.Compute]:
    with sky.Compute(nodes=1) as p:
        yield p


def _text(path: Path) -> str:
    """``path``'s text, or "" while it does not exist."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _lane_ready(pool: sky.Compute, laned: list[int]) -> None:
    """Call until a call takes a lane (the function's first call goes the general way,
    a new executor's lane comes once it started), then forget those calls."""
    assert wait_until(lambda: noop(1) >> pool == 1 and bool(laned), 60)
    laned.clear()


def test_a_lone_call_goes_past_its_agent(pool: sky.Compute, laned: list[int]) -> None:
    """With the agent stopped (SIGSTOP), lone calls still run: their task and result go
    straight between this client and the executor."""
    (_, agent), *_ = whose() @ pool
    _lane_ready(pool, laned)
    calls = ThreadPoolExecutor(1)
    os.kill(agent, signal.SIGSTOP)
    try:
        done = calls.submit(lambda: [noop(i) >> pool for i in range(50)])
        assert done.result(timeout=60) == list(range(50))
    finally:
        os.kill(agent, signal.SIGCONT)
        calls.shutdown()
    assert len(laned) == 50


def test_a_lane_calls_output_arrives_before_its_value(laned: list[int]) -> None:
    """What a lane call printed (and a process it started) reaches the output sink
    before its value returns: its result then comes through the agent, after the output."""
    got: list[str] = []
    with sky.Compute(nodes=1) as pool:
        pool.output_sink = lambda rank, stream, lines: got.extend(lines)
        assert shout(-1) >> pool == -1
        _lane_ready(pool, laned)
        for i in range(20):
            assert shout(i) >> pool == i
            assert got[-2:] == [f"line {i}", f"sub {i}"]
            assert noop(i) >> pool == i
    assert len(laned) >= 20  # (the quiet ones at least)


def test_a_lane_call_that_redirects_stdout_leaves_the_next_ones_output_alone(
    laned: list[int], tmp_path: Path
) -> None:
    """A lane call that points fd 1 elsewhere, and prints nothing, answers on the lane (its
    output pipes are empty); the next calls' output still reaches the output sink."""
    got: list[str] = []
    with sky.Compute(nodes=1) as pool:
        pool.output_sink = lambda rank, stream, lines: got.extend(lines)
        stdout_to(str(tmp_path / "first")) >> pool
        assert shout(-1) >> pool == -1
        _lane_ready(pool, laned)
        stdout_to(str(tmp_path / "out")) >> pool
        assert laned
        for i in range(3):
            assert shout(i) >> pool == i
            assert got[-2:] == [f"line {i}", f"sub {i}"]
    assert (tmp_path / "out").read_text() == ""


@pytest.mark.parametrize(
    ("how", "said"), [("exit", "exited with status 3"), ("kill", "was killed by SIGKILL")]
)
def test_an_executor_that_dies_in_a_lane_call(
    pool: sky.Compute, laned: list[int], how: str, said: str
) -> None:
    die("") >> pool
    _lane_ready(pool, laned)
    with pytest.raises(sky.WorkerDiedError, match=f"the process running die\\(...\\) {said}"):
        die(how) >> pool
    assert len(laned) == 1
    assert noop(2) >> pool == 2


def test_a_lane_call_whose_process_died_is_retried(
    pool: sky.Compute, laned: list[int], tmp_path: Path
) -> None:
    assert once(str(tmp_path / "first")) >> pool == "again"
    _lane_ready(pool, laned)
    assert once(str(tmp_path / "second")) >> pool == "again"
    assert laned  # its first attempt took a lane


def test_a_lane_calls_exception_is_raised_as_today(pool: sky.Compute, laned: list[int]) -> None:
    with pytest.raises(ValueError, match="bad 0"):
        boom(0) >> pool
    _lane_ready(pool, laned)
    with pytest.raises(ValueError, match="bad 1") as info:
        boom(1) >> pool
    assert laned
    assert info.value.node == 0  # type: ignore[attr-defined]
    assert "raise ValueError" in info.value.remote_traceback  # type: ignore[attr-defined]


def test_a_broadcast_behind_a_lane_call_waits_without_its_timeout_running(
    pool: sky.Compute, laned: list[int], tmp_path: Path
) -> None:
    """A call the agent gets while a lane call runs on its slot waits for it: its timeout
    (1 s) does not run on the node meanwhile, so it does not stop the process running the
    lane call, though that runs longer. (The client's own watch of the timeout, for a
    frozen agent, counts from the send, as for any call queued behind another: the
    broadcast may end as a timeout there.)"""
    brief() @ pool
    (tmp_path / "warm.go").touch()
    hold(str(tmp_path / "warm.go")) >> pool
    running = ThreadPoolExecutor(2)
    path = tmp_path / "go"
    try:
        for attempt in range(3):  # a lone call that went the general way (seen once in a
            _lane_ready(pool, laned)  # loaded full run) sets nothing up: it ends, and again
            path = tmp_path / f"go{attempt}"
            started = Path(str(path) + ".in")
            lone = running.submit(lambda path=path: hold(str(path)) >> pool)
            assert wait_until(lambda started=started: bool(_text(started)), 60)
            if laned:
                break
            path.touch()
            lone.result(timeout=60)
        assert laned, "three lone calls in a row went the general way"
        broadcast = running.submit(lambda: brief() @ pool)
        time.sleep(2.5)  # longer than brief's timeout: the point of the test
        path.touch()
        assert lone.result(timeout=60) == int(started.read_text())  # not stopped
        with contextlib.suppress(sky.TaskTimeoutError):
            broadcast.result(timeout=60)
        assert len(brief() @ pool) == 1
    finally:
        path.touch()
        running.shutdown()


def test_ctrl_c_in_a_lane_call_stops_its_process(
    pool: sky.Compute, laned: list[int], tmp_path: Path
) -> None:
    (tmp_path / "warm.go").touch()
    hold(str(tmp_path / "warm.go")) >> pool
    _lane_ready(pool, laned)
    path = tmp_path / "go"
    started = Path(str(path) + ".in")

    def interrupt() -> None:  # once it runs (its pid written)
        if wait_until(lambda: started.exists() and bool(started.read_text()), 60):
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    # Python's own Ctrl-C, even where the suite started with SIGINT ignored (a background
    # job of a shell: CI run 30 waited here for 120 s)
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            hold(str(path)) >> pool
    finally:
        signal.signal(signal.SIGINT, saved)
    assert laned
    assert wait_until(lambda: not alive(int(started.read_text())), 60)  # replaced
    assert noop(3) >> pool == 3


def test_a_lane_call_whose_agent_is_killed_fails_as_on_a_lost_node(
    laned: list[int], tmp_path: Path
) -> None:
    with sky.Compute(nodes=1, options=sky.Options(replace_lost_nodes=False)) as pool:
        (tmp_path / "warm.go").touch()
        hold(str(tmp_path / "warm.go")) >> pool
        _, agent = whose() >> pool
        _lane_ready(pool, laned)
        path = tmp_path / "go"
        started = Path(str(path) + ".in")

        def kill() -> None:
            if wait_until(lambda: started.exists() and bool(started.read_text()), 60):
                os.kill(agent, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        with pytest.raises(sky.NodeLostError):
            hold(str(path)) >> pool
        assert laned
        assert wait_until(lambda: not alive(int(started.read_text())), 60)


def test_thread_slots_and_group_pools_take_no_lane(laned: list[int]) -> None:
    thread_slots = sky.Worker(concurrency=2, executor="thread")
    with sky.Compute(nodes=1, worker=thread_slots) as pool:
        noop() @ pool
        assert [noop(i) >> pool for i in range(20)] == list(range(20))
    with sky.Compute(nodes=2, plugins=[Group()]) as pool:  # type: ignore[list-item]
        noop() @ pool
        assert [noop(i) >> pool for i in range(20)] == list(range(20))
    assert laned == []


def test_a_dying_agents_lanes_are_not_taken() -> None:
    """A lone call goes the general way while the node's agent is exiting or gone (its
    executors outlive it by a moment: a call written on their lane could begin and die
    with them, where one written to the agent is never begun and goes elsewhere)."""
    proc = subprocess.Popen(["sleep", "600"])
    stat = os.open(f"/proc/{proc.pid}/stat", os.O_RDONLY)
    left, right = __import__("socket").socketpair()
    lanes = client_lanes.Lanes(left, stat)
    try:
        assert not lanes.agent_dying()
        os.kill(proc.pid, signal.SIGKILL)
        # not reaped: a zombie is still an exiting process, then gone once reaped
        assert wait_until(lambda: _stat_state(proc.pid) == "Z", timeout=60)
        assert lanes.agent_dying()
        proc.wait()
        assert lanes.agent_dying()
    finally:
        proc.kill()
        proc.wait()
        lanes.close()
        right.close()
    assert client_lanes.Lanes(right, -1).agent_dying()  # nothing to look at: no lane


_SERVE = """
import os, sys
from flotilla._node import executor
from flotilla._node.lanes import Board
task, result, lane_task, lane_result, board = map(int, sys.argv[1:])
streams = [os.dup(1), os.dup(2)]
executor._serve({}, {"local_rank": 0}, 0, task, result, [], executor._Forks(), streams, False,
                (lane_task, lane_result, Board(board)))
"""


def test_an_executor_answers_lane_tasks_however_their_bytes_come() -> None:
    """An executor (its serving loop, in a process of its own, on real pipes and board)
    runs and answers on the lane every task written there: two in one write (one read
    takes both), one in two writes, one alone, one behind a CANCEL on the task pipe (which
    holds no frame to run then: the executor still watches the lane); then the task
    pipe's SHUTDOWN ends it."""
    import operator

    from flotilla._node.lanes import Board
    from flotilla._wire.frames import TASK_HEAD, FrameReader, Kind, Status, frame, write_all
    from flotilla._wire.serialize import decode, encode, pickle_obj

    def payload(obj: Any) -> bytes:
        return b"".join(encode(pickle_obj(obj)))

    board = Board()
    task_r, task_w = os.pipe()
    result_r, result_w = os.pipe()
    lane_r, lane_w = os.pipe()
    answer_r, answer_w = os.pipe()
    theirs = [task_r, result_w, lane_r, answer_w, board.fd]
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, *map(str, theirs)],
        pass_fds=theirs,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    for fd in theirs[:-1]:
        os.close(fd)
    board.close()  # (the mapping stays)
    try:
        write_all(task_w, frame(Kind.DEFINE, 7, payload(operator.add)))
        assert next(iter_frames(result_r))[0] == Kind.READY

        def task(ident: int) -> bytes:
            body = TASK_HEAD.pack(0.0, 0) + payload((7, (ident, 100), {}))
            return b"".join(frame(Kind.TASK, ident, body))

        answers = FrameReader()
        got: list[tuple[int, int, int]] = []

        def answered(n: int) -> list[tuple[int, int, int]]:
            while len(got) < n:
                assert select.select([answer_r], [], [], 60)[0], f"answered: {got}"
                frames = answers.read(answer_r)
                assert frames is not None, proc.stderr.read() if proc.stderr else ""
                got.extend((kind, ident, decode(body, 1)) for kind, ident, body in frames)
                assert all(body[0] == Status.OK for _, _, body in frames)
            return got

        os.write(lane_w, task(1) + task(2))
        second = task(3)
        os.write(lane_w, second[:20])
        os.write(lane_w, second[20:])
        os.write(lane_w, task(4))
        assert answered(4) == [(Kind.RESULT, i, i + 100) for i in (1, 2, 3, 4)]
        write_all(task_w, frame(Kind.CANCEL, 99))  # (of a call it never saw: nothing to do)
        os.write(lane_w, task(5))
        assert answered(5)[-1] == (Kind.RESULT, 5, 105)
        os.close(lane_w)
        lane_w = -1
        write_all(task_w, frame(Kind.SHUTDOWN, 0))
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.communicate()
        for fd in (task_w, result_r, answer_r, lane_w):
            if fd >= 0:
                os.close(fd)


def test_a_small_value_pickled_the_short_way_is_what_the_general_way_sends() -> None:
    """``serialize.plain_parts`` (an executor's result, pickled and framed in one step)
    gives the parts ``encode(pickle_obj(...))`` gives for small builtin data, None itself
    included, and declines anything else (which takes the general way)."""
    from flotilla._wire.serialize import encode, pickle_obj, plain_parts

    class Point:
        pass

    for value in (None, True, 3, 2.5, "é" * 3000, b"x" * 4000, (1, [2, {"a": None}]), {}):
        assert plain_parts(value) == encode(pickle_obj(value)), value
    for other in (Point(), b"x" * 5000, [[[[[1]]]]], list(range(100)), noop):
        assert plain_parts(other) is None
