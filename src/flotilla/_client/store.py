"""The distributed collections' state: one store per pool, in the client process.

The client is the one part of a pool whose loss ends the pool, so the collections live
here: a node's operation travels executor -> agent -> client (a STORE frame) and its answer
back (STORED); the client's own operations are applied directly. Every operation is applied
by the store's one thread, in the order it arrives, so each is atomic and all of them are
linearizable ("strong"; "eventual" is given the same guarantee).

When a node is lost, its collections' contents stay; what its tasks were waiting for
(a queue's get, a barrier, a lock) is dropped, the locks its processes held are released,
and its arrivals at barriers are withdrawn (a call sent again elsewhere arrives again).
A value its task took from a queue just before the loss is gone with it. A task process that
ends while its node lives (a crash, a timeout: its agent says so) has its locks released
too. Nothing is kept once the pool closes.
"""

from __future__ import annotations

import heapq
import itertools
import pickle
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .._wire.serialize import dumps
from .loop import wait

Reply = Callable[[tuple[Any, ...]], None]
"""Takes an answer: ``(True, value)`` or ``(False, exception type name, message)``."""

KINDS = frozenset({"dict", "counter", "set", "queue", "barrier", "lock", "registry", "process"})
"""The request kinds the store applies."""

CLIENT = -1
"""The origin of the client's own operations (nodes are their rank)."""


@dataclass(eq=False)
class _Waiter:
    """An operation that waits (a queue's get, a barrier, a lock's acquire)."""

    origin: int
    reply: Reply
    owner: Any = None
    timed_out: Any = None  # the answer when its deadline passes
    lease: float | None = None  # a lock's: seconds it is held at most once taken
    done: bool = False

    def answer(self, value: Any) -> None:
        if not self.done:
            self.done = True
            self.reply((True, value))


@dataclass
class _Queue:
    items: deque[Any] = field(default_factory=deque)
    waiters: deque[_Waiter] = field(default_factory=deque)


@dataclass
class _Barrier:
    n: int
    arrived: list[_Waiter] = field(default_factory=list)


@dataclass
class _Lock:
    owner: Any = None
    holds: int = 0  # times it was taken (a lease ends only the hold it was given for)
    waiters: deque[_Waiter] = field(default_factory=deque)


