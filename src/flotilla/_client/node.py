"""The client's side of one node: its agent connection, in-flight calls and output."""

from __future__ import annotations

import asyncio
import itertools
import json
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import NodeLostError, ProvisionError
from .._providers.base import AgentProcess
from .._wire.bodies import Config, Hello, Ready, dump, load_hello, load_ready
from .._wire.exits import exit_signal, exit_summary
from .._wire.frames import HEADER, TASK_HEAD, UNMAPPED, Buffer, Kind, Status, frame
from .._wire.serialize import Pickled, encode
from .console import prefix
from .feeds import on_credit
from .lines import LineAssembler
from .shm import File, Files
from .stream import on_yield

if TYPE_CHECKING:
    from .function import PendingCall

_task_ids = itertools.count(1)
_ids_lock = threading.Lock()


def next_id() -> int:
    """A new call id."""
    return next(_task_ids)


def _skip_ids(last: int) -> None:
    """Call ids from now on are above ``last`` (calls a re-attached agent still runs)."""
    global _task_ids
    with _ids_lock:
        following = next(_task_ids)
        _task_ids = itertools.count(max(following, last + 1))


_STDERR_TAIL = 40
TIMEOUT_GRACE = 1.0
"""Seconds past a call's timeout after which the client ends the call itself, when its node
did not report the timeout (a frozen agent or VM, a network black hole)."""

_TASK_HEAD_SIZE = TASK_HEAD.size


DIRECT_BUDGET = 0.01
"""Seconds a caller waiting for one call reads its node's stream itself (wait_direct)."""
_DIRECT_KINDS = frozenset({Kind.RESULT, Kind.STARTED, Kind.BEAT})
"""The frames a caller's thread may take itself: all else is the event loop's."""


class NodeState(Enum):
    """Lifecycle of a node as the client sees it::

    STARTING --HELLO--> CONFIGURING --READY--> READY
    STARTING | CONFIGURING | READY --agent gone--> LOST
    CONFIGURING | READY --nothing heard for heartbeat_timeout--> LOST
    any --pool closes--> CLOSED
    """

    STARTING = "starting"
    CONFIGURING = "configuring"
    READY = "ready"
    LOST = "lost"
    CLOSED = "closed"


class Fanout(Protocol):
    """A broadcast's payload relayed from node to node (``fanout.Fanout``)."""

    ref: bytes

    def announce(self, node: Node) -> list[Buffer] | None: ...
    def send_direct(self, node: Node, why: str) -> None: ...
    def release(self) -> None: ...


class Payload:
    """Encoded arguments of a call, shared by every node it is sent to.

    Pickled once; the wire form is built at most twice (with and without shared memory).
    When the last call using it finishes, its shared-memory file goes back to the pool's
    :class:`shm.Files` for a later call if every call sent it said its process unmapped
    it (``frames.UNMAPPED``); else it is removed.
    """

    __slots__ = (
        "_inline",
        "_lock",
        "_shm",
        "fanout",
        "files",
        "mapped",
        "pickled",
        "shm",
        "unmapped",
        "users",
    )

    def __init__(
        self, pickled: Pickled, shm: File | None = None, files: Files | None = None
    ) -> None:
        self.pickled = pickled
        self.shm = shm
        self.files = files
        self.users = 0
        self.mapped = 0  # calls sent the shared-memory form (each maps the file)
        self.unmapped = 0  # of those, the ones whose process said it unmapped it since
        self._lock = threading.Lock()
        self._inline: list[Buffer] | None = None
        self._shm: list[Buffer] | None = None
        self.fanout: Fanout | None = None  # a broadcast's, relayed from node to node

    def parts(self, shm: bool) -> list[Buffer]:
        if shm and self.shm is not None:
            if self._shm is None:
                self._shm = encode(self.pickled, self.shm.name)
            return self._shm
        if self._inline is None:
            self._inline = encode(self.pickled)
        return self._inline

    def task_parts(self, shm: bool) -> tuple[list[Buffer], bool]:
        """The wire form for a node (``shm``: one that sees this machine's ``/dev/shm``)
        and whether it is the shared-memory form (counted: the node maps the file)."""
        if not shm or self.shm is None:  # (no lock: most calls)
            return self.parts(False), False
        with self._lock:
            self.mapped += 1
        return self.parts(True), True

    def size(self) -> int:
        """Bytes of the wire form without shared memory."""
        return sum(memoryview(p).nbytes for p in self.parts(False))

    def acquire(self) -> None:
        with self._lock:
            self.users += 1

    def unmapping(self) -> None:
        """A call sent the shared-memory form ended, its process no longer maps the file."""
        with self._lock:
            self.unmapped += 1

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            last = self.users == 0
            shm = self.shm if last else None
            if last:
                self.shm = None
            reusable = self.mapped == self.unmapped
        if shm is not None and self.files is not None:
            self.files.give(shm, reusable)  # kept for a later call, or removed
        if last and self.fanout is not None:
            self.fanout.release()


