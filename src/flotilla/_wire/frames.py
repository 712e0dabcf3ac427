"""The wire protocol between client, agent and executor.

A stream of frames, each a fixed header followed by a body::

    kind: u8 | ident: u64 | length: u64 | body: `length` bytes

The same framing is used on the client <-> agent channel (the agent's stdin/stdout, a pipe
locally or an SSH channel remotely) and on the agent <-> executor pipes. User code never
writes to these descriptors: the agent moves its own stdout away before it speaks, and the
executor's stdout/stderr are separate pipes that the agent forwards as OUTPUT frames.

This module is imported by the agent at start-up: it must stay standard-library only.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence

Buffer = bytes | bytearray | memoryview
Body = bytes | bytearray
"""A received frame's body."""

HEADER = struct.Struct("<BQQ")
HEADER_SIZE = HEADER.size
# Bodies at least this large are read straight into their own buffer (no re-copying).
_BIG = 1 << 20
_CHUNK = 1 << 16  # larger reads cost more than they save: os.read allocates the whole size


class Kind:
    """Frame kinds. ``ident`` is a task id, a function key or a stream number.

    (Plain int constants, as :class:`Status`'s: an ``IntEnum`` would import ``enum``, ~2 ms
    of the agent's CPU at every node's start, and build its class; a frame's kind is an
    int as the reader gives it, one no handler takes is ignored.)"""

    # agent -> client
    HELLO = 1  # JSON: the agent is up (pid, host, boot id, python, free port)
    READY = 2  # JSON: the executor is initialised (or failed to, with "error")
    RESULT = 3  # ident=task id; body = status byte + payload
    OUTPUT = 4  # ident=stream (1 stdout, 2 stderr) | local rank << 8; body = raw bytes
    BUILD = 5  # JSON: the node builds its environment ({"need_includes": bool})
    PROGRESS = 6  # text: output of the environment build
    BROKEN = 7  # ident=restart generation; text: why a process of a group pool was replaced
    BEAT = 8  # the agent is alive: sent every quarter of the heartbeat timeout once configured
    STARTED = 9  # ident=task id: the task is given to its process (it may start from now on)
    # client -> agent
    CONFIG = 10  # JSON: environment, COMPUTE_POOL, options; then an executor blob
    DEFINE = 11  # ident=function key; body = pickled function
    TASK = 12  # ident=task id; body = TASK_HEAD (timeout, local rank) + payload
    PING = 13  # keep-alive; the agent exits when none arrives for a while
    SHUTDOWN = 14  # stop the executor gracefully and exit
    INCLUDES = 15  # the Image's includes archive, sent when the agent asks for it
    CANCEL = 16  # ident=task id: stop it (running: the executor is replaced; queued: skipped)
    RESTART = 17  # ident=new generation; text: the cause. Replace every executor, abort tasks
    PYTHON = 18  # JSON: become a Python of the client's minor version; a new HELLO answers
    # executor -> agent -> client, and back: the distributed collections (_collections.py)
    STORE = 19  # ident=request id; body = pickled request (relayed, the agent renumbers it)
    STORED = 20  # ident=the STORE's id; body = pickled (ok, value or error)
    # a task that yields (a generator): its values, and the client's leave to send more
    YIELD = 21  # executor -> agent -> client; ident=task id; body = one encoded value
    CREDIT = 22  # client -> agent -> executor; ident=task id; body = u32: values more
    # (executor -> agent -> client for a streamed argument: body = its index u8 + u32)
    FEED = 23  # client -> agent -> executor; ident=task id; a streamed argument's value
    MEMBERS = 24  # JSON: the node's new COMPUTE_POOL (an elastic pool grew or shrank)
    # a large broadcast's payload relayed from node to node (_node/relay.py, _client/fanout.py)
    # (a payload's reference, "ref": its sha256, 32 bytes, then its broadcast's number, u64)
    FETCH = 25  # client -> agent; JSON: a payload's ref and size, and where to get it
    BLOB = 26  # client -> agent; body = ref + offset u64 + bytes of the payload from there
    TASKREF = 27  # client -> agent; ident=task id; body = TASK_HEAD + the payload's ref
    # (agent -> executor: TASK_HEAD + the name of the shared-memory file that holds it)
    HAVE = 28  # agent -> client; JSON: the node has the payload (checked), or failed to get it
    DROP = 29  # client -> agent; body = a payload's ref: it is no longer needed
    # a yielding task's caller closed its iterator: GeneratorExit is thrown into the
    # generator where it waits (at a yield), its finally runs, the process stays
    CLOSE = 30  # client -> agent -> executor; ident=task id
    METRICS = 31  # agent -> client; JSON: the node's metric samples (_node/metrics.py)