class Store:
    """A pool's collections, applied by one thread (see the module docstring)."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[tuple[str, int, Any, Reply | None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self.dicts: dict[str, dict[Any, Any]] = {}
        self.counters: dict[str, int] = {}
        self.sets: dict[str, set[Any]] = {}
        self.queues: dict[str, _Queue] = {}
        self.barriers: dict[str, _Barrier] = {}
        self.locks: dict[str, _Lock] = {}
        self.registries: dict[str, dict[Any, Any]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()

    # -- entry points (any thread) ----------------------------------------------------
    def submit(self, origin: int, request: bytes | tuple[Any, ...], reply: Reply) -> None:
        """Apply a request (pickled, from a node, or a tuple) and ``reply`` with its answer."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="flotilla-collections", daemon=True
                    )
                    self._thread.start()
        if self._closed:
            reply((False, "PoolClosedError", "the pool closed: its collections are gone"))
            return
        self._inbox.put(("op", origin, request, reply))

    def ask(self, request: tuple[Any, ...]) -> tuple[Any, ...]:
        """Apply a request of the client's own; its answer (see :data:`Reply`)."""
        answer: Future[tuple[Any, ...]] = Future()
        self.submit(CLIENT, request, answer.set_result)
        return wait(answer)  # (a Ctrl-C: see loop.wait)

    def forget(self, origin: int) -> None:
        """Node ``origin`` is lost (see the module docstring)."""
        if self._thread is not None:
            self._inbox.put(("forget", origin, None, None))

    def close(self) -> None:
        """End the store: waiting operations fail; later ones too."""
        self._closed = True
        if self._thread is not None:
            self._inbox.put(("close", CLIENT, None, None))
            self._thread.join()

    # -- the store's thread -------------------------------------------------------------
    def _run(self) -> None:
        import time

        while True:
            timeout = None
            if self._deadlines:
                timeout = max(0.0, self._deadlines[0][0] - time.monotonic())
            try:
                what, origin, request, reply = self._inbox.get(timeout=timeout)
            except queue.Empty:
                what = ""
            if what == "op":
                assert reply is not None
                self._apply(origin, request, reply)
            elif what == "forget":
                self._forget(origin)
            elif what == "close":
                for w in self._all_waiters():
                    if not w.done:
                        w.done = True
                        w.reply((False, "PoolClosedError", "the pool closed"))
                return
            now = time.monotonic()
            while self._deadlines and self._deadlines[0][0] <= now:
                _, _, w = heapq.heappop(self._deadlines)
                if w.timed_out is _EXPIRE:  # a lock's lease: released if still that hold
                    lock, holds = w.owner
                    if lock.holds == holds and lock.owner is not None:
                        self._hand_over(lock)
                elif not w.done:
                    w.answer(w.timed_out)

    def _apply(self, origin: int, request: bytes | tuple[Any, ...], reply: Reply) -> None:
        try:
            req = pickle.loads(request) if isinstance(request, bytes | bytearray) else request
            kind, name, op, *args = req
            if kind not in KINDS or not str(op).isidentifier() or op.startswith("_"):
                raise ValueError(f"no such collection operation: {kind!r} {op!r}")
            value = getattr(self, f"_{kind}_{op}")(origin, reply, name, *args)
        except Exception as e:
            reply((False, type(e).__name__, str(e)))
            return
        if value is not _WAIT:
            reply((True, value))

    def _wait(self, waiter: _Waiter, timeout: float | None) -> Any:
        if timeout is not None:
            import time

            deadline = time.monotonic() + max(0.0, float(timeout))
            heapq.heappush(self._deadlines, (deadline, next(self._seq), waiter))
        return _WAIT

    def _all_waiters(self) -> list[_Waiter]:
        out: list[_Waiter] = []
        for q in self.queues.values():
            out += q.waiters
        for b in self.barriers.values():
            out += b.arrived
        for lock in self.locks.values():
            out += lock.waiters
        return out

    def _forget(self, origin: int) -> None:
        for w in self._all_waiters():
            if w.origin == origin:
                w.done = True
        for b in self.barriers.values():
            b.arrived = [w for w in b.arrived if w.origin != origin]
        for lock in self.locks.values():
            if lock.owner is not None and lock.owner[0] == origin:
                self._hand_over(lock)

    # -- a task process ended (its agent says so) ----------------------------------------
    def _process_gone(self, origin: int, _r: Reply, _name: str, pid: int) -> None:
        """The process ``pid`` of node ``origin`` ended: its locks are released and its
        waits for locks dropped."""
        owner = (origin, pid)
        for lock in self.locks.values():
            for w in lock.waiters:
                if w.owner == owner:
                    w.done = True
            if lock.owner == owner:
                self._hand_over(lock)

    # -- dict ---------------------------------------------------------------------------
    def _d(self, name: str) -> dict[Any, Any]:
        return self.dicts.setdefault(name, {})

    def _dict_get(self, _o: int, _r: Reply, name: str, key: Any) -> tuple[bool, Any]:
        d = self._d(name)
        return (True, d[key]) if key in d else (False, None)

    def _dict_set(self, _o: int, _r: Reply, name: str, key: Any, value: Any) -> None:
        self._d(name)[key] = value

    def _dict_del(self, _o: int, _r: Reply, name: str, key: Any) -> None:
        del self._d(name)[key]

    def _dict_contains(self, _o: int, _r: Reply, name: str, key: Any) -> bool:
        return key in self._d(name)

    def _dict_update(self, _o: int, _r: Reply, name: str, items: dict[Any, Any]) -> None:
        self._d(name).update(items)

    def _dict_pop(self, _o: int, _r: Reply, name: str, key: Any) -> tuple[bool, Any]:
        d = self._d(name)
        return (True, d.pop(key)) if key in d else (False, None)

    def _dict_len(self, _o: int, _r: Reply, name: str) -> int:
        return len(self._d(name))

    def _dict_keys(self, _o: int, _r: Reply, name: str) -> list[Any]:
        return list(self._d(name))

    def _dict_items(self, _o: int, _r: Reply, name: str) -> list[tuple[Any, Any]]:
        return list(self._d(name).items())

    def _dict_clear(self, _o: int, _r: Reply, name: str) -> None:
        self._d(name).clear()

    # -- registry (a dict of its own namespace) -------------------------------------------
    def _registry_register(self, _o: int, _r: Reply, name: str, key: Any, value: Any) -> None:
        self.registries.setdefault(name, {})[key] = value

    def _registry_lookup(self, _o: int, _r: Reply, name: str, key: Any) -> Any:
        return self.registries.get(name, {}).get(key)

    def _registry_unregister(self, _o: int, _r: Reply, name: str, key: Any) -> None:
        self.registries.get(name, {}).pop(key, None)

    def _registry_list(self, _o: int, _r: Reply, name: str) -> list[Any]:
        return list(self.registries.get(name, {}))

    # -- counter ------------------------------------------------------------------------
    def _counter_add(self, _o: int, _r: Reply, name: str, n: int) -> int:
        value = self.counters.get(name, 0) + n
        self.counters[name] = value
        return value

    def _counter_get(self, _o: int, _r: Reply, name: str) -> int:
        return self.counters.get(name, 0)

    def _counter_reset(self, _o: int, _r: Reply, name: str, value: int) -> None:
        self.counters[name] = value

    # -- set ----------------------------------------------------------------------------
    def _set_add(self, _o: int, _r: Reply, name: str, value: Any) -> None:
        self.sets.setdefault(name, set()).add(value)

    def _set_discard(self, _o: int, _r: Reply, name: str, value: Any) -> None:
        self.sets.setdefault(name, set()).discard(value)

    def _set_contains(self, _o: int, _r: Reply, name: str, value: Any) -> bool:
        return value in self.sets.get(name, ())

    def _set_len(self, _o: int, _r: Reply, name: str) -> int:
        return len(self.sets.get(name, ()))

    def _set_items(self, _o: int, _r: Reply, name: str) -> list[Any]:
        return list(self.sets.get(name, ()))

    def _set_clear(self, _o: int, _r: Reply, name: str) -> None:
        self.sets.pop(name, None)

    # -- queue --------------------------------------------------------------------------
    def _queue_put(self, _o: int, _r: Reply, name: str, value: Any) -> None:
        q = self.queues.setdefault(name, _Queue())
        while q.waiters:
            w = q.waiters.popleft()
            if not w.done:
                w.answer(value)
                return
        q.items.append(value)

    def _queue_get(self, origin: int, reply: Reply, name: str, timeout: float | None) -> Any:
        q = self.queues.setdefault(name, _Queue())
        if q.items:
            return q.items.popleft()
        if timeout is not None and timeout <= 0:
            return None
        waiter = _Waiter(origin, reply)
        q.waiters.append(waiter)
        return self._wait(waiter, timeout)

    def _queue_len(self, _o: int, _r: Reply, name: str) -> int:
        return len(self.queues.get(name, _Queue()).items)

    def _queue_clear(self, _o: int, _r: Reply, name: str) -> None:
        self.queues.setdefault(name, _Queue()).items.clear()

    # -- barrier ------------------------------------------------------------------------
    def _barrier_wait(
        self, origin: int, reply: Reply, name: str, n: int, timeout: float | None
    ) -> Any:
        b = self.barriers.setdefault(name, _Barrier(n))
        if b.n != n:
            raise ValueError(f"barrier {name!r} is for {b.n} parties, not {n}")
        waiter = _Waiter(origin, reply, timed_out=False)
        b.arrived.append(waiter)
        if len(b.arrived) < n:
            return self._wait(waiter, timeout)
        arrived, b.arrived = b.arrived, []
        for w in arrived:
            w.answer(True)
        return _WAIT

    # -- lock ---------------------------------------------------------------------------
    def _lock_acquire(
        self,
        origin: int,
        reply: Reply,
        name: str,
        owner: Any,
        timeout: float | None,
        ttl: float | None = None,
    ) -> Any:
        lock = self.locks.setdefault(name, _Lock())
        owner = (origin, owner)
        if lock.owner is None:
            self._take(lock, owner, ttl)
            return True
        if timeout is not None and timeout <= 0:
            return False
        waiter = _Waiter(origin, reply, owner=owner, timed_out=False, lease=ttl)
        lock.waiters.append(waiter)
        return self._wait(waiter, timeout)

    def _take(self, lock: _Lock, owner: Any, ttl: float | None) -> None:
        """``owner`` holds ``lock``; with a lease of ``ttl`` s, after which it is released."""
        lock.owner = owner
        lock.holds += 1
        if ttl:
            import time

            expiry = _Waiter(CLIENT, lambda _: None, owner=(lock, lock.holds))
            expiry.timed_out = _EXPIRE
            heapq.heappush(self._deadlines, (time.monotonic() + ttl, next(self._seq), expiry))

    def _lock_release(self, origin: int, _r: Reply, name: str, owner: Any) -> None:
        lock = self.locks.setdefault(name, _Lock())
        if lock.owner != (origin, owner):
            held = "not held" if lock.owner is None else "held by another process"
            raise RuntimeError(f"lock {name!r} is {held}: it cannot be released here")
        self._hand_over(lock)

    def _lock_locked(self, _o: int, _r: Reply, name: str) -> bool:
        return self.locks.setdefault(name, _Lock()).owner is not None

    def _hand_over(self, lock: _Lock) -> None:
        lock.owner = None
        while lock.waiters:
            w = lock.waiters.popleft()
            if not w.done:
                self._take(lock, w.owner, w.lease)
                w.answer(True)
                return


_WAIT = object()
"""An operation's answer comes later (it waits)."""
_EXPIRE = object()
"""Marks a lock's lease among the deadlines."""


def encode_answer(answer: tuple[Any, ...]) -> bytes:
    """An answer as the body of a STORED frame."""
    try:
        return dumps(answer)
    except Exception as e:
        return dumps((False, "SerializationError", f"the value cannot be pickled: {e}"))