@dataclass(eq=False, slots=True)
class Submission:
    """One call on its way to (or running on) one node."""

    call: PendingCall[Any]
    future: Future[Any]
    fn_key: int
    define: list[Buffer]
    payload: Payload
    retries_left: int
    timeout: float
    pinned: bool  # must run on this node (a broadcast)
    node: Node | None = None
    tid: int = 0  # the task id on its current node
    worker: int = 0  # the local rank it runs on
    any_slot: bool = False  # pinned to its node but not to a slot: the least busy one
    attempts: int = 0
    siblings: list[Submission] | None = None  # the calls of the same broadcast
    generation: int = 0  # of the pool's process group when the broadcast was sent
    finished: bool = False  # its node reported its end (its future may still be held)
    started: bool = False  # its node said it may have started (STARTED) on its current node
    mapped: bool = False  # sent to its current node in the shared-memory form
    held: tuple[Any, BaseException] | None = None  # a group failure kept until siblings end
    stream: Any = None  # a yielding call's iterator (stream.py), when `>>` returned one
    collected: list[bytes | bytearray] | None = None  # else its values (once it yields)
    pumps: list[Any] | None = None  # its streamed arguments (feeds.py)
    placed: threading.Event | None = None  # set once sent (for streamed arguments)
    started_at: float = 0.0  # when its node said it started (STARTED), monotonic
    direct: int = 0  # the thread that waits for it reading its node itself (`>>`), if any
    holder: AgentProcess | None = None  # the agent whose stream that thread holds for it
    wake_by: Any = None  # a lane call's waiting thread, woken when the loop settles it
    lane: Any = None  # the lane it was sent on (lanes.py), if it was


class NodeEvents:
    """What a node reports during start-up; the pool overrides these."""

    def phase(self, node: Node, phase: str) -> None:
        """The node entered a start-up phase."""

    def building(self, node: Node, info: dict[str, Any]) -> None:
        """The node builds its environment (and may need the includes archive)."""

    def broken(self, node: Node, generation: int, reason: str) -> None:
        """A process of a group pool was replaced (see ``plugins._base``)."""

    def build_output(self, node: Node, data: bytes) -> None:
        """Output of the node's environment build."""

    def redact(self, text: str) -> str:
        """``text`` with secrets removed."""
        return text

    def store(self, node: Node, ident: int, body: bytes | bytearray) -> None:
        """A task's request to the distributed collections (a STORE frame)."""
        answer = (False, "ConfigurationError", "this node's pool has no collections")
        node.send_control(Kind.STORED, wait=False, ident=ident, body=pickle.dumps(answer))

    def lost(self, node: Node) -> None:
        """The node is lost (its calls were failed or are sent elsewhere)."""

    def output(self, node: Node, stream: int, lines: list[str], local_rank: int = 0) -> None:
        """Complete lines a node's tasks printed (stream 1: stdout, 2: stderr)."""
        head = prefix(node.rank, node.global_rank(local_rank))
        _write(stream, "".join(f"{head}{line}\n" for line in lines))

    def state(self, node: Node, stream: int, text: str, local_rank: int = 0) -> None:
        """A task redrew its unfinished line with ``\\r`` (a progress bar): ``text`` is
        what the line shows now."""

    def task_started(self, node: Node, sub: Submission) -> None:
        """The node gave ``sub`` to a process (STARTED)."""

    def task_finished(
        self, node: Node, sub: Submission, status: int, body: bytes | bytearray
    ) -> None:
        """``sub`` ended on the node (its RESULT, before the call is settled)."""

    def metrics(self, node: Node, body: dict[str, Any]) -> None:
        """The node's metric samples (a METRICS frame, ``_node/metrics.py``)."""


