"""The agent's event loop parts: epoll with a callback per descriptor, and a non-blocking
writer that queues what a pipe cannot take now (standard library only).

The agent is one thread: everything it does is a callback of :class:`Poller`, and every
write goes through an :class:`Outbox`, so a slow reader (a busy executor, an SSH channel)
never blocks the others.
"""

from __future__ import annotations

import os
import select
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice

from .._wire.frames import Buffer


class Poller:
    """epoll with a callback per descriptor.

    Callbacks registered ``first`` run before the others of the same wake-up: the
    executor's output pipes are drained before its results are forwarded, so a task's
    output always reaches the client before the task's result.
    """

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.callbacks: dict[int, tuple[bool, Callable[[], object]]] = {}
        self.writing: set[int] = set()  # the descriptors watched for writability

    def register(
        self, fd: int, write: bool, callback: Callable[[], object], first: bool = False
    ) -> None:
        self.epoll.register(fd, select.EPOLLOUT if write else select.EPOLLIN)
        self.callbacks[fd] = (first, callback)
        if write:
            self.writing.add(fd)

    def unregister(self, fd: int) -> None:
        if self.callbacks.pop(fd, None) is not None:
            self.epoll.unregister(fd)
            self.writing.discard(fd)

    def __contains__(self, fd: int) -> bool:
        return fd in self.callbacks

    def poll(self, timeout: float) -> Iterator[Callable[[], object]]:
        """The callbacks of the descriptors ready within ``timeout`` seconds, to run in
        turn. One whose descriptor an earlier callback of the same wake-up unregistered
        (an executor's pipes, closed when another's end restarted the group) is not given:
        its descriptor may be closed, or another's already (epoll is level-triggered: a
        descriptor registered again is reported by the next poll)."""
        events = self.epoll.poll(timeout)
        cbs = self.callbacks
        if len(events) == 1:
            entry = cbs.get(events[0][0])
            if entry:
                yield entry[1]
            return
        entries = [(fd, cbs[fd]) for fd, _ in events if fd in cbs]
        for fd, entry in [e for e in entries if e[1][0]] + [e for e in entries if not e[1][0]]:
            if cbs.get(fd) is entry:  # (still registered: see above)
                yield entry[1]

    def close(self) -> None:
        self.epoll.close()


class Outbox:
    """Non-blocking writer: queues what the descriptor cannot take now.

    ``Outbox.queued`` is set whenever an outbox of this process queues bytes: the agent's
    loop looks for outboxes to watch for writability only then (or while it watches one),
    not after every wake-up (it clears the flag when it looks).
    """

    queued = False

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.queue: deque[memoryview] = deque()
        self.broken = False
        self.held = 0  # > 0: no reader now; frames are kept (up to this many bytes)
        self.kept = 0  # bytes kept meanwhile

    def send(self, parts: list[Buffer]) -> None:
        if self.broken:
            return
        if self.held:  # whole frames, the oldest dropped past the limit
            data = memoryview(b"".join(parts))
            self.queue.append(data)
            Outbox.queued = True
            self.kept += data.nbytes
            while self.kept > self.held and len(self.queue) > 1:
                self.kept -= self.queue.popleft().nbytes
            return
        if not self.queue:  # fast path: write directly
            try:
                n = os.writev(self.fd, parts)
            except BlockingIOError:
                n = 0
            except OSError:
                self.broken = True
                return
            for p in parts:
                size = memoryview(p).nbytes
                if n >= size:
                    n -= size
                    continue
                self.queue.append(memoryview(p).cast("B")[n:])
                Outbox.queued = True
                n = 0
            return
        self.queue.extend(memoryview(p).cast("B") for p in parts if len(p))
        Outbox.queued = True
        self.flush()

    def flush(self) -> bool:
        """Write what fits; True when nothing is left."""
        q = self.queue
        if self.held:
            return False
        while q and not self.broken:
            try:
                n = os.writev(self.fd, list(islice(q, 256)))
            except BlockingIOError:
                return False
            except OSError:  # the reader is gone
                self.broken = True
                q.clear()
                return True
            while n:
                if n >= q[0].nbytes:
                    n -= q.popleft().nbytes
                else:
                    q[0] = q[0][n:]
                    n = 0
        return not q
