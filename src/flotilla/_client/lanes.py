"""A lone call straight to an executor of a Local node, past its agent: the client's end
of a lane (what a lane is, and who writes what on its board: ``_node/lanes.py``).

A Local agent sends its client, on the lane socket it was started with, each executor's
lane: the slot, the executor's pid, the task pipe's write end, the result pipe's read end
and its board (:class:`Lanes` takes them in, in the caller's thread, without waiting).
A lone ``call >> pool`` takes its slot's lane (:func:`send`) when it can go no other way
than the general path would send it, with nothing lost by skipping the agent:

- the least busy (node, slot) is a READY node's idle slot that has a lane;
- the function was defined on that node already (its first call sends DEFINE the general
  way, and once the agent answered a call of it, every executor of the node has it in its
  task pipe, which it reads before its lane), it has no timeout (the agent times calls),
  no streamed argument;
- its arguments are one small part (no shared-memory file, no fan-out): the frame fits an
  empty pipe, so the write never waits.

The call is then in the node's ``inflight`` and busy on its slot like any other (a node
lost, a pool closed, the agent's DIED or CANCELLED for it settle it as today), and counts
as started for retries (a lane call lost with its node is sent again only with
``retries=``: at most once). Its caller reads the lane's result pipe (:func:`wait`); the
agent's stream stays the event loop's, which wakes the caller when it settles the call (a
result the agent forwarded: one that had output before it; its DIED or CANCELLED; a node
lost). A value read on the lane is settled here the short way (:func:`_finished`: what
``Node._on_frames`` and the dispatcher do for it, the observers told the same); any other
answer goes through ``Node._on_frames`` as one from the agent does.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import socket
import struct
import threading
import time
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._providers.pipe import SPIN, idle_core
from .._wire.frames import HEADER, HEADER_SIZE, TASK_HEAD, FrameReader, Kind, Status
from .._wire.lanes import CLAIMED, CLOSED, LARGEST, MESSAGE, RUNNING, SEEN, WORD, Board
from .._wire.serialize import _PLAIN_BYTES, PAYLOAD_HEAD, Pickled, _plain, pickle_obj
from .feeds import streamed_parameters
from .node import Node, NodeState, Payload, Submission, next_id
from .stream import yields

if TYPE_CHECKING:
    from .._wire.frames import Buffer
    from .dispatch import Dispatcher
    from .function import Function, PendingCall

GONE = 0.5
"""Seconds a lost node's executor gets to be gone before its lane calls count as started
(see :meth:`Lane.started`)."""
_PF_EXITING = 0x4
"""``/proc/PID/stat``'s flags (its 9th field): the process is exiting."""
_SIGKILL_PENDING = 1 << 8
"""``/proc/PID/stat``'s pending signals (its 31st field): SIGKILL (9)."""


