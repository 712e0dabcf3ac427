"""Skyward's pool settings given to flotilla's: ``Compute(worker=, ttl=, allocation=)``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .._errors import ConfigurationError
from .._providers.base import Options, Provider
from .._worker import Worker


def worker_of(worker: object, options: Options, procs_per_node: int) -> Worker:
    """The pool's :class:`Worker`: ``Compute(worker=)``, else ``Options.worker``, else one."""
    if worker is not None and not isinstance(worker, Worker):
        raise ConfigurationError(
            f"worker must be a flotilla.Worker, e.g. Worker(concurrency=4), "
            f"got {type(worker).__name__}"
        )
    chosen = worker or options.worker or Worker()
    if chosen.concurrency > 1 and procs_per_node > 1:
        raise ConfigurationError(
            f"Worker(concurrency={chosen.concurrency}) cannot be combined with a plugin "
            f"that runs {procs_per_node} processes per node: use one or the other"
        )
    return chosen


ALLOCATIONS = ("spot", "on-demand", "spot-if-available")
"""Skyward's allocation strategies."""


def apply_skyward_settings(provider: Provider, ttl: object, allocation: object) -> Provider:
    """``provider``, or a copy with Skyward's ``Compute(ttl=, allocation=)`` given to its
    settings of the same meaning (see :class:`Compute`)."""
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 <= ttl < float("inf")
    ):
        raise ConfigurationError(f"ttl must be seconds >= 0 (0: none), got {ttl!r}")
    if allocation is not None and allocation not in ALLOCATIONS:
        raise ConfigurationError(
            f"allocation must be one of {', '.join(map(repr, ALLOCATIONS))}, got {allocation!r}"
        )
    settings = getattr(provider, "settings", None)
    if settings is None or not dataclasses.is_dataclass(settings) or provider.settings_type is None:
        return provider
    names = {f.name for f in dataclasses.fields(settings)}
    changes: dict[str, Any] = {}
    if allocation is not None and "allocation" in names:
        changes["allocation"] = allocation
    if ttl:
        if "ttl" in names:
            changes["ttl"] = float(ttl)
        elif "time" in names:  # SLURM: the job's time limit, in whole minutes
            changes["time"] = max(1, math.ceil(ttl / 60))
    if not changes:
        return provider
    return type(provider).from_settings(dataclasses.replace(settings, **changes))  # type: ignore[type-var]