class Status:
    """First byte of a RESULT body (a value the client does not know: a protocol error)."""

    OK = 0  # payload: pickled return value
    ERROR = 1  # payload: pickled (exception bytes | None, type name, message, traceback)
    DIED = 2  # payload: JSON describing how the executor died
    TIMEOUT = 3  # payload: JSON with the timeout
    CANCELLED = 4  # no payload: the call was cancelled
    ABORTED = 5  # payload: text, the cause: the pool's process group was restarted


UNMAPPED = 0x80
"""A flag on a RESULT's status byte (``Status | UNMAPPED``): the executor mapped the call's
shared-memory file (its arguments) and, the call done, unmapped it; nothing (no array
the task kept, no process it forked) shows that memory any more, so the client may
write the file again for a later call (``_client/shm.py``), or the node's relay, for a
relayed payload's file (``_node/relay.py``). Only the executor sets it; the agent
forwards the byte as it is; the client reads ``byte & ~UNMAPPED`` as the status."""


STREAM_WINDOW = 8
"""Values a yielding task sends before it waits for CREDIT (the client's leave to go on,
given as its caller takes them): a slow consumer pauses the producer."""

CREDIT_BODY = struct.Struct("<I")

TASK_HEAD = struct.Struct("<dH")
"""Start of a TASK body: the timeout in seconds (0: none) and the local rank to run it on."""


def frame(kind: int, ident: int, *parts: Buffer) -> list[Buffer]:
    """Header and body parts of one frame, ready for :func:`write_all`."""
    length = 0
    for p in parts:
        length += p.nbytes if isinstance(p, memoryview) else len(p)
    return [HEADER.pack(kind, ident, length), *parts]


def write_all(fd: int, parts: Sequence[Buffer]) -> None:
    """Write every byte of ``parts`` to a blocking descriptor."""
    size = 0
    for p in parts:
        size += p.nbytes if isinstance(p, memoryview) else len(p)
    if size <= 65536:  # small: one copy, one system call
        data = b"".join(parts)
        n = os.write(fd, data)
        if n == size:
            return
        parts = [memoryview(data)[n:]]
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        advance(views, os.writev(fd, views[:512]))


def write_frame(fd: int, kind: int, ident: int, *parts: Buffer) -> None:
    """Write one frame whole to a blocking descriptor: :func:`frame` and
    :func:`write_all` in one step (a task's result: its size counted once)."""
    size = 0
    for p in parts:
        size += p.nbytes if isinstance(p, memoryview) else len(p)
    if size <= 65536:  # small: one copy, one system call
        data = b"".join((HEADER.pack(kind, ident, size), *parts))
        n = os.write(fd, data)
        if n < len(data):
            write_all(fd, [memoryview(data)[n:]])
        return
    write_all(fd, [HEADER.pack(kind, ident, size), *parts])


def advance(views: list[memoryview], written: int) -> None:
    """Drop the first ``written`` bytes of ``views`` (what ``os.writev`` wrote of them)."""
    while written:
        first = views[0]
        if written >= first.nbytes:
            written -= first.nbytes
            views.pop(0)
        else:
            views[0] = first[written:]
            written = 0


