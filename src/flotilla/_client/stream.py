"""Streaming results (Skyward's): a ``@function`` that ``yield`` s sends each value as it is
produced, and ``call >> pool`` returns an iterator over them.

The node sends ``STREAM_WINDOW`` values ahead, then waits for the client's leave (CREDIT)
to send more; the iterator gives that leave as its caller takes values. So a slow consumer
pauses the generator on the node, and at most a window of values waits in the client.
A caller that stops early (``close()``, or drops the iterator) cancels the call: its
process on the node is replaced.

Calls of a yielding function sent otherwise (``@``, ``gather``, ``>``) collect the values:
their result is the list of them.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from .._wire.frames import CREDIT_BODY, STREAM_WINDOW, Kind
from .._wire.serialize import decode

Node = Any  # _client.node.Node (which imports this module)
Submission = Any  # _client.node.Submission


class Stream(Iterator[Any]):
    """The iterator ``call >> pool`` returns for a yielding function."""

    def __init__(self, future: Future[Any], cancel: Callable[[], None]) -> None:
        self._values: deque[bytes | bytearray] = deque()
        self._cond = threading.Condition()
        self._future = future
        self._cancel = cancel
        self._taken = 0  # values taken since the last CREDIT
        self._where: tuple[Node, int] | None = None  # the node and task sending them
        self._closed = False
        future.add_done_callback(self._ended)

    # -- the loop thread ----------------------------------------------------------------
    def put(self, node: Node, tid: int, body: bytes | bytearray) -> None:
        with self._cond:
            self._where = (node, tid)
            self._values.append(body)
            self._cond.notify_all()

    def _ended(self, _: Future[Any]) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the caller ----------------------------------------------------------------------
    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Any:
        with self._cond:
            while not self._values and not self._future.done():
                self._cond.wait()
            if not self._values:
                self._future.result()  # raises the call's error, if it failed
                raise StopIteration
            body = self._values.popleft()
            self._taken += 1
            credit = self._taken >= STREAM_WINDOW // 2 and self._where is not None
            if credit:
                where, more = self._where, self._taken
                self._taken = 0
        if credit and where is not None:
            node, tid = where
            node.send_control(Kind.CREDIT, ident=tid, body=CREDIT_BODY.pack(more))
        return decode(body)

    def close(self) -> None:
        """Stop the call if it still runs (its process on the node is replaced)."""
        if not self._closed:
            self._closed = True
            if not self._future.done():
                self._cancel()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def on_yield(node: Node, sub: Submission, tid: int, body: bytes | bytearray) -> None:
    """A YIELD frame for ``sub`` (the loop thread): to its iterator, or collected."""
    if isinstance(sub.stream, Stream):
        sub.stream.put(node, tid, body)
        return
    if sub.collected is None:
        sub.collected = []
    sub.collected.append(body)
    credit = CREDIT_BODY.pack(1)
    if not node.send_control(Kind.CREDIT, wait=False, ident=tid, body=credit):
        assert node.loop is not None  # not on the loop: a write in progress holds the lock
        node.loop.run_in_executor(None, node.send_control, Kind.CREDIT, True, tid, credit)


def stream(fn: Any = None, /, **options: Any) -> Any:
    """Skyward's ``@sky.stream``: ``@flotilla.function`` for a generator function (whose
    ``call >> pool`` returns an iterator); anything else is refused."""
    from .function import function

    def make(f: Any) -> Any:
        if not yields(getattr(f, "fn", f)):
            from .._errors import ConfigurationError

            name = getattr(f, "__name__", type(f).__name__)
            raise ConfigurationError(
                f"@flotilla.stream needs a generator function (one that yields): {name} "
                "is not; use @flotilla.function"
            )
        return function(f, **options)

    return make if fn is None else make(fn)


_yields: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def yields(fn: Any) -> bool:
    """Whether ``fn`` is a generator function (its calls stream their values)."""
    try:
        return _yields[fn]
    except (KeyError, TypeError):  # TypeError: not weakly referenceable, never cached
        pass
    answer = inspect.isgeneratorfunction(inspect.unwrap(fn))
    with contextlib.suppress(TypeError):
        _yields[fn] = answer
    return answer


def collected(sub: Submission) -> list[Any]:
    """The values a yielding call sent without an iterator: its result."""
    return [decode(body) for body in sub.collected or ()]
