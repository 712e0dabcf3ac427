"""The asyncio core: one event loop in a daemon thread, shared by every pool.

The public API is synchronous; it hands coroutines to this loop and waits (:func:`wait`).
Agent output, results and timers are handled on the loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

WAIT_SLICE = 0.1
"""Seconds the main thread waits at a time for the loop's work (:func:`wait`): the most
a Ctrl-C received by another thread waits before it is raised."""

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_ident: int | None = None  # the loop thread's (per call: see in_loop_thread)


def get_loop() -> asyncio.AbstractEventLoop:
    """The shared loop, started on first use."""
    global _loop, _thread, _ident
    with _lock:
        if _loop is None or _thread is None or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            _thread = threading.Thread(target=serve, name="flotilla-loop", daemon=True)
            _thread.start()
            _ident = _thread.ident
            ready.wait()
            _loop = loop
        return _loop


def in_loop_thread() -> bool:
    return threading.get_ident() == _ident


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the loop and wait for its result from a non-loop thread."""
    if in_loop_thread():
        coro.close()
        raise RuntimeError("flotilla's blocking API cannot be used from its own event-loop thread")
    return wait(asyncio.run_coroutine_threadsafe(coro, get_loop()))


def wait(fut: concurrent.futures.Future[T]) -> T:
    """The result of ``fut`` (the loop's work), waited for; in the main thread a slice
    (:data:`WAIT_SLICE`) at a time.

    Linux may give a signal sent to the process (Ctrl-C's SIGINT, a SIGTERM) to any of
    its threads, and only the main thread runs Python's handlers, when it runs again: a
    main thread blocked in a wait without a timeout is not woken by a signal another
    thread took (the loop's, one in an API call), and KeyboardInterrupt would come only
    once ``fut`` is done (a pool's start: after its start timeout). Woken every slice, it
    raises the signal's exception within one."""
    if threading.current_thread() is not threading.main_thread():
        return fut.result()
    while True:
        try:
            return fut.result(WAIT_SLICE)  # the signal's exception is raised here
        except TimeoutError:
            if fut.done():  # (done meanwhile, or failed with a TimeoutError of its own)
                return fut.result()


def wait_slice() -> float | None:
    """The timeout of one wait of the calling thread for the client's work (a condition's,
    an event's, in a loop until it is there): :data:`WAIT_SLICE` in the main thread (see
    :func:`wait`), None (no timeout) in any other."""
    return WAIT_SLICE if threading.current_thread() is threading.main_thread() else None