class Node:
    """Connection to one agent. Writes happen on any thread; reads on the loop thread."""

    def __init__(
        self,
        rank: int,
        proc: AgentProcess,
        on_result: Callable[[Node, Submission, int, bytes | bytearray], None],
        on_lost: Callable[[Node, list[Submission]], None],
        events: NodeEvents | None = None,
    ) -> None:
        self.rank = rank
        self.proc = proc
        self.state = NodeState.STARTING
        self.lock = threading.Lock()  # guards inflight, busy, defined: held briefly
        self.write_lock = threading.Lock()  # keeps frames whole and in order on the channel
        self.first: list[bytes] = []  # frames due before any later write (see send_first)
        self.inflight: dict[int, Submission] = {}
        self.sending: list[Submission] = []  # the calls being written to the agent now
        self.busy = [0]  # calls in flight per local rank
        self.adopted: dict[int, int] = {}  # a re-attached agent's calls of the client before
        self.defined: set[int] = set()
        self.shm = False
        self.hello_info: Hello = {}
        self.ready_info: Ready = {}
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL)
        self._err_partial = b""
        self._out: dict[int, LineAssembler] = {}  # by OUTPUT ident (stream, local rank)
        self._on_result = on_result
        self._on_lost = on_lost
        self.events = events or NodeEvents()
        self.hello: asyncio.Future[Hello] | None = None
        self.ready: asyncio.Future[Ready] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.last_heard = time.monotonic()  # when the agent last sent anything
        self.loss = "its agent exited"  # why the node was lost, once it is
        self.start_failed = ""  # lost so: why a replacement executor failed to start
        self.silence = 0.0  # seconds nothing was heard from it, when that is why
        self.write_limit = 60.0  # seconds a write may make no progress (heartbeat_timeout)
        self.abandoned = False  # lost or closed: writes waiting for it end
        self.ended = False  # its agent's stream ended (the agent is gone, or its channel)
        self.blobs: dict[bytes, Fanout] = {}  # the relayed payloads it was told of, by ref
        self.have: dict[str, dict[str, Any]] = {}  # its last word (HAVE) on each, by ref
        self.relay_failures: list[str] = []  # why payloads did not come through the tree
        self.lanes: Any = None  # a Local node's lanes to its executors (lanes.py), once
        # a lone call looked (False: it has none)
        self.answered: set[int] = set()  # functions a call of which the agent answered

    def global_rank(self, local_rank: int) -> int:
        """The global rank of this node's process ``local_rank``."""
        return self.rank * len(self.busy) + local_rank

    @property
    def name(self) -> str:
        host = self.proc.host
        return f"node {self.rank}" + (f" ({host})" if host and host != "localhost" else "")

    # -- start-up --------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.hello = loop.create_future()
        self.ready = loop.create_future()
        self.last_heard = time.monotonic()
        self.proc.start_reading(loop, self._on_frames, self._on_stderr)

    def configure(self, config: Config, blob: bytes) -> None:
        self.busy = [0] * int(config.get("procs", 1))
        for local_rank in self.adopted.values():  # their slots are taken until they end
            if local_rank < len(self.busy):
                self.busy[local_rank] += 1
        data = dump(config)
        self.state = NodeState.CONFIGURING
        with self.write_lock:
            self.proc.write(
                frame(Kind.CONFIG, 0, len(data).to_bytes(4, "little"), data, blob), self.give_up
            )

    def give_up(self, stalled: float) -> bool:
        """Whether a write waiting ``stalled`` seconds for the agent to read ends: when the
        node is lost or its pool closes, or after ``write_limit`` seconds without progress
        (a live agent always reads: it is frozen, or its connection is)."""
        if stalled > self.write_limit and not self.abandoned and self.loop is not None:
            self.loop.call_soon_threadsafe(
                self.gone, f"stopped reading: a write to it made no progress for {stalled:.1f} s"
            )
        return self.abandoned or stalled > self.write_limit

    # -- sending ---------------------------------------------------------------------
    def send(self, subs: list[Submission]) -> None:
        """Send calls to this node (any thread). Raises NodeLostError if it is gone."""
        parts: list[Buffer] = []
        hold = len(subs) == 1 and subs[0].direct == threading.get_ident()  # see wait_direct
        with self.write_lock:  # the loop thread only ever takes self.lock: no deadlock
            with self.lock:
                if self.state is not NodeState.READY:
                    raise self.lost_error("cannot take calls")
                parts += self.first  # (a RESTART asked for before these calls: send_first)
                self.first = []
                for sub in subs:
                    tid = next(_task_ids)
                    sub.node = self
                    sub.tid = tid
                    if sub.placed is not None:  # its streamed arguments' values follow
                        sub.placed.set()  # (once this write is done: write_lock)
                    sub.attempts += 1
                    sub.started = False
                    self.inflight[tid] = sub
                    if sub.fn_key not in self.defined:
                        self.defined.add(sub.fn_key)
                        parts += frame(Kind.DEFINE, sub.fn_key, *sub.define)
                        hold = False  # (a write that may take a while: the loop reads)
                    if sub.any_slot:
                        sub.worker = min(range(len(self.busy)), key=self.busy.__getitem__)
                    self.busy[sub.worker] += 1
                    head = TASK_HEAD.pack(sub.timeout, sub.worker)
                    fan = sub.payload.fanout
                    told = fan.announce(self) if fan is not None else None
                    sub.mapped = False
                    if told is None:
                        body, sub.mapped = sub.payload.task_parts(self.shm)
                        if len(body) == 1:  # small arguments: one part (a batch's calls)
                            size = _TASK_HEAD_SIZE + len(body[0])
                            parts += (HEADER.pack(Kind.TASK, tid, size), head, body[0])
                        else:
                            parts += frame(Kind.TASK, tid, head, *body)
                            hold = False
                    else:  # its arguments come through the tree (fanout.py)
                        assert fan is not None
                        parts += told
                        parts += frame(Kind.TASKREF, tid, head, fan.ref)
                        hold = False
                    if sub.timeout and self.loop is not None:
                        self.loop.call_soon_threadsafe(self._arm_timeout, sub, tid)
                self.sending = subs  # a loss meanwhile leaves them to this thread
            if hold and self.proc.hold_direct():  # (the caller reads, or releases it)
                subs[0].holder = self.proc
            else:  # the answer is the loop's: its reading back, if a lone call left it off
                self.proc.watch()
            failure = ""
            try:
                self.proc.write(parts, self.give_up)
            except OSError as e:
                failure = f"cannot take calls ({e})"
            with self.lock:
                self.sending = []
                if not failure and not self.abandoned:  # abandoned: lost, or closed
                    return
                for sub in subs:  # not sent whole, or to a node lost meanwhile: the caller
                    if self.inflight.pop(sub.tid, None) is not None:  # sends them again
                        sub.node = None
                        self.busy[sub.worker] -= 1
            self.proc.release_direct()
            raise self.lost_error(failure or "was lost while calls were sent to it")

    def _take_write_lock(self, wait: bool) -> bool:
        """Take ``write_lock``: waiting for it (False once the node is abandoned), or only
        if it is free."""
        if not wait:
            return self.write_lock.acquire(blocking=False)
        while not self.write_lock.acquire(timeout=0.1):
            if self.abandoned:
                return False
        return True

    def send_control(self, kind: int, wait: bool = True, ident: int = 0, body: bytes = b"") -> bool:
        """Send a control frame; False if the node is gone or given up, or (without wait)
        if that would wait at all (the event loop's sends: they never block)."""
        if not self._take_write_lock(wait):
            return False
        try:
            parts = frame(kind, ident, body)
            if not wait:
                return self.proc.try_write(b"".join(parts))
            self.proc.write(parts, self.give_up)
            return True
        except OSError:
            return False
        finally:
            self.write_lock.release()

    def send_first(self, kind: int, ident: int = 0, body: bytes = b"") -> None:
        """Send a control frame that must reach the agent before anything sent after this
        call (a RESTART: a call of the new group written before it would be aborted by it,
        and its siblings would wait for it in a collective for good). From the loop: written
        now if the channel is free, else it goes first in the next write (:meth:`send`'s),
        or a helper thread writes it."""
        with self.lock:
            self.first.append(b"".join(frame(kind, ident, body)))
        if not self._write_first(wait=False):
            asyncio.get_running_loop().run_in_executor(None, self._write_first)

    def _write_first(self, wait: bool = True) -> bool:
        """Write the frames :meth:`send_first` queued, if no write took them meanwhile;
        False (without ``wait``) when that would wait: they stay first."""
        if not self._take_write_lock(wait):
            return False  # (waiting: the node is lost)
        try:
            with self.lock:
                due, self.first = self.first, []
            if not due:
                return True
            if wait:
                self.proc.write(due, self.give_up)
            elif not self.proc.try_write(b"".join(due)):
                with self.lock:
                    self.first[:0] = due
                return False
            return True
        except OSError:
            return True  # the node is lost
        finally:
            self.write_lock.release()

    def wait_direct(self, future: Future[Any]) -> None:
        """Wait a little for ``future`` (a call sent to this node) by reading the agent's
        stream in this thread, which saves the hop through the event loop's thread for a
        quick call; the loop takes over after :data:`DIRECT_BUDGET` or at any frame other
        than a result, STARTED or BEAT (see ``AgentProcess.read_direct``). A call sent
        with ``Submission.direct`` (this thread's) had the loop's reading of the stream
        held before it was written (``AgentProcess.hold_direct``): the loop never takes
        its answer (nor wakes this thread for it), even when it came before this read."""
        self.proc.read_direct(
            self._on_frames, future.done, DIRECT_BUDGET, _DIRECT_KINDS, self._quiet
        )

    def _quiet(self) -> bool:
        """Whether no call of this node is under way (the loop need not read its stream
        until one is sent, or the next heartbeat tick: see ``AgentProcess.watch``)."""
        return not self.inflight

    # -- the client's own watch (loop thread) ----------------------------------------
    def _arm_timeout(self, sub: Submission, tid: int) -> None:
        assert self.loop is not None
        self.loop.call_later(sub.timeout + TIMEOUT_GRACE, self._overdue, sub, tid)

    def _overdue(self, sub: Submission, tid: int) -> None:
        """``sub`` outlived its timeout and the node did not say so (its agent may be
        frozen): the call ends as a timeout here; the node is asked to stop it."""
        with self.lock:
            if self.inflight.get(tid) is not sub:
                return
            del self.inflight[tid]
            self.busy[sub.worker] -= 1
        self.send_control(Kind.CANCEL, wait=False, ident=tid)
        self._on_result(self, sub, Status.TIMEOUT, bytes((Status.TIMEOUT,)))

    def check_silence(self, now: float, limit: float) -> None:
        """Declare the node lost if nothing came from its agent for ``limit`` seconds
        (the agent sends BEAT every quarter of that)."""
        silent = now - self.last_heard
        if silent > limit and self.state in (NodeState.READY, NodeState.CONFIGURING):
            self.silence = silent
            self.gone(f"stopped answering: nothing heard from its agent for {silent:.1f} s")

    # -- receiving (loop thread) -----------------------------------------------------
    def _on_frames(self, frames: list[tuple[int, int, bytes | bytearray]] | None) -> None:
        if frames is None:
            self.ended = True
            self.gone()
            return
        self.last_heard = time.monotonic()  # also for part of a frame (an empty list)
        for kind, ident, body in frames:
            if kind == Kind.RESULT:
                with self.lock:
                    sub = self.inflight.pop(ident, None)
                    if sub is not None:
                        self.busy[sub.worker] -= 1
                    elif ident in self.adopted:  # a call of the client before: it ended
                        local_rank = self.adopted.pop(ident)
                        if local_rank < len(self.busy):
                            self.busy[local_rank] -= 1
                if sub is not None:
                    status = body[0]
                    if status & UNMAPPED:  # (see frames.UNMAPPED)
                        status ^= UNMAPPED
                        if sub.mapped:
                            sub.payload.unmapping()
                    sub.mapped = False
                    if not self.inflight:
                        self.flush_output()
                    self.events.task_finished(self, sub, status, body)
                    self.answered.add(sub.fn_key)  # (its executors have it: lanes.py)
                    self._on_result(self, sub, status, body)
            elif kind == Kind.STARTED:
                sub = self.inflight.get(ident)
                if sub is not None:
                    sub.started = True
                    sub.started_at = time.monotonic()
                    self.events.task_started(self, sub)
            elif kind == Kind.OUTPUT:
                self._output(ident, bytes(body))
            elif kind == Kind.YIELD:
                sub = self.inflight.get(ident)
                if sub is not None:
                    on_yield(self, sub, ident, body)
            elif kind == Kind.CREDIT:
                sub = self.inflight.get(ident)
                if sub is not None:
                    on_credit(sub, body)
            elif kind == Kind.STORE:
                self.events.store(self, ident, body)
            elif kind == Kind.HAVE:
                self._on_have(json.loads(body))
            elif kind == Kind.HELLO:
                self.hello_info = load_hello(body)
                adopted = self.hello_info.get("adopted")
                if adopted:  # a re-attached agent: its calls keep their slots and ids
                    self.adopted = {int(k): int(v) for k, v in adopted.items()}
                    _skip_ids(max(self.adopted))
                self.events.phase(self, "starting")
                if self.hello and not self.hello.done():
                    self.hello.set_result(self.hello_info)
            elif kind == Kind.READY:
                self._on_ready(load_ready(body))
            elif kind == Kind.BROKEN:
                self.events.broken(self, ident, bytes(body).decode(errors="replace"))
            elif kind == Kind.PROGRESS:
                self.events.build_output(self, bytes(body))
            elif kind == Kind.BUILD:
                self.events.building(self, json.loads(body))
            elif kind == Kind.METRICS:
                self.events.metrics(self, json.loads(body))

    def _on_have(self, info: dict[str, Any]) -> None:
        """The agent holds a relayed payload, checked, or failed to get it: then the
        client sends it itself (see ``fanout.py``)."""
        self.have[info["ref"]] = info
        if info.get("ok"):
            return
        why = str(info.get("why", ""))
        self.relay_failures.append(why)
        fan = self.blobs.get(bytes.fromhex(info["ref"]))
        if fan is not None and self.loop is not None:
            self.loop.run_in_executor(None, fan.send_direct, self, why)

    def _on_ready(self, info: Ready) -> None:
        if "error" in info:
            detail = info["error"].rstrip()
            tail = info.get("stderr_tail", "").rstrip()
            if "build_step" in info:
                msg = f"{self.name}: {detail}"
                if tail:
                    msg += f"\n--- last lines of the build output ---\n{tail}"
            else:
                msg = f"{self.name}: the executor failed to start:\n{detail}"
                if tail:
                    msg += f"\n--- last lines of its stderr ---\n{tail}"
            msg = self.events.redact(msg)
            if self.ready and not self.ready.done():
                self.ready.set_exception(ProvisionError(msg))
            else:  # a replacement executor failed: the node cannot run anything more
                self.state = NodeState.LOST
                self.loss = msg.removeprefix(f"{self.name}: ")  # (its calls' errors say it)
                said = [line.strip() for line in detail.splitlines() if line.strip()]
                self.start_failed = said[-1] if said else "?"  # (a traceback's last line)
                self._fail_all(msg)
            return
        self.ready_info = info
        self.shm = bool(info.get("shm"))
        if self.state is not NodeState.CLOSED:
            self.state = NodeState.READY
        if self.ready and not self.ready.done():
            self.ready.set_result(info)

    def _on_stderr(self, data: bytes) -> None:
        lines = (self._err_partial + data).split(b"\n")
        self._err_partial = lines.pop()[-4096:]
        self.stderr_tail.extend(line.decode(errors="replace") for line in lines)

    def gone(self, loss: str = "") -> None:
        """The agent is gone (``loss``: why, when it is not that it exited): fail the
        node's calls and report the loss. Idempotent."""
        if self.state is NodeState.CLOSED or self.state is NodeState.LOST:
            return
        self.flush_output()
        self.state = NodeState.LOST
        self.abandoned = True  # a write waiting for it ends
        if loss:
            self.loss = loss
        err = self.lost_error(f"lost: {self.loss}")
        for fut in (self.hello, self.ready):
            if fut is not None and not fut.done():
                fut.set_exception(ProvisionError(str(err)))
        self._fail_all(str(err))
        self.events.lost(self)

    def _fail_all(self, message: str) -> None:
        with self.lock:  # the calls a thread is still writing are left to it (see send)
            subs = [s for s in self.inflight.values() if s not in self.sending]
            for sub in subs:
                del self.inflight[sub.tid]
            self.busy = [0] * len(self.busy)
            for sub in self.inflight.values():
                self.busy[sub.worker] += 1
        self._on_lost(self, subs)  # also without calls: the pool replaces the node

    def lost_error(self, what: str) -> NodeLostError:
        status = self.proc.exit_status()
        how = f" ({exit_summary(status)})" if status is not None else ""
        tail = "\n".join(self.stderr_tail).rstrip()
        msg = f"{self.name} {what}{how}"
        if tail:
            msg += f"\n--- last lines of the agent's stderr ---\n{tail}"
        return NodeLostError(
            msg, node=self.rank, exitcode=status, signal=exit_signal(status), stderr_tail=tail
        )

    # -- output ----------------------------------------------------------------------
    def _output(self, ident: int, data: bytes) -> None:
        assembler = self._out.get(ident)
        if assembler is None:
            assembler = self._out[ident] = LineAssembler()
        lines, state = assembler.feed(data)
        if lines:
            self.events.output(self, ident & 0xFF, lines, ident >> 8)
        if state is not None:
            self.events.state(self, ident & 0xFF, state, ident >> 8)

    def flush_output(self) -> None:
        """The unfinished lines as finished ones (the calls ended): nothing is lost."""
        for ident, assembler in self._out.items():
            rest = assembler.flush()
            if rest is not None:
                self.events.output(self, ident & 0xFF, [rest], ident >> 8)


_print_lock = threading.Lock()


def _write(stream: int, text: str) -> None:
    target = sys.stdout if stream == 1 else sys.stderr
    with _print_lock:
        try:
            target.write(text)
            target.flush()
        except (OSError, ValueError):
            pass
