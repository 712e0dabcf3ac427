"""The asyncio core: one event loop in a daemon thread, shared by every pool.

The public API is synchronous; it hands coroutines to this loop and waits. Agent output,
results and timers are handled on the loop thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def get_loop() -> asyncio.AbstractEventLoop:
    """The shared loop, started on first use."""
    global _loop, _thread
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
            ready.wait()
            _loop = loop
        return _loop


def in_loop_thread() -> bool:
    return _thread is not None and threading.current_thread() is _thread


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the loop and wait for its result from a non-loop thread."""
    if in_loop_thread():
        coro.close()
        raise RuntimeError("flotilla's blocking API cannot be used from its own event-loop thread")
    return asyncio.run_coroutine_threadsafe(coro, get_loop()).result()
