"""The ledger of what pools created: nothing an acquire cut short is left rented.

A provider records every call that creates something (an instance, an overlay network, a
pod, a container, a SLURM job) BEFORE it is sent, with what finds it again (the pool's
label or tag, or the provider's idempotency token): ``with allocation.creating(what,
key): <the call>`` (``base.Allocation.creating``). From its first record until its release
has ended, the allocation is on this process's ledger.

When the process exits with allocations still on the ledger (Ctrl-C or SIGTERM while a
pool starts, an exception, a pool never closed), :func:`end_all` gives each one back
synchronously, in the exiting thread, before anything else of the interpreter's shutdown:
it stops the allocation's waits (``Allocation.ending``), lets the creates already sent
finish (a bounded wait), then calls ``Allocation.sweep()``, which finds everything by its
key and gives it back. It runs at the start of the interpreter's shutdown (registered with
the ``threading`` module's exit hooks, which run before the worker threads of
``concurrent.futures`` are joined and before the daemon threads, the event loop's among
them, die with the process), so a create queued in a worker thread is refused instead of
sent, and a wait in one ends. SIGTERM's default action kills the process without any of
this: while a pool starts, :func:`sigterm_exits` makes it an exit (``SystemExit(143)``).

A forked child does not give back its parent's pools (the ledger belongs to the process
that recorded it).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook is registered before ours
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Protocol

logger = logging.getLogger("flotilla")


class Endable(Protocol):
    """What the ledger holds: an allocation (``base.Allocation``)."""

    def end_now(self) -> None: ...


_lock = threading.Lock()
_open: dict[int, Endable] = {}
_hooked_pid = 0
_ended = 0
"""The pid of this process once :func:`end_all` started in it."""


def enter(allocation: Endable) -> None:
    """Put ``allocation`` on the ledger (a create is about to be sent). RuntimeError once
    the process is exiting and the ledger was given back (:func:`end_all`): nothing may
    be created after that."""
    global _hooked_pid
    with _lock:
        if _ended == os.getpid():
            raise RuntimeError("the process is exiting")
        _open[id(allocation)] = allocation
        if _hooked_pid != os.getpid():
            _hooked_pid = os.getpid()
            register = getattr(threading, "_register_atexit", None)
            try:
                if register is None:
                    raise RuntimeError("no threading exit hook")
                register(end_all)  # before concurrent.futures joins its worker threads
            except RuntimeError:  # the interpreter is already shutting down
                atexit.register(end_all)


def leave(allocation: Endable) -> None:
    """Take ``allocation`` off the ledger (its release has ended)."""
    with _lock:
        _open.pop(id(allocation), None)


def pending() -> list[Endable]:
    """The allocations on the ledger."""
    with _lock:
        return list(_open.values())


def end_all() -> None:
    """Give back, synchronously, every allocation still on the ledger (the process exits)."""
    global _ended
    if os.getpid() != _hooked_pid:
        return  # a forked child: its parent's pools are not its own
    with _lock:
        _ended = os.getpid()
    for allocation in pending():
        try:
            allocation.end_now()
        except Exception as e:  # the others all the same
            logger.warning("could not give back everything a pool created: %s", e)
            print(f"flotilla: could not give back everything a pool created: {e}", file=sys.stderr)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While held (in the main thread, when SIGTERM has its default action): SIGTERM
    raises ``SystemExit(143)`` instead of killing the process at once, so what was
    being created is given back first (:func:`end_all`). Elsewhere: nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            yield  # the program handles SIGTERM itself
            return
    except ValueError:
        yield
        return

    def exit_now(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is exit_now:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
