"""The futures of a pool's calls: ``concurrent.futures.Future`` objects, made cheap enough
for batches of thousands of calls.

A :class:`CallFuture` is a real ``Future`` (``wait``, ``as_completed``, callbacks and
``isinstance`` work as usual) that differs in three ways, none visible to its user:

- it is created RUNNING (a call is under way once it is made; ``cancel()`` returns False,
  ``pool.cancel`` stops calls);
- the futures of one batch (``gather``, a broadcast) share one condition variable
  instead of one each (a lock and a condition per call were a third of the client's time
  per call), and their :class:`Batch` counts them as they are settled, so that waiting
  for all of them (or the first failure) is one event, not a waiter on each;
- reads of a settled future (``done``, ``result``, ``exception``) take no lock;
- a future on its own makes its condition only when something needs it (a waiter, a
  callback, ``wait``): a lone call's caller reads its answer itself and never waits on
  the future, so its result is set with no condition to notify.

Sharing the condition means a waiter may be woken by a sibling's result: :meth:`result`
and :meth:`exception` wait in a loop until their own future is settled, where the base
class would raise ``TimeoutError`` after the first wake-up.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures._base import (  # the states the base class keeps in _state
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    RUNNING,
)
from typing import Any, TypeVar

from .loop import wait_slice

T = TypeVar("T")

_SETTLED = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED))
_MAKING = threading.Lock()
"""Held while a lone future's condition is made, or its result set without one: either
comes first, so a waiter never misses the result."""


class Batch:
    """The futures of one batch: their shared condition, and :attr:`ended`, set once
    every one of them is settled or one failed.

    Attributes:
        size: how many futures the batch has.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.condition = threading.Condition()
        self.ended = threading.Event()
        self._left = size
        self._lock = threading.Lock()

    def settled(self, failed: bool) -> None:
        """One of the batch's futures was settled (``failed``: with an exception)."""
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if failed or last:
            self.ended.set()

    def wait(self, futures: list[Future[Any]]) -> bool:
        """Wait until ``futures`` are settled or one failed, if they are this whole batch;
        False (nothing waited for) if they are not."""
        if len(futures) != self.size or any(getattr(f, "batch", None) is not self for f in futures):
            return False
        while not self.ended.wait(wait_slice()):  # (a Ctrl-C: see loop.wait)
            pass
        return True


class CallFuture(Future[T]):
    """A call's future (see the module's docstring), one of ``batch`` or on its own."""

    def __init__(self, batch: Batch | None = None) -> None:
        # the base's __init__, without its condition (the batch's, or made when needed:
        # __getattr__) and already RUNNING
        self.batch = batch
        if batch is not None:
            self._condition = batch.condition
        self._state = RUNNING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        """A lone future's condition, made on first use (only ``_condition`` gets here:
        every other attribute is set in ``__init__``)."""
        if name != "_condition":
            raise AttributeError(name)
        with _MAKING:
            made = self.__dict__.get("_condition")
            if made is None:
                made = self.__dict__["_condition"] = threading.Condition()
            return made

    def set_result(self, result: T) -> None:
        if "_condition" not in self.__dict__ and self._state not in _SETTLED:
            with _MAKING:  # alone, and nothing has waited for it (nor can now, until set)
                if "_condition" not in self.__dict__ and self._state not in _SETTLED:
                    self._result = result
                    self._state = FINISHED
                    return
        super().set_result(result)  # (settled already: InvalidStateError, as the base)
        if self.batch is not None:
            self.batch.settled(False)

    def set_exception(self, exception: BaseException | None) -> None:
        super().set_exception(exception)
        if self.batch is not None:
            self.batch.settled(True)

    def done(self) -> bool:
        return self._state in _SETTLED

    def cancelled(self) -> bool:
        return self._state == CANCELLED or self._state == CANCELLED_AND_NOTIFIED

    def running(self) -> bool:
        return self._state == RUNNING

    def result(self, timeout: float | None = None) -> T:
        if self._state == FINISHED and self._exception is None:
            return self._result  # type: ignore[no-any-return]
        self._wait(timeout)
        return super().result(0)  # settled (or TimeoutError): raised as the base does

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state == FINISHED:
            return self._exception
        self._wait(timeout)
        return super().exception(0)

    def _wait(self, timeout: float | None) -> None:
        """Until this future is settled, or ``timeout`` s have passed (a sibling's result
        may wake the shared condition first)."""
        with self._condition:
            if timeout is None:
                while self._state not in _SETTLED:
                    self._condition.wait(wait_slice())  # (a Ctrl-C: see loop.wait)
                return
            end = time.monotonic() + timeout
            while self._state not in _SETTLED:
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._condition.wait(left)
