"""The executor: the persistent process on a node that runs tasks.

The agent forks it (and forks a new one when it dies or a task times out). It enters the
plugins' ``around_process`` hooks once, says READY, then runs the tasks it is sent one at a
time, in order, answering each with a RESULT frame. Its stdout/stderr are pipes the agent
forwards to the client; the protocol uses two other pipes, so prints cannot corrupt it.

On a Local node it also serves its lane (:mod:`.lanes`): a task the client wrote there is
run as one from its task pipe (which it reads first, when both have something), with the
board saying which one runs; its RESULT goes back on the lane when none of its output can
still be on its way, else on the result pipe, after the output, through the agent.
"""

from __future__ import annotations

import _pickle as pickle  # pickle.py adds re, struct and its Python twin: ~1 ms of a start
import array
import faulthandler
import fcntl
import gc
import os
import select
import struct
import sys
import termios
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from contextlib import ExitStack
from functools import partial
from types import GeneratorType

from .._system import fastjson as json
from .._wire.bodies import Config, dump
from .._wire.frames import (
    CREDIT_BODY,
    HEADER,
    HEADER_SIZE,
    STREAM_WINDOW,
    TASK_HEAD,
    UNMAPPED,
    Body,
    FrameReader,
    Kind,
    Status,
    frame,
    write_all,
    write_frame,
)
from .lanes import LARGEST, RUNNING, SEQ, WORD, Board

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

serving = False
"""True in a process that runs a pool's tasks (set by :func:`main`; a task's forks keep it):
``flotilla._info.in_task`` reads it."""


def import_setting(config: Config) -> tuple[list[str], dict[str, str]]:
    """What an executor puts first on its import path and sets in its environment before
    it imports anything of the user's: the pool's variables (``config["env"]``) and the
    Image's environment on this node (its includes and site folders on the import path and
    ``PYTHONPATH``, its ``bin`` on ``PATH``), read from the agent's environment."""
    env = dict(config.get("env", {}))
    image_dir = config.get("image_dir")
    if not image_dir:
        return [], env
    paths = [os.path.join(image_dir, "includes"), os.path.join(image_dir, "site")]
    old = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])
    bin_dir = os.path.join(image_dir, "site", "bin")
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", os.environ.get("PATH", ""))
    return paths, env


