"""Output control: ``@stdout(only=...)``, ``@stderr(only=...)`` and ``@silent``.

They silence the nodes that should not print, by redirecting ``sys.stdout``/``sys.stderr``
to a discarded buffer for the duration of the call, decided from ``instance_info()`` on the
node. They work written above or below ``@flotilla.function``.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from ._client.function import Function
from ._errors import ConfigurationError
from ._info import InstanceInfo, instance_info

F = TypeVar("F", bound=Callable[..., Any])
Only = Literal["head"] | Callable[[InstanceInfo], bool]


def _predicate(only: Only) -> Callable[[InstanceInfo], bool]:
    if only == "head":
        # node 0, also in standalone mode (no head there, but one node should speak)
        return lambda info: info.is_head or (not info.cluster and info.node == 0)
    if callable(only):
        return only
    raise ConfigurationError(
        f"only= must be 'head' or a predicate taking an InstanceInfo, got {only!r}"
    )


def _decorator(streams: tuple[str, ...], keep: Callable[[InstanceInfo], bool]) -> Callable[[F], F]:
    def wrap_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if keep(instance_info()):
                return fn(*args, **kwargs)
            with contextlib.ExitStack() as stack:
                sink = io.StringIO()
                if "stdout" in streams:
                    stack.enter_context(contextlib.redirect_stdout(sink))
                if "stderr" in streams:
                    stack.enter_context(contextlib.redirect_stderr(sink))
                return fn(*args, **kwargs)

        return wrapper

    def deco(target: F) -> F:
        if isinstance(target, Function):
            return target.with_fn(wrap_fn(target.fn))  # type: ignore[return-value]
        return wrap_fn(target)  # type: ignore[return-value]

    return deco


def stdout(only: Only = "head") -> Callable[[F], F]:
    """Keep stdout only on the nodes ``only`` selects: ``"head"`` (node 0, in standalone
    mode too) or ``lambda info: ...``."""
    return _decorator(("stdout",), _predicate(only))


def stderr(only: Only = "head") -> Callable[[F], F]:
    """Keep stderr only on the nodes ``only`` selects: ``"head"`` (node 0, in standalone
    mode too) or ``lambda info: ...``."""
    return _decorator(("stderr",), _predicate(only))


def silent(fn: F) -> F:
    """Discard both stdout and stderr of the function on every node."""
    return _decorator(("stdout", "stderr"), lambda info: False)(fn)
