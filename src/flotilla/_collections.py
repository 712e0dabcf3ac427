"""Distributed collections (Skyward's): ``sky.dict``, ``sky.counter``, ``sky.set``,
``sky.queue``, ``sky.barrier`` and ``sky.lock``.

Named, created on first use, shared by the client and every process of a cluster pool::

    @sky.function
    def work(i):
        sky.counter("done").increment()
        sky.dict("results")[i] = i * i

    with sky.Compute(nodes=4) as pool:
        work.map(range(100)) ...
        print(int(pool.counter("done")), pool.dict("results")[7])

Where they live: in the client process (``_client/store.py``), the one part whose loss
ends the pool; nodes reach them over their agent's channel. The loss of any node loses
nothing stored (see ``_client/store.py`` for what its waits and locks become); nothing
is promised once the client is gone. Every operation is atomic and linearizable, whatever
the ``consistency`` asked ("eventual" is given the strong guarantee).

A proxy names its collection and finds it where it is used: pickled into a task it talks to
the task's pool. This module is loaded by tasks on nodes: standard library only.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import pickle
import threading
from typing import Any, Literal, Protocol

from ._errors import (
    ClusterRequiredError,
    ConfigurationError,
    PoolClosedError,
    SerializationError,
    check_number,
)

Consistency = Literal["strong", "eventual"]


class Backend(Protocol):
    """Applies a request ``(kind, name, op, *args)``; answers ``(True, value)`` or
    ``(False, exception type name, message)``."""

    def ask(self, request: tuple[Any, ...]) -> tuple[Any, ...]: ...


_pools: builtins.list[tuple[Backend | None, str]] = []
"""The client's open pools, most recent last: (store, or None if not a cluster; name)."""
_pools_lock = threading.Lock()


def activate(store: Backend | None, name: str) -> None:
    """A pool opened (the client side; ``store`` None: not a cluster pool)."""
    with _pools_lock:
        _pools.append((store, name))


def deactivate(name: str) -> None:
    with _pools_lock:
        _pools[:] = [p for p in _pools if p[1] != name]


NOT_CLUSTER = (
    "distributed collections need a cluster pool: this pool has Options(cluster=False) "
    "(use cluster=True)"
)


class _NodeBackend:
    """A task's way to its pool's collections: the executor's channel to the client."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel

    def ask(self, request: tuple[Any, ...]) -> tuple[Any, ...]:
        from ._wire.serialize import dumps

        answer: tuple[Any, ...] = pickle.loads(self.channel.request(dumps(request)))
        return answer


def _backend() -> Backend:
    from ._info import in_task

    if in_task():
        from ._node.storechannel import channel

        found = channel()
        if found is None:
            raise ClusterRequiredError(NOT_CLUSTER)
        return _NodeBackend(found)
    with _pools_lock:
        if not _pools:
            raise ClusterRequiredError(
                "distributed collections live in a pool: use them inside "
                "`with sky.Compute(...)` (on the client or in its tasks)"
            )
        store = _pools[-1][0]
    if store is None:
        raise ClusterRequiredError(NOT_CLUSTER)
    return store


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"a {what} needs a name (a non-empty str), got {name!r}")
    return name


def _check_consistency(consistency: object) -> Consistency | None:
    if consistency not in (None, "strong", "eventual"):
        raise ConfigurationError(f"consistency must be 'strong' or 'eventual', got {consistency!r}")
    return consistency


def _check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    check_number(timeout, f"timeout must be None or seconds >= 0, got {timeout!r}", at_least=0)
    assert isinstance(timeout, int | float)
    return float(timeout)


_ERRORS: builtins.dict[str, type[Exception]] = {
    e.__name__: e
    for e in (
        KeyError,
        ValueError,
        TypeError,
        RuntimeError,
        ConfigurationError,
        PoolClosedError,
        SerializationError,
    )
}
"""The errors the store answers with, by name (any other: RuntimeError)."""


def _raise(kind: str, message: str) -> Any:
    raise _ERRORS.get(kind, RuntimeError)(message)


def _owner() -> int:
    """Who holds a lock: this process (any of its threads may release it; the store adds
    the node)."""
    return os.getpid()


class _Proxy:
    """A named collection: where it is used, it finds its pool (see the module docstring)."""

    _kind = ""

    def __init__(self, name: str, backend: Backend | None = None) -> None:
        self._name = _check_name(name, f"sky.{self._kind}")
        self._bound = backend

    @property
    def name(self) -> str:
        return self._name

    def _ask(self, op: str, *args: Any) -> Any:
        backend = self._bound if self._bound is not None else _backend()
        answer = backend.ask((self._kind, self._name, op, *args))
        if answer[0]:
            return answer[1]
        return _raise(answer[1], answer[2])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._name,))

    def __repr__(self) -> str:
        return f"<flotilla.{self._kind} {self._name!r}>"


class _Consistent(_Proxy):
    """A collection that takes Skyward's ``consistency`` (kept, and pickled with it)."""

    def __init__(
        self, name: str, backend: Backend | None = None, consistency: Consistency | None = None
    ) -> None:
        super().__init__(name, backend)
        self.consistency = _check_consistency(consistency)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._name, None, self.consistency))


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