def _memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 1 << 40


MAX_BODY = _memory()
"""The largest frame body accepted: this machine's memory (a larger length can only be a
corrupt stream, e.g. a task that wrote on a channel that is not its own)."""


class FrameError(ValueError):
    """The stream is corrupt (a frame longer than this machine's memory)."""


class FrameReader:
    """Incremental frame parser over a byte stream.

    ``read(fd)`` performs one read and returns the frames it completed. Large bodies are
    read directly into a buffer of their final size, so a 100 MB payload is copied once.
    A header announcing more than :data:`MAX_BODY` bytes raises :class:`FrameError`
    (instead of a MemoryError that would take the reader's process down).
    """

    __slots__ = ("_big", "_big_filled", "_big_header", "_buf", "more")

    def __init__(self) -> None:
        self.more = False  # the last read filled what it asked for: more may be waiting
        self._buf = bytearray()
        self._big: bytearray | None = None
        self._big_filled = 0
        self._big_header: tuple[int, int] = (0, 0)

    @property
    def idle(self) -> bool:
        """Whether no part of a frame waits here for the rest."""
        return not self._buf and self._big is None

    def read(self, fd: int) -> list[tuple[int, int, Body]] | None:
        """Read once from ``fd``; ``None`` at end of stream."""
        if self._big is not None:
            view = memoryview(self._big)[self._big_filled :]
            n = os.readv(fd, [view])
            if n == 0:
                return None
            self.more = n == len(view)
            self._big_filled += n
            if self._big_filled < len(self._big):
                return []
            kind, ident = self._big_header
            body = self._big
            self._big = None
            return [(kind, ident, body)]
        data = os.read(fd, _CHUNK)
        size = len(data)
        if not size:
            return None
        self.more = size == _CHUNK
        if not self._buf and size >= HEADER_SIZE:  # one whole frame (a call's, its answer)
            kind, ident, length = HEADER.unpack_from(data)
            if HEADER_SIZE + length == size:
                return [(kind, ident, data[HEADER_SIZE:])]
        return self.feed(data)

    def feed(self, data: Buffer) -> list[tuple[int, int, Body]]:
        """Add bytes; return the frames they complete."""
        out: list[tuple[int, int, Body]] = []
        big = self._big
        if big is not None:  # continue a large body
            view = memoryview(data).cast("B")
            take = min(len(big) - self._big_filled, view.nbytes)
            big[self._big_filled : self._big_filled + take] = view[:take]
            self._big_filled += take
            if self._big_filled < len(big):
                return out
            kind, ident = self._big_header
            out.append((kind, ident, big))
            self._big = None
            data = view[take:]
            if not data:
                return out
        buf = self._buf
        buf += data
        start = 0
        end = len(buf)
        while end - start >= HEADER_SIZE:
            kind, ident, length = HEADER.unpack_from(buf, start)
            if length > MAX_BODY:
                raise FrameError(
                    f"a frame announced {length} bytes, more than this machine's memory "
                    f"({MAX_BODY} bytes): the stream is corrupt"
                )
            body_start = start + HEADER_SIZE
            if end - body_start >= length:
                out.append((kind, ident, bytes(buf[body_start : body_start + length])))
                start = body_start + length
                continue
            if length >= _BIG:
                big = bytearray(length)
                have = end - body_start
                big[:have] = buf[body_start:end]
                self._big, self._big_filled, self._big_header = big, have, (kind, ident)
                start = end
            break
        if start:
            del buf[:start]
        return out

    @property
    def pending(self) -> bool:
        """Whether a partial frame is buffered."""
        return bool(self._buf) or self._big is not None


def iter_frames(fd: int) -> Iterator[tuple[int, int, bytes | bytearray]]:
    """Blocking iteration over the frames of ``fd`` until end of stream."""
    reader = FrameReader()
    while True:
        frames = reader.read(fd)
        if frames is None:
            return
        yield from frames