@dataclass(eq=False)
class Lane:
    """One executor's lane, as the client holds it."""

    slot: int
    pid: int
    task_fd: int
    result_fd: int
    board: Board
    reader: FrameReader = field(default_factory=FrameReader)
    ended: bool = False  # its result pipe ended (the executor is gone)
    answered: float = SPIN / 2  # how long recent answers took (seconds: see wait)
    orphan: bool = False  # the agent had closed its board when the last call was sent

    def started(self, ident: int) -> bool:
        """Whether call ``ident``, sent on this lane, may have started: False only when
        the executor is gone (no writer of the result pipe is left: its agent's death
        killed it, it is given :data:`GONE` seconds for that) and never began it."""
        gone = select.poll()
        gone.register(self.result_fd, select.POLLIN)
        deadline = time.monotonic() + GONE
        while True:
            for _, events in gone.poll(max(0.0, deadline - time.monotonic()) * 1000):
                if events & select.POLLIN:  # its answer (it ran), or more to read
                    return True
                if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    return self.board.get(RUNNING) in (ident, -ident)
            if time.monotonic() >= deadline:
                return True

    def close(self) -> None:
        """No call takes it any more; its descriptors close once no caller holds it (its
        last reference goes: a caller still waiting on it never reads another's pipe)."""
        self.ended = True

    def __del__(self) -> None:
        for fd in (self.task_fd, self.result_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.board.close()


class Lanes:
    """A Local node's lanes, by slot, as its agent sent them (see the module docstring).
    ``stat``: the agent's ``/proc/PID/stat``, open (-1: none), for :meth:`agent_dying`."""

    def __init__(self, sock: socket.socket, stat: int = -1) -> None:
        self.sock = sock
        self.stat = stat
        self.by_slot: dict[int, Lane] = {}
        self.lock = threading.Lock()  # one taker of the socket at a time
        self.closed = False

    def agent_dying(self) -> bool:
        """Whether the agent is being killed or is ending (a SIGKILL pending, or exiting),
        or cannot be looked at. Its executors outlive it by a moment (until its descriptors
        close: their lifeline), so a call written on a lane then could begin and die with
        them, where one written to the dying agent is never begun and goes to another node:
        such a call goes the general way. A signal sent before this look is seen by it (the
        kernel marks every thread of its target when it sends a SIGKILL)."""
        if self.stat < 0:
            return True
        try:
            stat = os.pread(self.stat, 1024, 0)
            fields = stat[stat.rindex(b")") + 2 :].split(b" ", 29)  # (as far as the 31st)
            return bool(int(fields[6]) & _PF_EXITING or int(fields[28]) & _SIGKILL_PENDING)
        except (OSError, IndexError, ValueError):  # (gone: ESRCH)
            return True

    def take(self) -> None:
        """Take in the lanes the agent sent (never waits): a slot's new lane replaces its
        last one."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            while not self.closed:
                try:
                    data, fds, _, _ = socket.recv_fds(self.sock, MESSAGE.size, 3)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    data, fds = b"", []
                if len(data) != MESSAGE.size or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    if not data:  # the agent is gone
                        return
                    continue
                slot, pid = MESSAGE.unpack(data)
                try:
                    board = Board(fds[2])
                except (OSError, ValueError):
                    for fd in fds:
                        os.close(fd)
                    continue
                board.close()  # (the mapping stays)
                old = self.by_slot.get(slot)
                self.by_slot[slot] = Lane(slot, pid, fds[0], fds[1], board)
                if old is not None:
                    old.close()
                    del old
        finally:
            self.lock.release()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for lane in self.by_slot.values():
                lane.close()
            self.by_slot.clear()
            self.sock.close()
            stat, self.stat = self.stat, -1  # (a look meanwhile finds -1, or fails)
            if stat >= 0:
                os.close(stat)


def send(
    d: Dispatcher, call: PendingCall[Any], taken: list[Submission]
) -> tuple[Node, Lane, Submission] | None:
    """Send ``call`` on a lane if it can take one (see the module docstring); None when it
    goes the general way (nothing of it sent). Its submission is in ``taken`` from its
    claim on (for :func:`stop`). The short way of a lone call: no placement beyond the
    choice of its slot (the first node's idle first slot, else ``least_busy``'s), its
    arguments pickled and framed in one step (:func:`_task`). Per call, every step here
    counts (a lone call's CPU is most of its round trip on a busy machine): no helper
    that a line does as well."""
    fn = call.function
    laned = d.encoder.laned.get(id(fn))
    if laned is None or laned[2] is not fn:
        laned = _laned(d, fn)
        if laned is None:
            return None
    if fn.timeout:  # (the agent times calls)
        return None
    nodes = d.nodes
    if not nodes:
        return None
    node = nodes[0]
    busy = node.busy
    if node.state is NodeState.READY and busy and not busy[0]:
        slot = 0  # (the usual case: no look at the others)
    else:
        choice = d.placement.least_busy()
        if choice is None:
            return None
        node, slot = choice
        busy = node.busy
    lanes = node.lanes
    if lanes is None:  # (the first lone call on this node)
        lanes = node.lanes = _lanes_of(node)
    key = laned[0]
    if not lanes or busy[slot] or key not in node.answered or lanes.agent_dying():
        return None
    lane = lanes.by_slot.get(slot)
    if lane is None or lane.ended or _word(lane.board.mem, CLOSED)[0]:  # replaced: its next
        lanes.take()
        lane = lanes.by_slot.get(slot)
        if lane is None or lane.ended or _word(lane.board.mem, CLOSED)[0]:
            return None
    pickled = _task(key, call)
    if pickled is None:  # (not one small part: the general way, which says what fails)
        return None
    main = pickled.main
    payload = Payload(pickled)
    sub = d.encoder.submission(call, payload, key, laned[1], pinned=False)
    with node.lock:
        if node.state is not NodeState.READY or busy[slot] or node.abandoned:
            tid = 0
        else:
            tid = next_id()
            sub.node = node
            sub.tid = tid
            sub.worker = slot
            sub.attempts += 1
            sub.started = True  # at most once: as a call its agent said STARTED for
            sub.lane = lane  # (but one its executor never began: see Lane.started)
            sub.started_at = time.monotonic()
            node.inflight[tid] = sub
            busy[slot] += 1
    if not tid:
        d.by_future.pop(id(sub.future), None)
        payload.release()
        return None
    sub.wake_by = _waker()
    taken.append(sub)  # (an interrupt from here on: the caller undoes or cancels it)
    mem = lane.board.mem
    _set_word(mem, CLAIMED, tid)
    try:  # the frame's header, task head and payload head in one (see _TASK_PAYLOAD)
        frame = _TASK_PAYLOAD.pack(
            Kind.TASK, tid, _TASK_BODY + len(main), 0.0, slot, 0, len(main), 0
        )
        os.write(lane.task_fd, frame + main)  # (fits the pipe whole: see LARGEST)
    except OSError:  # the executor is gone: its agent says how (DIED)
        lane.ended = True
    lane.orphan = bool(_word(mem, CLOSED)[0])  # see _node/lanes.py
    node.proc.watch()  # the loop reads the stream (a lone call's read parks it)
    node.events.task_started(node, sub)
    return node, lane, sub


def _laned(d: Dispatcher, fn: Function[..., Any]) -> tuple[int, list[Buffer], Any] | None:
    """``fn``'s key and wire form if its calls may take a lane (defined already, no
    streamed argument, not a generator function), kept for its next calls
    (``Encoder.laned``); else None."""
    if streamed_parameters(fn.fn) or yields(fn.fn):  # (its values stream: stream.py)
        return None
    cached = d.encoder.cached(fn)
    if cached is None:  # its first call: DEFINE goes the general way
        return None
    laned = d.encoder.laned[id(fn)] = (cached[0], cached[1], fn)
    return laned


_word = WORD.unpack_from
"""A board word, as ``Board.get`` reads it, without its frame: ``_word(board.mem, WORD)[0]``
(per call)."""
_set_word = WORD.pack_into
"""``Board.set`` without its frame: ``_set_word(board.mem, WORD, value)``."""
_VALUE = struct.Struct(HEADER.format + "B" + PAYLOAD_HEAD.format.lstrip("<"))
"""A RESULT frame's header, status and payload head in one (``serialize.encode``)."""


_TASK_PAYLOAD = struct.Struct(
    HEADER.format + TASK_HEAD.format.lstrip("<") + PAYLOAD_HEAD.format.lstrip("<")
)
"""A lane task's frame header, task head and payload head (no buffer, no file) in one
(see ``_wire/frames.py``, ``serialize.encode``)."""
_TASK_BODY = TASK_HEAD.size + PAYLOAD_HEAD.size
"""A lane task's body before its pickle."""
_LANE_PICKLE = min(_PLAIN_BYTES, LARGEST - _TASK_PAYLOAD.size)
"""Bytes of a lane task's pickle at most: one part (``serialize.encode`` makes a larger
pickle a part of its own) in a frame that fits LARGEST."""


def _task(key: int, call: PendingCall[Any]) -> Pickled | None:
    """``call``'s arguments pickled, when they are one small part that fits a lane (see
    LARGEST); None for the general way (a large argument, maybe for shared memory; or one
    that cannot be pickled: the general way says what). Small builtin data is pickled as
    ``serialize.pickle_obj`` pickles it, the empty arguments of most calls not looked at
    (its scan of the whole tuple costs a lone call ~4 us of its caller's ~60, measured)."""
    args, kwargs = call.args, call.kwargs
    if (not args or _plain(args, 1)) and (not kwargs or _plain(kwargs, 1)):
        pickled = Pickled(pickle.dumps((key, args, kwargs), 5), ())
    else:
        try:
            pickled = pickle_obj((key, args, kwargs))
        except Exception:
            return None
        if pickled.buffers:
            return None
    return pickled if len(pickled.main) <= _LANE_PICKLE else None


def undo(d: Dispatcher, sub: Submission, lane: Lane) -> None:
    """Take back ``sub``, claimed on ``lane`` but not written there: nothing of it was
    sent."""
    node = sub.node
    if lane.board.get(CLAIMED) == sub.tid:
        lane.board.set(CLAIMED, 0)
    if node is not None:
        with node.lock:
            if node.inflight.pop(sub.tid, None) is not None:
                node.busy[sub.worker] -= 1
    sub.node = None
    sub.wake_by = None
    d.by_future.pop(id(sub.future), None)
    sub.payload.release()


def stop(d: Dispatcher, taken: list[Submission]) -> None:
    """The caller of a lane call was interrupted (Ctrl-C): the call, if it was written,
    is cancelled as a running call is (its process replaced); else taken back."""
    for sub in taken:
        if sub.lane is not None:
            d.cancel([sub.future])
        elif sub.node is not None and sub.node.lanes:
            lane = sub.node.lanes.by_slot.get(sub.worker)
            if lane is not None:
                undo(d, sub, lane)


def _lanes_of(node: Node) -> Lanes | bool:
    """The node's lanes (False: its agent has no lane socket). The agent's ``lanes``
    becomes them: they are closed with its pipes."""
    sock = getattr(node.proc, "lanes", None)
    if not isinstance(sock, socket.socket) or not hasattr(os, "eventfd"):  # (Linux's)
        return False
    try:
        stat = os.open(f"/proc/{int(node.hello_info['pid'])}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except (KeyError, TypeError, ValueError, OSError):  # (no agent to look at: no lanes)
        return False
    lanes = Lanes(sock, stat)
    node.proc.lanes = lanes  # type: ignore[attr-defined]
    return lanes


def wait(d: Dispatcher, node: Node, lane: Lane, sub: Submission) -> None:
    """Wait for ``sub`` (sent on ``lane``) to end, reading the lane's result pipe in this
    thread. The agent's stream stays the event loop's: a result the agent forwards (one
    that had output before it), its DIED or CANCELLED, a node lost, settle the call there,
    and the loop wakes this thread (``Submission.wake_by``, this thread's waker);
    a pool closed is seen within a tenth of a second.

    The result pipe is polled without sleeping for about twice the recent answers' time,
    at most SPIN, while a core is idle: as a lone call's wait on the agent's stream
    (``pipe.SPIN``)."""
    waker = sub.wake_by
    assert waker is not None
    fd = lane.result_fd
    poller = waker.polls.get(fd)  # (by number: a poll takes the numbers each time)
    if poller is None:
        poller = waker.polls[fd] = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(waker.fd, select.POLLIN)
    done = sub.future.done
    start = time.monotonic()
    answered = lane.answered
    spin = start + min(SPIN, 2 * answered) if answered <= SPIN and _idle(start) else 0.0
    try:
        while not done():
            if spin and time.monotonic() >= spin:
                spin = 0.0
            for ready, _ in poller.poll(0 if spin else 100):
                if ready != fd:
                    waker.clear()
                    continue
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                if data:
                    if lane.reader.idle and _finished(d, node, sub, data):
                        continue
                    frames = lane.reader.feed(data)
                    if frames:
                        node._on_frames(frames)
                    continue
                lane.ended = True  # the executor is gone: the agent says how (DIED)
                waker.polls.pop(fd, None)
                if lane.orphan and not done() and not _seen(lane, sub):  # (its agent says
                    _orphaned(d, node, sub, lane)  # it; a second answer is dropped)
                poller = waker.alone
    finally:
        sub.wake_by = None
        mem = lane.board.mem
        if done() and _word(mem, CLAIMED)[0] == sub.tid:  # (else its cancel finds it
            _set_word(mem, CLAIMED, 0)  # claimed) the slot is the agent's again
    took = time.monotonic() - start
    lane.answered = took if took > SPIN else (answered + took) / 2


IDLE_LOOK = 0.005
"""Seconds a look at the machine's idle cores (``pipe.idle_core``: a read of
``/proc/loadavg``, a few µs) is reused by the next lane calls' waits."""
_idle_seen = [0.0, 0.0]  # (until when, idle: 1.0 or 0.0), shared by the threads


def _idle(now: float) -> bool:
    if now >= _idle_seen[0]:
        _idle_seen[1] = 1.0 if idle_core() else 0.0
        _idle_seen[0] = now + IDLE_LOOK
    return bool(_idle_seen[1])


class _Waker:
    """A thread's wake-up for its lane calls (an ``eventfd``), and its polls."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.polls: dict[int, select.poll] = {}
        self.alone = select.poll()
        self.alone.register(self.fd, select.POLLIN)

    def wake(self) -> None:
        os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def __del__(self) -> None:
        os.close(self.fd)


_threads = threading.local()


def _waker() -> _Waker:
    try:
        waker: _Waker = _threads.waker
    except AttributeError:
        waker = _threads.waker = _Waker()
    return waker


def _finished(d: Dispatcher, node: Node, sub: Submission, data: bytes) -> bool:
    """The short way of a lane call's value (``data``: one whole RESULT frame, OK, its
    value inline): what ``Node._on_frames`` and ``Dispatcher.on_result`` do for it, no
    more; False (nothing done) for anything else."""
    if len(data) < _VALUE.size:
        return False
    kind, ident, size, status, buffers, length, name = _VALUE.unpack_from(data)
    if kind != Kind.RESULT or ident != sub.tid or len(data) != HEADER_SIZE + size:
        return False
    if status != Status.OK or buffers or name:  # (a buffer is too large for a lane)
        return False
    try:  # the pickle alone (serialize.decode's first case)
        value = pickle.loads(memoryview(data)[_VALUE.size : _VALUE.size + length])
    except BaseException:  # (e.g. a type unknown here: the general way says so)
        return False
    with node.lock:
        if node.inflight.pop(ident, None) is None:  # settled otherwise meanwhile
            return True
        node.busy[sub.worker] -= 1
        idle = not node.inflight
    node.last_heard = time.monotonic()
    if idle and node._out:  # (a line the calls left unfinished)
        node.flush_output()
    node.events.task_finished(node, sub, Status.OK, data[HEADER_SIZE:])
    sub.finished = True
    d.by_future.pop(id(sub.future), None)
    try:
        sub.future.set_result(value)
    except InvalidStateError:
        pass
    if d.backlog:
        d.pump()
    return True


def _seen(lane: Lane, sub: Submission) -> bool:
    """Whether the agent saw ``sub``'s claim when its executor was gone (it then answers
    for it): it says so on the board (``SEEN``) right after it looked."""
    deadline = time.monotonic() + GONE
    while not lane.board.get(SEEN) and not sub.future.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    return lane.board.get(SEEN) == sub.tid or sub.future.done()


def _orphaned(d: Dispatcher, node: Node, sub: Submission, lane: Lane) -> None:
    """``sub``'s lane ended without its answer, its agent having closed the lane before
    it saw the claim: sent again (free) if the executor never began it, else DIED."""
    if lane.board.get(RUNNING) in (sub.tid, -sub.tid):
        death = {"exitcode": None, "reason": "was replaced", "local_rank": sub.worker}
        body = bytes((Status.DIED,)) + json.dumps(death).encode()
        node._on_frames([(Kind.RESULT, sub.tid, body)])
        return
    with node.lock:
        if node.inflight.pop(sub.tid, None) is None:
            return
        node.busy[sub.worker] -= 1
    sub.lane = None
    err = node.lost_error("replaced the process a call was sent to before it began")
    if not d.retry(sub, err, free=True):
        d.settle(sub, exc=err)
