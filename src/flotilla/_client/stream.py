"""Streaming results (Skyward's): a ``@function`` that ``yield`` s sends each value as it is
produced, and ``call >> pool`` returns an iterator over them.

The node sends ``STREAM_WINDOW`` values ahead, then waits for the client's leave (CREDIT)
to send more; the iterator gives that leave as its caller takes values. So a slow consumer
pauses the generator on the node, and at most a window of values waits in the client.
A caller that stops early closes the generator on the node as Python's ``close()`` does
(CLOSE): ``GeneratorExit`` is raised where it waits, at a ``yield`` (the one after the
values sent ahead), its ``finally`` blocks and context managers run, and the process stays
with its state. ``close()`` waits for that and raises what the generator raised meanwhile;
dropping the iterator asks the same without waiting. Values sent ahead are dropped.
(``pool.cancel`` stops the call at once instead: its process is replaced.)

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
from concurrent.futures import CancelledError, Future
from typing import Any

from .._wire.frames import CREDIT_BODY, STREAM_WINDOW, Kind
from .._wire.serialize import decode
from .loop import wait_slice

Node = Any  # _client.node.Node (which imports this module)
Submission = Any  # _client.node.Submission


class Values:
    """What a yielding call sent to its iterator (the submission holds it, not the
    iterator: a dropped iterator is collected, and closes its generator)."""

    def __init__(self, future: Future[Any]) -> None:
        self.queue: deque[bytes | bytearray] = deque()
        self.cond = threading.Condition()
        self.future = future
        self.where: tuple[Node, int] | None = None  # the node and task sending them
        self.closed = False  # its iterator was closed or dropped: no more values
        future.add_done_callback(self._ended)

    def put(self, node: Node, tid: int, body: bytes | bytearray) -> None:
        """A value (the loop thread)."""
        with self.cond:
            if self.closed:  # sent ahead before the node had the CLOSE: dropped
                return
            self.where = (node, tid)
            self.queue.append(body)
            self.cond.notify_all()

    def _ended(self, _: Future[Any]) -> None:
        with self.cond:
            self.cond.notify_all()

    def drop(self) -> None:
        """No more values: those here and those still coming are dropped."""
        with self.cond:
            self.closed = True
            self.queue.clear()
            self.where = None  # no CREDIT any more


class Stream(Iterator[Any]):
    """The iterator ``call >> pool`` returns for a yielding function."""

    def __init__(
        self,
        values: Values,
        cancel: Callable[[], None],
        close: Callable[[bool], bool],
    ) -> None:
        self._values = values
        self._future = values.future
        self._cancel = cancel
        self._close = close  # (wait) -> whether its node was asked to close it (CLOSE)
        self._taken = 0  # values taken since the last CREDIT

    def __iter__(self) -> Stream:
        return self

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._values.closed

    def __next__(self) -> Any:
        v = self._values
        with v.cond:
            if v.closed:  # as a closed generator's
                raise StopIteration
            while not v.queue and not self._future.done():
                v.cond.wait(wait_slice())  # (a Ctrl-C: see loop.wait)
            if not v.queue:
                self._future.result()  # raises the call's error, if it failed
                raise StopIteration
            body = v.queue.popleft()
            self._taken += 1
            credit = self._taken >= STREAM_WINDOW // 2 and v.where is not None
            if credit:
                where, more = v.where, self._taken
                self._taken = 0
        if credit and where is not None:
            node, tid = where
            node.send_control(Kind.CREDIT, ident=tid, body=CREDIT_BODY.pack(more))
        return decode(body)

    def close(self) -> None:
        """Close the generator on its node as Python's ``close()`` does: ``GeneratorExit``
        is raised at the ``yield`` where it waits, and this returns once it has finished
        (its ``finally`` blocks ran), raising what it raised meanwhile (e.g. a
        ``RuntimeError`` if it yielded again). Its process stays. A call not on a node
        yet is cancelled. Ctrl-C while this waits stops the call (``pool.cancel``)."""
        if self._values.closed:
            return
        self._values.drop()
        if self._future.done():
            return
        if not self._close(True):
            self._cancel()
        try:
            self._future.exception()  # wait: a generator stops at its next yield
        except CancelledError:
            return
        except BaseException:  # Ctrl-C: stop it now
            self._cancel()
            raise
        error = self._future.exception()
        if error is not None:
            raise error

    def __del__(self) -> None:
        """A dropped iterator closes its generator without waiting for it."""
        if self._values.closed or self._future.done():
            return
        self._values.drop()
        try:
            if not self._close(False):
                self._cancel()
        except Exception:
            pass


def on_yield(node: Node, sub: Submission, tid: int, body: bytes | bytearray) -> None:
    """A YIELD frame for ``sub`` (the loop thread): to its iterator, or collected."""
    if isinstance(sub.stream, Values):
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
