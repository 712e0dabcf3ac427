"""Skyward's pool settings given to flotilla's: ``Compute(worker=, ttl=, allocation=)``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

from .._errors import ConfigurationError, check_number
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
    check_number(
        ttl,
        f"ttl must be seconds >= 0 (0: none), got {ttl!r}",
        at_least=0,
        below=float("inf"),
        or_none=True,
    )
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
        assert isinstance(ttl, int | float)  # checked above
        if "ttl" in names:
            changes["ttl"] = float(ttl)
        elif "time" in names:  # SLURM: the job's time limit, in whole minutes
            changes["time"] = max(1, math.ceil(ttl / 60))
    if not changes:
        return provider
    return type(provider).from_settings(dataclasses.replace(settings, **changes))  # type: ignore[type-var]


def with_pool_settings(provider: Any, ttl: object, allocation: object) -> Provider:
    """The pool's provider from ``Compute(provider=, ttl=, allocation=)``: a list of
    providers becomes a fallback (``allocation`` ``"ordered"`` or ``"cheapest"``: the order
    it tries them in), and Skyward's ``ttl`` and market ``allocation`` go to each one's
    settings (:func:`apply_skyward_settings`)."""
    from .._providers.fallback import ALLOCATIONS as ORDERS
    from .._providers.fallback import as_provider

    if allocation is not None and allocation not in (*ALLOCATIONS, *ORDERS):
        raise ConfigurationError(
            f"allocation={allocation!r}: use one of {', '.join(map(repr, ALLOCATIONS))} "
            f"(the market) or, with a list of providers, {' or '.join(map(repr, ORDERS))}"
        )
    market = allocation if allocation in ALLOCATIONS else None
    order = str(allocation) if allocation in ORDERS else "ordered"
    if isinstance(provider, list | tuple):
        provider = [apply_skyward_settings(p, ttl, market) for p in provider]
        return cast(Provider, as_provider(provider, order))
    provider = as_provider(provider, order)
    if not isinstance(provider, Provider):
        raise ConfigurationError(
            "provider must be a flotilla provider such as flotilla.Local(), "
            f"got {type(provider).__name__}"
        )
    return apply_skyward_settings(provider, ttl, market)


NAMED = "provider nodes accelerator image vcpus memory_gb ttl allocation max_hourly_cost"
"""``Compute``'s arguments a named pool may give, in :func:`named_pool`'s order."""


def named_pool(name: str, given: dict[str, Any]) -> tuple[Any, ...]:
    """``Compute(name=...)``'s arguments (:data:`NAMED`, in order): Skyward's named pool
    (its `Compute.Named`), from the configuration files (``_providers.config_files``:
    ``pools: {NAME: ...}``), under the ones ``given``: an argument given wins; one not given
    (None, or ``nodes=1``, the default) takes the pool's. The pool's provider is made only
    when none is given."""
    from .._providers.config_files import load

    if not isinstance(name, str) or not name.strip():
        raise ConfigurationError(f"Compute(name=...) names a pool: a string, got {name!r}")
    pool = load().pool(name)
    out = dict(given)
    for key, value in pool.arguments.items():
        if key == "image":
            value = pool.image()
        elif key == "nodes" and isinstance(value, tuple | list):
            value = tuple(value)
        if out.get(key) is None or (key == "nodes" and out[key] == 1):
            out[key] = value
    if out.get("provider") is None:
        out["provider"] = pool.make_provider()
    return tuple(out.get(key) for key in NAMED.split())
