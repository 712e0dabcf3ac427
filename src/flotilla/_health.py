"""``HealthChecker``: Skyward's periodic health check of a pool's nodes.

The predicate runs on every node every ``interval`` seconds (at most ``timeout`` each):
``True`` is healthy; ``False`` or a non-empty string (the reason) is a failure, and so is
an exception (its text is the reason) or a timeout. A node serves calls only once its
check passed a first time (the pool's start waits for every node's, a replacement is
checked before it takes its rank's calls); after
``consecutive_failures`` failures in a row it is replaced (``Options.replace_lost_nodes``),
and the console and an event (``events.NodeHealthFailed``, then ``events.NodeLost``) say
why. The checks run as calls on the node's task slots (a node busy with a long call is
checked once a slot is free). The loop is ``_client/health.py``; what runs on the node,
``_node/health.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from ._errors import ConfigurationError, check_number

HealthCheckResult: TypeAlias = "bool | str"
HealthCheckFn: TypeAlias = "Callable[[Any], bool | str]"


@dataclass(frozen=True, slots=True)
class HealthChecker:
    """A periodic health check of every node (``Options(health_checker=...)``).

    Attributes:
        fn: the predicate, called on the node with its ``InstanceInfo``: ``True``, or
            ``False``/a reason (a string) for a failure; an exception or a timeout fails.
        interval: seconds between checks (default 30).
        timeout: seconds a check may take (default 15).
        consecutive_failures: failures in a row that replace the node (default 3).
        initial_delay: seconds after the node serves before its first check (default 0).
    """

    fn: Callable[[Any], bool | str]
    interval: float = 30.0
    timeout: float = 15.0
    consecutive_failures: int = 3
    initial_delay: float = 0.0

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigurationError(
                f"HealthChecker.fn must be a function of the node's InstanceInfo, got {self.fn!r}"
            )
        for name in ("interval", "timeout"):
            value = getattr(self, name)
            check_number(value, f"HealthChecker.{name} must be > 0, got {value!r}", above=0)
        n = self.consecutive_failures
        check_number(
            n, f"HealthChecker.consecutive_failures must be >= 1, got {n!r}", whole=True, at_least=1
        )
        d = self.initial_delay
        check_number(d, f"HealthChecker.initial_delay must be >= 0, got {d!r}", at_least=0)