class Dict(_Consistent):
    """A distributed dict: ``d[key] = value``, ``d[key]``, ``del d[key]``, ``key in d``,
    ``get``, ``update``, ``pop``, ``len``, ``keys``, ``items``."""

    _kind = "dict"

    def __getitem__(self, key: Any) -> Any:
        found, value = self._ask("get", key)
        if not found:
            raise KeyError(key)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self._ask("set", key, value)

    def __delitem__(self, key: Any) -> None:
        self._ask("del", key)

    def __contains__(self, key: Any) -> bool:
        return bool(self._ask("contains", key))

    def __len__(self) -> int:
        return int(self._ask("len"))

    def get(self, key: Any, default: Any = None) -> Any:
        found, value = self._ask("get", key)
        return value if found else default

    def update(self, items: Any = (), **more: Any) -> None:
        self._ask("update", builtins.dict(items, **more))

    def pop(self, key: Any, default: Any = None) -> Any:
        found, value = self._ask("pop", key)
        return value if found else default

    def keys(self) -> builtins.list[Any]:
        return builtins.list(self._ask("keys"))

    def items(self) -> builtins.list[tuple[Any, Any]]:
        return builtins.list(self._ask("items"))

    def clear(self) -> None:
        self._ask("clear")

    async def get_async(self, key: Any, default: Any = None) -> Any:
        return await _in_thread(self.get, key, default)

    async def set_async(self, key: Any, value: Any) -> None:
        await _in_thread(self.__setitem__, key, value)

    async def update_async(self, items: Any) -> None:
        await _in_thread(self.update, items)

    async def pop_async(self, key: Any, default: Any = None) -> Any:
        return await _in_thread(self.pop, key, default)


class Counter(_Consistent):
    """A distributed counter: ``increment``, ``decrement``, ``reset``, ``value``, ``int()``."""

    _kind = "counter"

    @property
    def value(self) -> int:
        return int(self._ask("get"))

    def increment(self, n: int = 1) -> int:
        """Add ``n``; the new value."""
        return int(self._ask("add", n))

    def decrement(self, n: int = 1) -> int:
        """Subtract ``n``; the new value."""
        return int(self._ask("add", -n))

    def reset(self, value: int = 0) -> None:
        self._ask("reset", value)

    def add(self, delta: int = 1) -> int:
        """Add ``delta`` (Skyward's newer name for ``increment``); the new value."""
        return int(self._ask("add", delta))

    def get(self) -> int:
        """The value (Skyward's newer name for ``value``)."""
        return self.value

    def __int__(self) -> int:
        return self.value

    async def value_async(self) -> int:
        return int(await _in_thread(self._ask, "get"))

    async def increment_async(self, n: int = 1) -> int:
        return int(await _in_thread(self.increment, n))

    async def decrement_async(self, n: int = 1) -> int:
        return int(await _in_thread(self.decrement, n))

    async def reset_async(self, value: int = 0) -> None:
        await _in_thread(self.reset, value)


class Set(_Consistent):
    """A distributed set: ``add``, ``discard``, ``in``, ``len``."""

    _kind = "set"

    def add(self, value: Any) -> None:
        self._ask("add", value)

    def discard(self, value: Any) -> None:
        self._ask("discard", value)

    def remove(self, value: Any) -> None:
        """Skyward's newer name for ``discard`` (no error when ``value`` is absent)."""
        self._ask("discard", value)

    def clear(self) -> None:
        self._ask("clear")

    def __contains__(self, value: Any) -> bool:
        return bool(self._ask("contains", value))

    def __len__(self) -> int:
        return int(self._ask("len"))

    def items(self) -> builtins.list[Any]:
        return builtins.list(self._ask("items"))

    async def add_async(self, value: Any) -> None:
        await _in_thread(self.add, value)

    async def discard_async(self, value: Any) -> None:
        await _in_thread(self.discard, value)

    async def contains_async(self, value: Any) -> bool:
        return bool(await _in_thread(self.__contains__, value))


class Queue(_Proxy):
    """A distributed FIFO queue: ``put``, ``get(timeout=None)`` (None when the timeout
    passes), ``empty``, ``len``. Each value put is taken by one ``get``."""

    _kind = "queue"

    def put(self, value: Any) -> None:
        self._ask("put", value)

    def get(self, timeout: float | None = None) -> Any:
        """The oldest value, waiting for one up to ``timeout`` seconds (None: no limit)."""
        return self._ask("get", _check_timeout(timeout))

    def offer(self, value: Any) -> None:
        """Skyward's newer name for ``put``."""
        self.put(value)

    def poll(self) -> Any:
        """The oldest value, or None at once if there is none."""
        return self.get(timeout=0)

    def clear(self) -> None:
        self._ask("clear")

    def empty(self) -> bool:
        return len(self) == 0

    def __len__(self) -> int:
        return int(self._ask("len"))

    async def put_async(self, value: Any) -> None:
        await _in_thread(self.put, value)

    async def get_async(self, timeout: float | None = None) -> Any:
        return await _in_thread(self.get, timeout)


