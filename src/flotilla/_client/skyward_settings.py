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


PLACEMENT = {"region": "region", "disk_gb": "disk_size"}
"""Skyward's placement arguments -> the task-file ``resources`` field whose mapping
(``options.From``) says which setting of a provider takes it (AWS ``region``, Vast
``regions``, RunPod ``data_centers``; every cloud's ``disk_gb``)."""


def apply_placement(
    provider: Provider,
    region: str | None = None,
    disk_gb: float | None = None,
    architecture: str | None = None,
) -> Provider:
    """``provider``, or a copy with Skyward's ``region``, ``disk_gb`` and ``architecture``
    given to its settings of that meaning (a list of providers: each one); a
    ConfigurationError naming the provider when it has no such setting (nothing would
    honour it)."""
    from .._providers.fallback import Candidate, Fallback
    from .._providers.options import task_values

    if region is None and disk_gb is None and architecture is None:
        return provider
    if isinstance(provider, Fallback):
        provider.candidates = [
            apply_placement(c, region, disk_gb, architecture) for c in provider.candidates
        ]
        return provider
    if isinstance(provider, Candidate):
        provider.provider = apply_placement(provider.provider, region, disk_gb, architecture)
        return provider
    check_number(disk_gb, f"disk_gb={disk_gb!r}: a positive number of GB", above=0, or_none=True)
    settings = getattr(provider, "settings", None)
    if settings is None or not dataclasses.is_dataclass(settings) or provider.settings_type is None:
        raise ConfigurationError(
            f"{provider!r} has no settings for region=, disk_gb= or architecture=: leave "
            "them out for it"
        )
    given = {"region": region, "disk_size": disk_gb}
    resources = {PLACEMENT[k]: v for k, v in (("region", region), ("disk_gb", disk_gb)) if v}
    changes = task_values(type(settings), None, resources)
    for name, value in given.items():
        fields_of = _fields_from(type(settings), name)
        if value is not None and not fields_of:
            arg = "region" if name == "region" else "disk_gb"
            raise ConfigurationError(f"{provider!r} has no {arg} setting: leave {arg}= out for it")
    changes = {k: v for k, v in changes.items() if k in _fields_from(type(settings), *resources)}
    if architecture is not None:
        names = {f.name for f in dataclasses.fields(settings)}
        if "architecture" not in names:
            raise ConfigurationError(
                f"{provider!r} has no choice of architecture: leave architecture= out for it"
            )
        changes["architecture"] = architecture
    return type(provider).from_settings(dataclasses.replace(settings, **changes))  # type: ignore[type-var]


def _fields_from(settings_type: Any, *sources: str) -> set[str]:
    """The settings fields a task file's ``resources`` ``sources`` give."""
    from .._providers.options import META

    out = set()
    for f in dataclasses.fields(settings_type):
        meta = f.metadata.get(META)
        task = getattr(meta, "task", None)
        if task is not None and any(s in task.sources for s in sources):
            out.add(f.name)
    return out


def candidates_of(
    specs: tuple[Any, ...], ttl: object, allocation: object
) -> tuple[list[Provider], int | None]:
    """Skyward's ``Compute(*specs)``: each :class:`Spec` as a candidate provider with its
    settings (``region``, ``disk_gb``, ``architecture``, ``allocation``, ``ttl``) and its
    per-node resources; and the pool's size the specs set (None: none does)."""
    from .._providers.fallback import Candidate, Spec

    out: list[Provider] = []
    sizes = {s.nodes for s in specs if isinstance(s, Spec) and s.nodes is not None}
    if len(sizes) > 1:
        raise ConfigurationError(
            f"the specs ask for different pool sizes ({', '.join(map(str, sorted(sizes)))} "
            "nodes): a pool has one size; give the same nodes= to every Spec"
        )
    for s in specs:
        if not isinstance(s, Spec):
            raise ConfigurationError(
                f"Compute(*specs): every positional argument after the first must be a "
                f"flotilla.Spec, got {type(s).__name__}"
            )
        provider = apply_skyward_settings(
            s.provider,
            s.ttl if s.ttl is not None else ttl,
            s.allocation if s.allocation is not None else _market(allocation),
        )
        provider = apply_placement(provider, s.region, s.disk_gb, s.architecture)
        out.append(Candidate(provider, s.accelerator, s.vcpus, s.memory_gb, s.max_hourly_cost))
    return out, (sizes.pop() if sizes else None)


def _market(allocation: object) -> object:
    return allocation if allocation in ALLOCATIONS else None


def pool_provider(
    provider: Any,
    specs: tuple[Any, ...],
    ttl: object,
    allocation: object,
    selection: object,
    placement: tuple[Any, Any, Any] = (None, None, None),
) -> tuple[Provider, int | None]:
    """``Compute``'s provider and the pool size its specs set (None: none does): from its
    first argument (None: ``Local()``) and further :class:`Spec` s (one spec: its
    candidate; several: a fallback in ``selection``'s order; a list of providers ordered
    by ``selection`` when given), with Skyward's ``ttl`` and ``allocation``
    (:func:`with_pool_settings`) and ``placement``, ``(region, disk_gb, architecture)``
    (:func:`apply_placement`)."""
    from .._providers.fallback import SELECTIONS, Fallback, Spec

    if selection is not None and selection not in SELECTIONS:
        raise ConfigurationError(
            f"selection={selection!r}: use {' or '.join(map(repr, SELECTIONS))}"
        )
    nodes = None
    if specs or isinstance(provider, Spec):
        given = (provider, *specs) if provider is not None else specs
        candidates, nodes = candidates_of(tuple(given), ttl, allocation)
        order = SELECTIONS[str(selection or "cheapest")]
        provider = candidates[0] if len(candidates) == 1 else Fallback(candidates, order)
    elif selection is not None and isinstance(provider, list | tuple):
        provider = Fallback(list(provider), SELECTIONS[str(selection)])
    elif provider is None:
        from .._providers.local import Local

        provider = Local()
    provider = with_pool_settings(provider, ttl, allocation)
    return apply_placement(provider, *placement), nodes


NAMED = "provider nodes accelerator image vcpus memory_gb ttl allocation max_hourly_cost"
"""``Compute``'s arguments a named pool may give, in :func:`named_pool`'s order."""


def named_pool(name: str, given: dict[str, Any]) -> tuple[Any, ...]:
    """``Compute(name=...)``'s arguments (:data:`NAMED`, in order): Skyward's named pool
    (its `Compute.Named`), from the configuration files (``_providers.config_files``:
    ``pools: {NAME: ...}``), under the ones ``given``: an argument given wins; one not given
    (None) takes the pool's. The pool's provider is made only
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
        if out.get(key) is None:
            out[key] = value
    if out.get("provider") is None:
        out["provider"] = pool.make_provider()
    return tuple(out.get(key) for key in NAMED.split())