def main(
    config: Config,
    blob: bytes,
    rfd: int,
    wfd: int,
    others: Sequence[tuple[int, int, int]] = (),
    lane: tuple[int, int, Board] | None = None,
) -> NoReturn:
    """Run the executor loop; never returns. ``others``: the (slot, task pipe, result pipe)
    of the node's other task slots, served by threads of this process
    (``Worker(executor="thread")``: one process, shared memory and GIL, as Skyward's).
    ``lane``: its lane's task pipe, result pipe and board (see :mod:`.lanes`)."""
    paths, env = import_setting(config)
    sys.path[:0] = paths
    os.environ.update(env)
    info = json.loads(config["compute_pool"])
    slot = config.get("local_rank", 0)
    info["worker"] = slot  # the task slot; the local rank of a plugin's processes too
    info["local_rank"] = slot if info.get("procs_per_node", 1) > 1 else 0
    # (not InstanceInfo's: for the group plugins' rendezvous, see plugins._env.group_setting)
    info["generation"] = config.get("generation", 0)
    info["start_timeout"] = config.get("start_timeout", 0.0)
    os.environ["COMPUTE_POOL"] = json.dumps(info)
    result_fds = [wfd, *(w for _, _, w in others)]
    faulthandler.enable()  # a crash leaves its Python traceback in the stderr tail
    if isinstance(sys.stdout, __import__("io").TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    stack = ExitStack()
    try:
        from .hooks import enter_plugins

        global serving
        serving = True  # a flotilla function called by a task runs right here
        plugins = pickle.loads(blob) if blob else []
        if config.get("group"):  # every node reaches the head before the collective forms
            from .preflight import preflight

            unreachable = preflight(info)
            if unreachable:
                for fd in result_fds:
                    _send(fd, Kind.READY, 0, dump({"error": unreachable}))
                _flush()
                os._exit(1)
        enter_plugins(stack, plugins)
    except BaseException:
        for fd in result_fds:
            _send(fd, Kind.READY, 0, dump({"error": _formatted()}))
        _flush()
        os._exit(1)
    forked: list[bool] = []  # not empty in a child a task forked (no system call per task)
    forks = _Forks()  # forks made here (a task's): a child may still show its arguments
    os.register_at_fork(before=forks.count, after_in_child=lambda: forked.append(True))
    streams = [os.dup(1), os.dup(2)]  # the output pipes, restored after every task
    threads = [
        threading.Thread(
            target=_serve,
            args=(config, info, other, r, w, forked, forks, streams, True),
            name=f"flotilla-slot-{other}",
            daemon=True,
        )
        for other, r, w in others
    ]
    for thread in threads:
        thread.start()
    _serve(config, info, slot, rfd, wfd, forked, forks, streams, False, lane)
    for thread in threads:
        thread.join()
    try:
        stack.close()
    finally:
        _flush()
        os._exit(0)


def _serve(
    config: Config,
    info: dict[str, Any],
    slot: int,
    rfd: int,
    wfd: int,
    forked: list[bool],
    forks: _Forks,
    streams: list[int],
    threaded: bool,
    lane: tuple[int, int, Board] | None = None,
) -> None:
    """Say READY, then run the tasks of ``slot`` sent on ``rfd`` (answers on ``wfd``) until
    SHUTDOWN or the end of the pipe. ``threaded``: a thread slot other than the process's
    first (its place in the pool, collections and streamed arguments are this thread's)."""
    from .._wire import serialize as _serialize
    from . import feeds

    shm_prefix: str = config.get("shm_prefix", "")
    if threaded:
        from .._info import set_thread_pool

        info = {**info, "worker": slot}
        set_thread_pool(json.dumps(info))
    _send(wfd, Kind.READY, 0, dump({"pid": os.getpid()}))
    functions: dict[int, Any] = {}
    inbox = _Inbox(rfd, lane[0] if lane is not None else -1)
    lane_out, board = (lane[1], lane[2]) if lane is not None else (-1, None)
    if board is not None:  # the board's words, looked at and set without a Python frame
        look = partial(WORD.unpack_from, board.mem)
        put = partial(WORD.pack_into, board.mem)
    write_lock = threading.Lock()  # RESULT and STORE frames share the result pipe
    count = array.array("i", [0])  # (see lane_task)
    out_pipe, err_pipe = streams  # the output pipes (fds 1 and 2 between tasks)
    ioctl, unread = fcntl.ioctl, termios.FIONREAD
    if info.get("cluster"):  # the distributed collections (storechannel.py)
        from .storechannel import Channel, install

        install(Channel(wfd, write_lock, inbox.answer), this_thread=threaded)

    def credit_feed(ident: int, index: int, body: bytes) -> None:
        with write_lock:
            write_all(wfd, frame(Kind.CREDIT, ident, bytes((index,)), body))

    def task_ref(ident: int, body: Body) -> bool:
        """A call whose arguments the agent holds in a shared-memory file (a relayed
        payload, see relay.py): mapped copy-on-write, not copied through the pipe."""
        name = bytes(body[TASK_HEAD.size :]).decode()
        try:
            payload = _serialize.map_private(name)
        except OSError as e:
            err = _describe(OSError(f"the relayed arguments cannot be read ({e})"))
            parts = _serialize.encode(_serialize.pickle_obj(err))
            with write_lock:
                write_all(wfd, frame(Kind.RESULT, ident, bytes((Status.ERROR,)), *parts))
            return True
        mapping: Any = payload.obj  # (the mmap itself: the call's unmap closes it, see _run)
        payload.release()
        return task(ident, mapping, 0, mapping)

    # the running task's feeds: this thread's, or the process's (its main thread serves
    # the first slot: no look at which thread runs, per task)
    set_context = feeds.set_current if threaded else partial(setattr, feeds, "current")

    def skipped(ident: int) -> bool:
        """Whether task ``ident`` was cancelled before it began: then answered CANCELLED."""
        if ident not in inbox.cancelled:
            return False
        inbox.cancelled.discard(ident)
        write_all(wfd, frame(Kind.RESULT, ident, _STATUS[Status.CANCELLED]))
        return True

    def task(
        ident: int, body: Body | memoryview, offset: int = TASK_HEAD.size, mapped: Any = None
    ) -> bool:
        if skipped(ident):
            return True
        set_context(
            feeds.Context(ident, inbox.feed, partial(credit_feed, ident), _serialize.decode)
        )
        try:
            status, parts = _run(
                functions, body, offset, shm_prefix, _serialize, stream, ident, forks, mapped
            )
        finally:
            set_context(None)
            inbox.feeds.pop(ident, None)
            inbox.credits.pop(ident, None)
            inbox.closing.discard(ident)
        if forked:  # a child the task forked returned here: it has no say
            os._exit(0)
        _flush()  # the task's output goes before its result
        with write_lock:
            write_frame(wfd, Kind.RESULT, ident, _STATUS[status], *parts)
        _restore_streams(streams)  # for the next task (the result is on its way meanwhile)
        return True

    def lane_task(ident: int, body: Body, offset: int = TASK_HEAD.size) -> None:
        """Run a task the client wrote on the lane (see lanes.py), as :func:`task` runs
        one (no streamed argument, no shared memory: see ``_client/lanes.py``): said
        RUNNING first, then a CANCEL looked for (the agent's, if sent, is seen); its
        RESULT on the lane when no output of it can be on its way, else on ``wfd``.
        ``offset``: where its task head ends in ``body``."""
        put(RUNNING, ident)
        if task_pipe(0):  # (what the task pipe holds: a CANCEL of it?)
            inbox.read_ahead()
        if ident in cancelled and skipped(ident):
            put(RUNNING, -ident)  # (answered: see lanes.py)
            return
        seq = look(SEQ)[0]
        status, parts = _run(functions, body, offset, shm_prefix, _serialize, stream, ident, forks)
        if inbox.credits or inbox.closing:  # (a generator it returned was streamed)
            inbox.credits.pop(ident, None)
            inbox.closing.discard(ident)
        if forked:  # a child the task forked returned here: it has no say
            os._exit(0)
        # the task's output goes before its result; fds 1 and 2 restored for the next
        # task, before the result: the caller it wakes may wait for this process's CPU
        # until it sleeps again (a pipe's wake-up is a synchronous one)
        _restore_streams(streams, flush=True)
        out = wfd  # on the lane only if no output of the task can be on its way (see
        # lanes.py): the output pipes hold nothing unread, and SEQ is the same even number
        # as before the task (it only grows: the agent read nothing meanwhile)
        if not seq & 1 and (len(parts[0]) < LARGEST if len(parts) == 1 else _small(parts)):
            try:  # (``count``: a one-int array the kernel writes each count into)
                ioctl(out_pipe, unread, count)
                if not count[0]:
                    ioctl(err_pipe, unread, count)
                    if not count[0] and look(SEQ)[0] == seq:
                        out = lane_out
            except OSError:  # (a task closed one)
                pass
        if out == lane_out and len(parts) == 1:  # (the usual: a small value, one part;
            # the lane is this thread's alone)
            data = _RESULT.pack(Kind.RESULT, ident, len(parts[0]) + 1, status) + parts[0]
            written = os.write(out, data)
            if written < len(data):  # (a signal cut it short)
                write_all(out, [memoryview(data)[written:]])
        else:
            with write_lock:
                write_frame(out, Kind.RESULT, ident, _STATUS[status], *parts)
        put(RUNNING, -ident)

    def stream(ident: int, values: Generator[Any, Any, Any]) -> None:
        """Send a yielding task's values as they come, STREAM_WINDOW ahead of the client's
        CREDIT (a slow consumer pauses the generator here). It returns early, the
        generator waiting at a yield, when its caller closed the iterator (CLOSE), the
        executor is to stop (SHUTDOWN) or the agent is gone: the caller (``_run``) closes
        the generator then, as Python's ``close()`` does (its ``finally`` runs here)."""
        allowed = STREAM_WINDOW
        sent = 0
        while not inbox.ending(ident):
            try:
                value = next(values)
            except StopIteration:
                return
            while sent >= allowed:
                more = inbox.credit(ident)
                if more is None:  # the value is dropped: the generator waits at its yield
                    if inbox.eof:  # the agent is gone: nobody reads a result
                        try:
                            values.close()
                        finally:
                            os._exit(0)
                    return
                allowed += more
            parts = _serialize.encode(_serialize.pickle_obj(value))
            with write_lock:
                write_all(wfd, frame(Kind.YIELD, ident, *parts))
            sent += 1

    def define(ident: int, body: Body) -> bool:
        functions[ident] = _serialize.decode(body)
        return True

    def members(ident: int, body: Body) -> bool:
        new = json.loads(bytes(body))
        new["local_rank"] = info["local_rank"]
        if threaded:
            new["worker"] = slot
            set_thread_pool(json.dumps(new))
        else:
            os.environ["COMPUTE_POOL"] = json.dumps(new)
        return True

    # kind -> handler(ident, body), False to stop (CANCEL frames are taken by the inbox)
    handlers: dict[int, Callable[[int, Body], bool]] = {
        Kind.TASK: task,
        Kind.TASKREF: task_ref,
        Kind.DEFINE: define,
        Kind.MEMBERS: members,
        Kind.SHUTDOWN: lambda ident, body: False,
    }

    def lane_calls() -> None:
        """Run the lane's tasks while it alone holds something, each read whole by one
        read (its client writes a task whole: see LARGEST) and run from here: a lone
        call's round trip makes no Python frame more than it needs. What else comes (the
        task pipe holds something, a frame in parts, more than one, the lane's end) is
        left to ``inbox.next``."""
        wait = inbox.both.poll
        queued = inbox.frames
        while not queued and not inbox.eof:
            ready = wait()
            if len(ready) != 1 or ready[0][0] != lane_fd:
                return  # (the task pipe first: see lanes.py)
            data = os.read(lane_fd, 65536)
            if len(data) >= lane_start:
                kind, ident, length = HEADER.unpack_from(data)
                if kind == Kind.TASK and len(data) == HEADER_SIZE + length:
                    lane_task(ident, data, lane_start)
                    continue
            inbox.lane_data(data)
            return

    lane_fd = inbox.lane
    lane_start = HEADER_SIZE + TASK_HEAD.size  # (where a lane frame's task head ends)
    lane_kind = Kind.TASK if board is not None else -1  # (a lane frame: see lanes.py)
    task_pipe = inbox.poller.poll
    cancelled = inbox.cancelled
    while True:
        if inbox.lane >= 0 and not inbox.lane_frames and inbox.lane_reader.idle:
            lane_calls()
        item = inbox.next()
        if item is None:
            break
        kind, ident, body = item
        if kind == lane_kind and inbox.lane_ident:
            inbox.lane_ident = 0
            lane_task(ident, body)
            continue
        handler = handlers.get(kind)
        if handler is not None and not handler(ident, body):
            break
        if inbox.lane_ident and board is not None:  # a lane frame that was not a task
            put(RUNNING, -inbox.lane_ident)
            inbox.lane_ident = 0


def _small(parts: list[Any]) -> bool:
    """Whether a result fits an empty pipe (a lane's reader may be gone: never wait)."""
    size = 0
    for p in parts:  # (a loop: sum() over a generator costs more, per call)
        size += p.nbytes if isinstance(p, memoryview) else len(p)
    return size < LARGEST


_OK = Status.OK  # (one lookup, not two, per task)
_RESULT = struct.Struct(HEADER.format + "B")
"""A RESULT frame's header and status byte (a lane task's, in one step)."""
_STATUS = [bytes((i,)) for i in range(256)]
"""A RESULT's status byte, by value (none made per task)."""


def _restore_streams(saved: list[int], flush: bool = False) -> None:
    """Point file descriptors 1 and 2 (and sys.stdout/sys.stderr) at the output pipes
    again: a task may have closed or redirected them (``os.close(1)``). ``flush``: first
    flush sys.stdout and sys.stderr, as :func:`_flush` (a lane task's, in one step)."""
    out, err = sys.stdout, sys.stderr
    if flush:
        for stream in (out, err):
            try:
                stream.flush()
            except Exception:
                pass
    try:
        os.dup2(saved[0], 1)
    except OSError:
        pass
    try:
        os.dup2(saved[1], 2)
    except OSError:
        pass
    if out is None or getattr(out, "closed", False):
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    if err is None or getattr(err, "closed", False):
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


class _Inbox:
    """Frames from the agent, read ahead so that a CANCEL queued behind a task is seen
    before the task runs. The pipe is blocking: a wait for the next frame is the read
    itself (no poll first); a read that must not wait asks ``poll`` first.

    Threads of a task may wait on it at once (one for a value of a streamed argument,
    another for the answer of the collections): one of them reads (it holds ``alone``),
    the others wait for what it reads (``turn``), and take over when it is done. (Two threads
    in a read would each keep waiting when the other one read what it waited for.)"""

    def __init__(self, fd: int, lane: int = -1) -> None:
        self.fd = fd
        os.set_blocking(fd, True)
        self.poller = select.poll()
        self.poller.register(fd, select.POLLIN)
        self.lane = lane  # the lane's task pipe (see lanes.py), -1: none
        self.lane_ident = 0  # the id of the lane task being run (0: none)
        self.lane_reader = FrameReader()
        self.lane_frames: deque[tuple[int, int, Body]] = deque()  # read, not run yet
        self.both: Any = None  # a poll of the task pipe and the lane
        if lane >= 0:
            os.set_blocking(lane, True)
            self.both = select.poll()
            self.both.register(fd, select.POLLIN)
            self.both.register(lane, select.POLLIN)
        self.reader = FrameReader()
        self.frames: deque[tuple[int, int, Body]] = deque()
        self.cancelled: set[int] = set()
        self.answers: dict[int, Body] = {}  # STORED frames, by request id
        self.credits: dict[int, int] = {}  # CREDIT frames, by task id
        self.feeds: dict[int, deque[Body]] = {}  # FEED frames, by task id
        self.closing: set[int] = set()  # CLOSE frames: yielding tasks whose caller closed
        self.shutdown = False  # a SHUTDOWN frame came (it is queued in ``frames`` too)
        self.eof = False
        self.alone = threading.Lock()  # held by the thread that reads the pipe
        self.guard = threading.Lock()
        self.turn = threading.Condition(self.guard)  # notified after a read, if waited on
        self.waiting = 0  # threads waiting on ``turn`` (or about to)

    def next(self) -> tuple[int, int, Body] | None:
        """The next frame to run (None: the task pipe ended): the task pipe's first, else
        the lane's (``lane_ident`` then is its id; see lanes.py)."""
        queued = self.lane_frames
        while True:
            lane = self.lane
            while (lane >= 0 or queued) and not self.frames and not self.eof:
                if not queued:
                    ready = self.both.poll()  # (one fd ready, or both: no dict made)
                    if ready and (len(ready) > 1 or ready[0][0] != lane):  # the task
                        break  # pipe first (see lanes.py)
                    got = self.lane_reader.read(lane)
                    if got is None:  # the client closed it
                        self.lane_data(b"")
                        break
                    queued.extend(got)
                elif self.poller.poll(0):  # (the task pipe first)
                    break
                if queued:
                    first = queued.popleft()
                    self.lane_ident = first[1]
                    return first
            # what the task pipe holds (else what came behind the queued frames, a CANCEL);
            # waited for only when the lane is gone: else it may hold no frame to run (a
            # CANCEL alone), and the lane is watched again
            lane = self.lane
            self._read(block=not self.frames and not queued and lane < 0)
            if self.frames or self.eof or (lane < 0 and not queued):
                return self.frames.popleft() if self.frames else None

    def lane_data(self, data: bytes) -> None:
        """Take bytes read from the lane but not run at once: their frames are queued
        for :meth:`next`; b"": the lane's end (the client closed it)."""
        if data:
            self.lane_frames.extend(self.lane_reader.feed(data))
        elif self.lane >= 0:
            self.both.unregister(self.lane)
            self.lane = -1

    def read_ahead(self) -> None:
        """Take in what the task pipe holds now (a CANCEL), without waiting."""
        if not self.eof:
            self._read(block=False)

    def answer(self, ident: int) -> Body | None:
        """Wait for the STORED frame answering request ``ident``; None at end of stream.
        Called by a task (the loop does not read meanwhile: it is running the task)."""
        while ident not in self.answers:
            if self.eof:
                return None
            self._read(block=True, until=lambda: ident in self.answers)
        return self.answers.pop(ident)

    def credit(self, ident: int) -> int | None:
        """Wait for CREDIT for task ``ident``: how many values more; None when the task is
        to end instead (see :meth:`ending`)."""

        def ready() -> bool:
            return ident in self.credits or self._ends(ident)

        while not ready():
            self._read(block=True, until=ready)
        if self._ends(ident):
            return None
        return self.credits.pop(ident)

    def ending(self, ident: int) -> bool:
        """Whether yielding task ``ident`` is to end at its next yield: its caller closed
        the iterator (CLOSE), the executor is to stop (SHUTDOWN), or the agent is gone.
        Reads what came meanwhile (without waiting)."""
        if not self.eof:
            self._read(block=False)
        return self._ends(ident)

    def _ends(self, ident: int) -> bool:
        return self.eof or self.shutdown or ident in self.closing

    def feed(self, ident: int) -> Body | None:
        """Wait for the next FEED frame of task ``ident``; None at end of stream."""
        while not self.feeds.get(ident):
            if self.eof:
                return None
            self._read(block=True, until=lambda: bool(self.feeds.get(ident)))
        return self.feeds[ident].popleft()

    def _read(self, block: bool, until: Callable[[], bool] | None = None) -> None:
        """Read what the pipe holds; with ``block``, wait until a frame (or ``until()``).
        While another thread reads, wait for what it reads instead (or, without ``block``,
        leave it to that thread)."""
        if not self.alone.acquire(False) and not self._wait_turn(block, until):
            return
        try:
            while not self.eof:
                waiting = block and (not self.frames if until is None else not until())
                if not waiting and not self.poller.poll(0):
                    return  # nothing more now (a read would wait)
                got = self.reader.read(self.fd)  # (waits for the agent when ``waiting``)
                if got is None:
                    self.eof = True
                    return
                for kind, ident, body in got:
                    if kind == Kind.CANCEL:
                        self.cancelled.add(ident)
                    elif kind == Kind.STORED:
                        self.answers[ident] = body
                    elif kind == Kind.FEED:
                        self.feeds.setdefault(ident, deque()).append(body)
                    elif kind == Kind.CREDIT:
                        more = CREDIT_BODY.unpack_from(body)[0]
                        self.credits[ident] = self.credits.get(ident, 0) + more
                    elif kind == Kind.CLOSE:
                        self.closing.add(ident)
                    else:
                        self.shutdown = self.shutdown or kind == Kind.SHUTDOWN
                        self.frames.append((kind, ident, body))
                if self.waiting:  # (what a waiting thread waits for may have come)
                    with self.guard:
                        self.turn.notify_all()
                if not (self.frames if until is None else until()):
                    continue  # nothing yet, or part of a frame: on (waiting if ``block``)
                if not self.reader.more:  # the pipe is drained
                    return
                block = False
        finally:
            self.alone.release()
            if self.waiting:  # one of them reads next, if what it waits for is not here
                with self.guard:
                    self.turn.notify_all()

    def _wait_turn(self, block: bool, until: Callable[[], bool] | None) -> bool:
        """Wait while another thread reads, for what it reads: True when this one reads
        now (it holds ``alone``), False when what it waits for came (or, without
        ``block``, at once)."""
        with self.guard:
            self.waiting += 1  # first: a reader that read, or let go, since then notifies
            try:
                while True:
                    if not block or self.eof or (self.frames if until is None else until()):
                        return False
                    if self.alone.acquire(False):
                        return True
                    self.turn.wait()
            finally:
                self.waiting -= 1


class _Forks:
    """How many times this process forked (counted before each fork)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def count(self) -> None:
        self.n += 1


def _run(
    functions: dict[int, Any],
    body: Body | memoryview,
    offset: int,
    shm_prefix: str,
    ser: Any,
    stream: Callable[[int, Generator[Any, Any, Any]], None],
    ident: int,
    forks: _Forks,
    mapped: Any = None,
) -> tuple[int, list[Any]]:
    """Run task ``ident``: its status byte (with :data:`UNMAPPED` when it says so) and the
    wire parts of its result (a generator's values go to ``stream(ident, generator)``).
    ``mapped``: the mapping ``body`` is (a relayed payload's file), unmapped with the
    arguments'."""
    # the mappings of the arguments' shared-memory files, if any
    maps: list[Any] = [] if mapped is None else [mapped]
    forks_before = forks.n
    args: Any = None
    kwargs: Any = None
    status: int
    try:
        fn_key, args, kwargs = ser.decode(body, offset, maps)
        value = functions[fn_key](*args, **kwargs)
        args = kwargs = None
        if isinstance(value, GeneratorType):  # a generator: its values go as YIELD frames
            try:
                stream(ident, value)
            finally:
                value.close()
            value = None
        status = _OK
    except BaseException as e:  # user code: report everything, including SystemExit
        args = kwargs = None
        value = _describe(e)
        status = Status.ERROR
    parts = ser.plain_parts(value)  # small builtin data (the usual value): at once
    if parts is None:
        try:
            pickled = ser.pickle_obj(value)
        except Exception as e:
            found = ser.describe_unpicklable(value, "result")
            where = f" at {found[0]} (type {found[1]})" if found else ""
            msg = f"the task's return value cannot be pickled{where}: {e}"
            pickled = ser.pickle_obj((None, "flotilla.SerializationError", msg, _formatted()))
            status = Status.ERROR
        shm = ser.write_shm(pickled, shm_prefix) if shm_prefix and pickled.shm_bytes else ""
        parts = ser.encode(pickled, shm)
        del pickled
    del value  # (the result's inline buffers live on in parts)
    if maps and _unmapped(ser, maps, parts, status == Status.ERROR) and forks.n == forks_before:
        status |= UNMAPPED  # the client may write the file again (see frames.UNMAPPED)
    return status, parts


def _unmapped(ser: Any, maps: list[Any], parts: list[Any], failed: bool) -> bool:
    """Unmap the task's arguments, the task done and its result encoded: whether nothing
    shows their memory any more (a task that kept an array, e.g. in a global, keeps its
    mapping; then False). The result's inline buffers may be views of the arguments (a
    slice returned): those are copied first (they are small, the large ones went to a
    file of their own). A failed task's traceback may have left the arguments in a
    reference cycle: collected first."""
    if ser.unmap(maps):
        return True
    views = [i for i, p in enumerate(parts) if isinstance(p, memoryview)]
    if not views and not failed:
        return False
    for i in views:
        parts[i] = bytes(parts[i])
    if failed:
        gc.collect()
    return bool(ser.unmap(maps))


def _describe(e: BaseException) -> tuple[bytes | None, str, str, str]:
    """(pickled exception or None, type name, message, formatted traceback)."""
    import traceback

    from .._wire.serialize import dumps

    t = type(e)
    tb = "".join(
        traceback.format_exception(t, e, e.__traceback__.tb_next if e.__traceback__ else None)
    )
    e.__traceback__ = None
    try:
        data: bytes | None = dumps(e)
    except Exception:
        data = None
    return data, f"{t.__module__}.{t.__qualname__}", str(e), tb


def _formatted() -> str:
    """The exception being handled, formatted. ``traceback`` (with ``textwrap``'s
    expressions, ~2 ms) is imported by the first failure, not by every node's start."""
    import traceback

    return traceback.format_exc()


def _send(fd: int, kind: int, ident: int, body: bytes) -> None:
    write_all(fd, frame(kind, ident, body))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