class Barrier(_Proxy):
    """A distributed barrier of ``n`` parties: ``wait()`` returns once ``n`` have called it
    (then it is ready for the next round)."""

    _kind = "barrier"

    def __init__(self, name: str, n: int, backend: Backend | None = None) -> None:
        super().__init__(name, backend)
        check_number(n, f"sky.barrier needs n >= 1 parties, got {n!r}", whole=True, at_least=1)
        self.n = n

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._name, self.n))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the others; False if ``timeout`` seconds passed first."""
        return bool(self._ask("wait", self.n, _check_timeout(timeout)))

    async def wait_async(self, timeout: float | None = None) -> bool:
        return bool(await _in_thread(self.wait, timeout))


class Lock(_Proxy):
    """A distributed lock: ``acquire``, ``release``, ``with lock:``. Not reentrant; held by
    one process (released by any of its threads); released by the store when the node
    holding it is lost, or ``ttl`` seconds after it was taken (a lease) when given.
    ``timeout`` bounds the wait of ``with lock:`` and ``acquire()`` (RuntimeError when
    it passes in ``with``)."""

    _kind = "lock"

    def __init__(
        self,
        name: str,
        backend: Backend | None = None,
        ttl: float | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(name, backend)
        self.ttl = _check_timeout(ttl)
        self.timeout = _check_timeout(timeout)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._name, None, self.ttl, self.timeout))

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock; False if it was not free (``blocking=False``) or ``timeout``
        seconds passed first (default: the lock's ``timeout``)."""
        wait = _check_timeout(self.timeout if timeout is None else timeout) if blocking else 0.0
        return bool(self._ask("acquire", _owner(), wait, self.ttl))

    def release(self) -> None:
        self._ask("release", _owner())

    def locked(self) -> bool:
        return bool(self._ask("locked"))

    def __enter__(self) -> Lock:
        if not self.acquire():
            raise RuntimeError(f"lock {self._name!r}: not acquired within {self.timeout:g} s")
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    async def acquire_async(self) -> bool:
        return bool(await _in_thread(self.acquire))

    async def release_async(self) -> None:
        await _in_thread(self.release)

    async def __aenter__(self) -> Lock:
        await _in_thread(self.__enter__)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.release_async()


class Registry(_Proxy):
    """Named values: ``register(key, value)``, ``lookup(key)`` (None if absent),
    ``unregister(key)``, ``list()`` (the keys)."""

    _kind = "registry"

    def register(self, key: Any, value: Any) -> None:
        self._ask("register", key, value)

    def lookup(self, key: Any) -> Any:
        return self._ask("lookup", key)

    def unregister(self, key: Any) -> None:
        self._ask("unregister", key)

    def list(self) -> builtins.list[Any]:
        return builtins.list(self._ask("list"))


def _reachable() -> None:
    """As Skyward's ``sky.dict()`` & co., the functions below raise at once where no pool's
    collections can be reached: outside a pool, and in a pool with
    ``Options(cluster=False)`` (a task's included): ClusterRequiredError, a RuntimeError.
    (A proxy pickled into a task is checked at its first operation.)"""
    _backend()


def dict(name: str, *, consistency: Consistency | None = None) -> Dict:
    """The pool's distributed dict ``name`` (created on first use)."""
    _reachable()
    return Dict(name, consistency=consistency)


def counter(name: str, *, consistency: Consistency | None = None) -> Counter:
    """The pool's distributed counter ``name`` (starts at 0)."""
    _reachable()
    return Counter(name, consistency=consistency)


def set(name: str, *, consistency: Consistency | None = None) -> Set:
    """The pool's distributed set ``name``."""
    _reachable()
    return Set(name, consistency=consistency)


def queue(name: str) -> Queue:
    """The pool's distributed queue ``name``."""
    _reachable()
    return Queue(name)


def count_parties(n: int | None, parties: int | None) -> int:
    """A barrier's parties, given as ``n`` or (Skyward's newer name) ``parties``."""
    if (n is None) == (parties is None):
        raise ConfigurationError("a barrier needs its number of parties: n or parties, once")
    return n if n is not None else parties  # type: ignore[return-value]


def barrier(name: str, n: int | None = None, *, parties: int | None = None) -> Barrier:
    """The pool's barrier ``name`` for ``n`` (or ``parties``) parties."""
    _reachable()
    return Barrier(name, count_parties(n, parties))


def lock(name: str, *, ttl: float | None = None, timeout: float | None = None) -> Lock:
    """The pool's distributed lock ``name`` (``ttl``: a lease; ``timeout``: the wait)."""
    _reachable()
    return Lock(name, ttl=ttl, timeout=timeout)


def registry(name: str) -> Registry:
    """The pool's registry ``name``."""
    _reachable()
    return Registry(name)
