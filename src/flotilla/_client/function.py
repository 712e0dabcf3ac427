"""Lazy functions: ``@function``, :class:`PendingCall`, :class:`CallGroup` and :func:`gather`.

Calling a decorated function runs nothing: it returns a :class:`PendingCall`, which an
operator sends to a pool::

    call >> pool    run on one node (the least busy); returns the value
    call @ pool     run on every node; returns a list ordered by node rank
    call > pool     run on one node in the background; returns a concurrent.futures.Future
    a & b & c       a CallGroup: run different calls in parallel (``>> pool`` -> tuple)
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar, overload

from .._errors import ConfigurationError, check_number
from .._info import in_task

P = ParamSpec("P")
R = TypeVar("R")


class Pool(ABC):
    """What the call operators (``>>``, ``@``, ``>``) send calls to: a running pool
    (``Compute`` is the one kind)."""

    @abstractmethod
    def run(self, call: PendingCall[R]) -> R:
        """Run ``call`` on one node; its value."""

    @abstractmethod
    def broadcast(self, call: PendingCall[R]) -> list[R]:
        """Run ``call`` on every node; results in node-rank order."""

    @abstractmethod
    def submit(self, call: PendingCall[R]) -> Future[R]:
        """Run ``call`` on one node; a Future."""

    @abstractmethod
    def run_many(self, calls: Sequence[PendingCall[Any]]) -> list[Any]:
        """Run ``calls`` in parallel; results in call order."""

    @abstractmethod
    def submit_group(self, calls: Sequence[PendingCall[Any]]) -> Future[tuple[Any, ...]]:
        """Run ``calls`` in parallel; a Future of their results' tuple."""

    @abstractmethod
    def stream(self, calls: Sequence[PendingCall[Any]], ordered: bool = True) -> Iterator[Any]:
        """Results of ``calls`` as they finish."""


def _not_a_pool(op: str, other: object) -> ConfigurationError:
    return ConfigurationError(
        f"the right side of `{op}` must be a running flotilla pool (the value of "
        f"`with flotilla.Compute(...) as pool`), not {type(other).__name__}"
    )


_pool_types: set[type] = set()
"""The pool classes seen (an ABC's ``isinstance`` is slower than a set: per call)."""


def _check_pool(op: str, pool: object) -> Pool:
    if type(pool) in _pool_types:
        return pool  # type: ignore[return-value]
    if not isinstance(pool, Pool):
        raise _not_a_pool(op, pool)
    _pool_types.add(type(pool))
    return pool


