"""Streamed arguments on the node (standard library only): a parameter annotated
``Iterator[T]`` reaches the task as an iterator over FEED frames the client sends while
the task runs (``_client/feeds.py``).

The client sends ``STREAM_WINDOW`` values ahead; the task's iterator gives it leave for
more (a CREDIT frame) as it takes them, so neither side holds more than a window.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from .._wire.frames import CREDIT_BODY, STREAM_WINDOW, Body

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ITEM, END, ERROR = 0, 1, 2
"""Second byte of a FEED body (the first is the argument's index): a value, the end, or
the client's iterator failed (the rest: its message)."""


class Context:
    """What the running task's feeds read from: set by the executor for each task."""

    def __init__(
        self,
        ident: int,
        receive: Callable[[int], Body | None],
        credit: Callable[[int, bytes], None],
        decode: Callable[[Body, int], Any],
    ) -> None:
        self.ident = ident
        self.receive = receive  # the next FEED body of this task (None: agent gone)
        self.credit = credit  # send CREDIT frames for this task
        self.decode = decode
        self.feeds: dict[int, Feed] = {}
        self.pending: dict[int, list[Body]] = {}  # bodies of feeds not read yet


current: Context | None = None  # the running task's (the process's first slot)
_thread = threading.local()  # a thread slot's own (Worker(executor="thread"))


def set_current(context: Context | None) -> None:
    """The task now running in this thread (None: none)."""
    global current
    if threading.current_thread() is threading.main_thread():
        current = context
    else:
        _thread.current = context


def _current() -> Context | None:
    if threading.current_thread() is threading.main_thread():
        return current
    return getattr(_thread, "current", None) or current


class Feed(Iterator["Any"]):
    """A streamed argument, on the node."""

    def __init__(self, context: Context, index: int) -> None:
        self.context = context
        self.index = index
        self.taken = 0
        self.done = False

    def __iter__(self) -> Feed:
        return self

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        ctx = self.context
        queue = ctx.pending.setdefault(self.index, [])
        while not queue:
            body = ctx.receive(ctx.ident)
            if body is None:
                raise ConnectionError("the node's agent is gone: the streamed argument ended")
            ctx.pending.setdefault(body[0], []).append(body)
        body = queue.pop(0)
        kind = body[1]
        if kind == END:
            self.done = True
            raise StopIteration
        if kind == ERROR:
            self.done = True
            raise RuntimeError(
                "the iterator given for a streamed argument failed on the client: "
                + bytes(body[2:]).decode(errors="replace")
            )
        self.taken += 1
        if self.taken >= STREAM_WINDOW // 2:
            ctx.credit(self.index, CREDIT_BODY.pack(self.taken))
            self.taken = 0
        return ctx.decode(body, 2)


def receive(index: int) -> Feed:
    """Unpickled in place of a streamed argument (see ``_client/feeds.py``)."""
    context = _current()
    if context is None:
        raise RuntimeError("a streamed argument was unpickled outside of its task")
    feed = context.feeds.get(index)
    if feed is None:
        feed = context.feeds[index] = Feed(context, index)
    return feed