class Function(Generic[P, R]):
    """A function that runs on a pool. Create it with :func:`function`.

    Attributes:
        fn: the wrapped Python function.
        timeout: seconds a call may run on a node before it is stopped (None: no limit).
        retries: how many times a call is re-run when its node or process dies under it,
            or when it raises one of ``retry_on``.
        retry_on: exception types that make a call run again (up to ``retries`` times);
            empty: exceptions the function raises are never retried.
    """

    __slots__ = ("__dict__", "fn", "retries", "retry_on", "timeout")

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        timeout: float | None = None,
        retries: int = 0,
        retry_on: type[BaseException] | Iterable[type[BaseException]] = (),
    ) -> None:
        if timeout is not None and not timeout > 0:
            raise ConfigurationError(
                f"timeout must be a positive number of seconds, got {timeout!r}"
            )
        check_number(
            retries,
            f"retries must be a non-negative integer, got {retries!r}",
            whole=True,
            at_least=0,
        )
        self.fn = fn
        self.timeout = timeout
        self.retries = retries
        self.retry_on = _exception_types(retry_on, retries)
        functools.update_wrapper(self, fn)

    @property
    def name(self) -> str:
        name = getattr(self.fn, "__qualname__", None)
        return name if isinstance(name, str) else repr(self.fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> PendingCall[R]:
        """Bind arguments; nothing runs until the call is sent to a pool.

        Inside a task running on a node, calling a flotilla function runs it right there and
        returns its value (a helper called by the task), unless the task opened a pool of
        its own: then the call is bound, to be sent to that pool."""
        if in_task() and not _open_pools:
            return self.fn(*args, **kwargs)  # type: ignore[return-value]
        return PendingCall(self, args, kwargs)

    def local(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the function here, in this process (``instance_info()`` is single-node)."""
        return self.fn(*args, **kwargs)

    def with_fn(self, fn: Callable[P, R]) -> Function[P, R]:
        """The same options around another callable (used by the output decorators)."""
        return Function(fn, timeout=self.timeout, retries=self.retries, retry_on=self.retry_on)

    def _misuse(self, op: str) -> ConfigurationError:
        return ConfigurationError(
            f"`{self.name}` was not called: write `{self.name}(...) {op} pool` "
            f"(a flotilla function must be called to bind its arguments first)"
        )

    def __rshift__(self, pool: object) -> Any:
        raise self._misuse(">>")

    def __matmul__(self, pool: object) -> Any:
        raise self._misuse("@")

    def __gt__(self, pool: object) -> Any:
        raise self._misuse(">")

    def __and__(self, other: object) -> Any:
        raise self._misuse("&")

    def __repr__(self) -> str:
        return f"<flotilla.function {self.name}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # By reference when the module attribute is this object (plain pickle cannot pickle
        # the wrapped function itself: its name leads to this wrapper); by value otherwise.
        module = getattr(self.fn, "__module__", None)
        qualname = getattr(self.fn, "__qualname__", "")
        if module and module != "__main__" and "<" not in qualname:
            try:
                if _resolve(module, qualname) is self:
                    return _resolve, (module, qualname)
            except (ImportError, AttributeError):
                pass
        return _rebuild, (self.fn, self.timeout, self.retries, self.retry_on)


_open_pools = 0
"""Pools open in this process (see ``Function.__call__``); ``Compute`` counts them."""


def count_open_pools(delta: int) -> None:
    """A pool of this process opened (+1) or closed (-1)."""
    global _open_pools
    _open_pools += delta


def _exception_types(
    given: type[BaseException] | Iterable[type[BaseException]], retries: int
) -> tuple[type[BaseException], ...]:
    """``retry_on`` as a tuple of exception classes (checked: an error says what was wrong)."""
    types = (given,) if isinstance(given, type) else tuple(given)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise ConfigurationError(
                f"retry_on takes exception classes, e.g. retry_on=(ConnectionError,), got {t!r}"
            )
    if types and retries < 1:
        raise ConfigurationError(
            "retry_on needs retries=N (how many times a call may run again), "
            "e.g. @flotilla.function(retries=3, retry_on=(ConnectionError,))"
        )
    return types


def _resolve(module: str, qualname: str) -> Any:
    import importlib

    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rebuild(
    fn: Callable[..., Any],
    timeout: float | None,
    retries: int,
    retry_on: tuple[type[BaseException], ...] = (),
) -> Function[..., Any]:
    return Function(fn, timeout=timeout, retries=retries, retry_on=retry_on)


@overload
def function(fn: Callable[P, R], /) -> Function[P, R]: ...
@overload
def function(
    *,
    timeout: float | None = None,
    retries: int = 0,
    retry_on: type[BaseException] | Iterable[type[BaseException]] = (),
) -> Callable[[Callable[P, R]], Function[P, R]]: ...


def function(
    fn: Callable[P, R] | None = None,
    /,
    *,
    timeout: float | None = None,
    retries: int = 0,
    retry_on: type[BaseException] | Iterable[type[BaseException]] = (),
) -> Function[P, R] | Callable[[Callable[P, R]], Function[P, R]]:
    """Make ``fn`` runnable on a pool: ``@flotilla.function`` or ``@flotilla.function(timeout=60)``.

    ``timeout`` (seconds) stops a call that runs longer on its node; the node's process is
    replaced and stays usable. ``retries`` re-runs a call whose node or process died under it
    (crash, OOM kill), and one that raised an exception of a type in ``retry_on``
    (``retries=3, retry_on=(ConnectionError,)``); other exceptions raised by the function
    are never retried: they reach the caller at once.
    """
    options: dict[str, Any] = {"timeout": timeout, "retries": retries, "retry_on": retry_on}
    if fn is None:
        Function(lambda: None, **options)  # bad options: an error at the decorator's line
        return lambda f: Function(f, **options)
    if isinstance(fn, Function):
        return fn
    if not callable(fn):
        raise ConfigurationError(f"@flotilla.function needs a callable, got {type(fn).__name__}")
    return Function(fn, **options)


@dataclass(frozen=True, slots=True)
class PendingCall(Generic[R]):
    """A function bound to its arguments, not yet run. Picklable.

    Attributes:
        function: the :class:`Function` to run.
        args: positional arguments.
        kwargs: keyword arguments.
    """

    function: Function[..., R]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def local(self) -> R:
        """Run the call here, in this process."""
        return self.function.fn(*self.args, **self.kwargs)

    def __rshift__(self, pool: object) -> R:
        return _check_pool(">>", pool).run(self)

    def __matmul__(self, pool: object) -> list[R]:
        return _check_pool("@", pool).broadcast(self)

    def __gt__(self, pool: object) -> Future[R]:
        return _check_pool(">", pool).submit(self)

    def __and__(self, other: object) -> CallGroup:
        return CallGroup((self,)) & other

    def __repr__(self) -> str:
        return f"<flotilla pending call {self.function.name}(...)>"


@dataclass(frozen=True, slots=True)
class CallGroup:
    """Several calls that run in parallel; built with ``&`` or :func:`gather`.

    ``group >> pool`` returns a tuple of results in call order; with ``stream=True`` it
    returns an iterator that yields results as they finish (in call order when
    ``ordered``, else in completion order).
    """

    calls: tuple[PendingCall[Any], ...]
    stream: bool = False
    ordered: bool = True

    def __and__(self, other: object) -> CallGroup:
        if isinstance(other, PendingCall):
            return CallGroup((*self.calls, other), self.stream, self.ordered)
        if isinstance(other, CallGroup):
            return CallGroup((*self.calls, *other.calls), self.stream, self.ordered)
        raise _not_a_call("&", other)

    def __rshift__(self, pool: object) -> Any:
        p = _check_pool(">>", pool)
        if self.stream:
            return p.stream(self.calls, ordered=self.ordered)
        return tuple(p.run_many(self.calls))

    def __gt__(self, pool: object) -> Future[tuple[Any, ...]]:
        return _check_pool(">", pool).submit_group(self.calls)

    def __matmul__(self, pool: object) -> tuple[list[Any], ...]:
        p = _check_pool("@", pool)
        return tuple(p.broadcast(c) for c in self.calls)

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[PendingCall[Any]]:
        return iter(self.calls)


def _not_a_call(op: str, other: object) -> ConfigurationError:
    hint = ""
    if callable(other) and not isinstance(other, Function):
        hint = " (decorate the function with @flotilla.function and call it)"
    elif isinstance(other, Function):
        hint = f" (call it: {other.name}(...))"
    return ConfigurationError(f"`{op}` combines pending calls, got {type(other).__name__}{hint}")


def as_call(obj: object, op: str) -> PendingCall[Any]:
    """``obj`` as a PendingCall, or a TypeError with a hint."""
    if isinstance(obj, PendingCall):
        return obj
    raise _not_a_call(op, obj)


def gather(*calls: PendingCall[Any], stream: bool = False, ordered: bool = True) -> CallGroup:
    """Group calls to run in parallel: ``gather(a, b, c) >> pool`` returns a tuple.

    With ``stream=True``, ``>> pool`` returns an iterator yielding results as they finish;
    ``ordered=False`` yields them in completion order instead of call order.
    """
    return CallGroup(tuple(as_call(c, "gather") for c in calls), stream, ordered)
