"""Fallback across providers: a pool that tries several places in turn.

``Compute(provider=[VastAI(), AWS(region="us-east-1"), Slurm(...)])`` makes a
:class:`Fallback` of them. It tries the candidates in order (``allocation="ordered"``), or
cheapest first (``allocation="cheapest"``: by each candidate's offers, see
:meth:`Provider.offers`; candidates that cannot tell their price come last, in order).
A candidate that refuses the request (a ConfigurationError from ``validate``) or cannot
provide it (a ProvisionError: no offer, no capacity, above ``max_hourly_cost``, nodes that
do not start) is skipped, and the console says which one failed and why; the first that
starts the pool is used, and the console says which it is and its price. Everything a
failed candidate got was released by that candidate before the next one is tried.

An elastic pool (``nodes=(desired, max)``) over a list is on one candidate at a time: it
opens on the first that acquires (:meth:`Fallback.acquire`, nothing billed yet), and its
nodes all come from that candidate (one network, one home for the nodes' files, one bill).
When the candidate has no node to give while the pool has none (born empty, scaled to zero,
or at open), the pool moves to the next candidate of the list (:meth:`Fallback.acquire_next`,
after the last back to the first) and releases the one it left; a pool that has nodes stays
where it is at its size and asks its candidate again with backoff.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import ConfigurationError, ProvisionCause, ProvisionError
from .base import AgentProcess, Allocation, PoolSpec, Provider
from .offers import Offer, describe_cost

if TYPE_CHECKING:
    from .._accelerators import Accelerator

ALLOCATIONS = ("ordered", "cheapest")
SELECTIONS = {"first": "ordered", "cheapest": "cheapest"}
"""Skyward's ``SelectionStrategy`` (``Compute(*specs, selection=)``) -> the order of a
:class:`Fallback`: ``"first"``, the first spec that starts the pool; ``"cheapest"``,
cheapest first by each spec's offers."""


@dataclass(frozen=True)
class Spec:
    """Skyward's ``Spec``: one provider and what to ask it for, one candidate of a pool
    (``Compute(Spec(VastAI(), "A100"), Spec(RunPod(), "A100"), selection="cheapest")``).
    Fields left None are the pool's (``Compute``'s).

    Attributes:
        provider: the provider.
        accelerator: accelerators per node ("A100:8", ``accelerators.A100(8)``).
        nodes: the pool's size with this spec (specs that set it must agree).
        vcpus: CPUs per node.
        memory_gb: memory per node in GiB.
        disk_gb: disk per node in GB: the provider's disk setting (Vast, RunPod,
            Lambda... ``disk_gb``; AWS's root volume), through the task-file mapping of
            ``disk_size``.
        architecture: ``"x86_64"`` or ``"arm64"``: the provider's ``architecture``
            setting (a ConfigurationError for a provider without one).
        allocation: ``"spot"``, ``"on-demand"`` or ``"spot-if-available"``: the
            provider's market setting, as ``Compute(allocation=)``.
        region: the provider's region (its setting a task file's ``region`` gives:
            AWS ``region``, Vast ``regions``, RunPod ``data_centers``, Lambda ``region``).
        max_hourly_cost: the most ONE NODE may cost per hour, in USD, as Skyward's Spec
            documents it (``Compute(max_hourly_cost=)`` caps the whole pool:
            ``Compute(max_node_hourly_cost=)`` is this for every candidate).
        ttl: Skyward's ``ttl`` for this provider (as ``Compute(ttl=)``).
    """

    provider: Provider
    accelerator: str | Accelerator | None = None
    nodes: int | None = None
    vcpus: float | None = None
    memory_gb: float | None = None
    disk_gb: float | None = None
    architecture: str | None = None
    allocation: str | None = None
    region: str | None = None
    max_hourly_cost: float | None = None
    ttl: float | None = None

    def __post_init__(self) -> None:
        from .._errors import check_number

        if not isinstance(self.provider, Provider):
            raise ConfigurationError(
                f"Spec(provider=...) must be a flotilla provider such as VastAI(), got "
                f"{type(self.provider).__name__}"
            )
        for name in ("vcpus", "memory_gb", "disk_gb", "max_hourly_cost"):
            value = getattr(self, name)
            check_number(value, f"Spec({name}={value!r}): a positive number", above=0, or_none=True)
        if self.nodes is not None and (not isinstance(self.nodes, int) or self.nodes < 1):
            raise ConfigurationError(f"Spec(nodes={self.nodes!r}): a whole number >= 1")
        if self.architecture not in (None, "x86_64", "arm64"):
            raise ConfigurationError(
                f"Spec(architecture={self.architecture!r}): 'x86_64' or 'arm64'"
            )


class Fallback(Provider):
    """Several providers for one pool, tried in turn (see the module docstring).

    Attributes:
        candidates: the providers, in the order given.
        allocation: ``"ordered"`` or ``"cheapest"``.
        chosen: the candidate that started the pool (None before).
        failures: (candidate, why) for every candidate that failed, in order.
    """

    name = "fallback"

    def __init__(self, candidates: Sequence[Provider], allocation: str = "ordered") -> None:
        if allocation not in ALLOCATIONS:
            raise ConfigurationError(
                f"allocation={allocation!r}: use {' or '.join(map(repr, ALLOCATIONS))}"
            )
        if not candidates:
            raise ConfigurationError("provider=[]: give at least one provider")
        for c in candidates:
            if not isinstance(c, Provider):
                raise ConfigurationError(
                    f"provider=[...]: every candidate must be a flotilla provider, got "
                    f"{type(c).__name__}"
                )
        self.candidates = list(candidates)
        self.allocation = allocation
        first = self.candidates[0]
        self.home = first.home
        self.shares_filesystem = all(c.shares_filesystem for c in self.candidates)
        self.python_pinned = first.python_pinned
        self.elastic = all(c.elastic for c in self.candidates)
        self.chosen: Provider | None = None
        self._order: list[Provider] = []  # an elastic pool's candidates, in turn
        self.failures: list[tuple[Provider, str]] = []
        self._valid: list[Provider] = []
        self.report: Callable[[str], None] = _show
        """Where the candidates' failures and the choice are told (default: stderr)."""

    def __repr__(self) -> str:
        return f"Fallback({self.candidates!r}, allocation={self.allocation!r})"

    @property
    def chosen_index(self) -> int | None:
        """The position in :attr:`candidates` of the one that started the pool (None
        before)."""
        for i, c in enumerate(self.candidates):
            if c is self.chosen:
                return i
        return None

    def next_after(self, index: int) -> None:
        """Try the candidate after ``index`` first, and ``index`` last (a managed job's
        recovery, SkyPilot's EAGER_NEXT_REGION: where the job was lost is short of
        machines); in order from there."""
        n = len(self.candidates)
        start = (index + 1) % n
        self.candidates = self.candidates[start:] + self.candidates[:start]
        self.allocation = "ordered"

    def validate(self, spec: PoolSpec) -> None:
        """Keep the candidates that accept the request; a ConfigurationError listing every
        refusal when none does."""
        self._valid, refused = [], []
        for c in self.candidates:
            try:
                c.validate(spec)
            except ConfigurationError as e:
                refused.append(f"{c!r}: {e}")
                self.failures.append((c, str(e)))
                self.report(f"candidate {c!r} refused the request: {e}")
                continue
            self._valid.append(c)
        if not self._valid:
            raise ConfigurationError("no provider accepts the request:\n  " + "\n  ".join(refused))

    def offers(self, spec: PoolSpec) -> list[Offer] | None:
        found: list[Offer] = []
        known = False
        for c in self.candidates:
            try:
                mine = c.offers(spec)
            except Exception:
                continue
            if mine is not None:
                known = True
                found.extend(mine)
        return sorted(found, key=_price) if known else None

    def order(self, spec: PoolSpec) -> list[tuple[Provider, float | None]]:
        """The candidates to try, in turn, each with the cheapest price it offers for the
        pool per hour (None: unknown)."""
        ranked = []
        for index, c in enumerate(self._valid or self.candidates):
            cost: float | None = None
            mine = c.spec(spec) if isinstance(c, Candidate) else spec
            if self.allocation == "cheapest" or spec.max_hourly_cost is not None:
                try:
                    offers = c.offers(spec)
                except Exception:
                    offers = None
                cap = mine.max_node_hourly_cost
                prices = [
                    o.pool_cost(spec.nodes)
                    for o in offers or []
                    if cap is None or o.hourly is None or o.hourly <= cap
                ]
                known = [p for p in prices if p is not None]
                cost = min(known) if known else None
            ranked.append((index, c, cost))
        if self.allocation == "cheapest":
            ranked.sort(key=lambda r: (r[2] is None, r[2] or 0.0, r[0]))
        return [(c, cost) for _, c, cost in ranked]

    async def start(self, spec: PoolSpec) -> tuple[Allocation, list[AgentProcess]]:
        loop = asyncio.get_running_loop()
        order = await loop.run_in_executor(None, self.order, spec)
        tried: list[str] = []
        for c, cost in order:
            try:
                allocation, agents = await c.start(spec)
            except (ProvisionError, ConfigurationError) as e:
                tried.append(self._failed(c, e))
                continue
            self._choose(c)
            hourly = getattr(allocation, "hourly", None)
            price = hourly if isinstance(hourly, int | float) and hourly else cost
            self.report(f"chose {c!r} for {spec.nodes} node(s), {describe_cost(price)}")
            return allocation, agents
        raise _none_started(tried)

    def _failed(self, c: Provider, e: Exception) -> str:
        """Record that candidate ``c`` could not start (``e``); its line for the error."""
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        self.failures.append((c, why))
        self.report(f"candidate {c!r} failed: {why}")
        return f"{c!r}: {why}"

    def _choose(self, c: Provider) -> None:
        self.chosen = c
        self.home = c.home
        self.python_pinned = c.python_pinned

    async def acquire(self, spec: PoolSpec) -> Allocation:
        """An elastic pool's allocation (``spec.nodes`` is 0: no node yet) from the first
        candidate that acquires one, in :meth:`order`; ProvisionError when none does."""
        loop = asyncio.get_running_loop()
        self._order = [c for c, _ in await loop.run_in_executor(None, self.order, spec)]
        return await self._acquire(self._order, spec)

    async def acquire_next(self, spec: PoolSpec) -> Allocation | None:
        """An elastic pool's allocation from the candidates after the chosen one, in turn
        (after the last back to the first; see the module docstring); None when no other
        acquires one (the pool stays on its candidate)."""
        at = next((i for i, c in enumerate(self._order) if c is self.chosen), 0)
        rest = self._order[at + 1 :] + self._order[:at]
        if not rest:
            return None
        try:
            return await self._acquire(rest, spec)
        except ProvisionError:
            return None

    async def _acquire(self, order: list[Provider], spec: PoolSpec) -> Allocation:
        tried: list[str] = []
        for c in order:
            try:
                allocation = await c.acquire(spec)
            except (ProvisionError, ConfigurationError) as e:
                tried.append(self._failed(c, e))
                continue
            self._choose(c)
            self.report(f"chose {c!r} for an elastic pool of up to {spec.max_nodes} node(s)")
            return allocation
        raise _none_started(tried)


def _none_started(tried: list[str]) -> ProvisionError:
    return ProvisionError(
        "no provider could start the pool:\n  " + "\n  ".join(tried),
        cause=ProvisionCause.CAPACITY,
    )


class Candidate(Provider):
    """A provider with its own per-node resources, as one candidate of a fallback list
    (Skyward's ``Spec``): ``Candidate(VastAI(), accelerator="H100:8")`` asks Vast for H100s
    whatever the pool's ``accelerator`` says. Fields left None are the pool's.

    Attributes:
        provider: the provider.
        accelerator: accelerators per node ("A100:8"), or None for the pool's.
        vcpus: CPUs per node, or None for the pool's.
        memory_gb: memory per node in GiB, or None for the pool's.
        max_node_hourly_cost: the most one node may cost per hour (USD), or None for the
            pool's.
    """

    def __init__(
        self,
        provider: Provider,
        accelerator: str | Accelerator | None = None,
        vcpus: float | None = None,
        memory_gb: float | None = None,
        max_node_hourly_cost: float | None = None,
    ) -> None:
        from .._accelerators import parse_accelerator

        if not isinstance(provider, Provider):
            raise ConfigurationError(
                "Candidate(provider=...) must be a flotilla provider, got "
                f"{type(provider).__name__}"
            )
        self.provider = provider
        self.accelerator = parse_accelerator(accelerator)
        self.vcpus = vcpus
        self.memory_gb = memory_gb
        self.max_node_hourly_cost = max_node_hourly_cost
        self.name = provider.name
        self.home = provider.home
        self.shares_filesystem = provider.shares_filesystem
        self.python_pinned = provider.python_pinned
        self.elastic = provider.elastic

    def __repr__(self) -> str:
        wants = [
            f"{k}={v}"
            for k, v in (
                ("accelerator", self.accelerator),
                ("vcpus", self.vcpus),
                ("memory_gb", self.memory_gb),
                ("max_node_hourly_cost", self.max_node_hourly_cost),
            )
            if v is not None
        ]
        return f"{self.provider!r}" + (f" [{', '.join(wants)}]" if wants else "")

    def spec(self, spec: PoolSpec) -> PoolSpec:
        """``spec`` with this candidate's resources."""
        return dataclasses.replace(
            spec,
            accelerator=self.accelerator or spec.accelerator,
            vcpus=self.vcpus if self.vcpus is not None else spec.vcpus,
            memory_gb=self.memory_gb if self.memory_gb is not None else spec.memory_gb,
            max_node_hourly_cost=self.max_node_hourly_cost
            if self.max_node_hourly_cost is not None
            else spec.max_node_hourly_cost,
        )

    @property
    def settings(self) -> Any:
        return getattr(self.provider, "settings", None)

    def validate(self, spec: PoolSpec) -> None:
        self.provider.validate(self.spec(spec))

    def offers(self, spec: PoolSpec) -> list[Offer] | None:
        return self.provider.offers(self.spec(spec))

    async def start(self, spec: PoolSpec) -> tuple[Allocation, list[AgentProcess]]:
        return await self.provider.start(self.spec(spec))

    async def acquire(self, spec: PoolSpec) -> Allocation:
        return await self.provider.acquire(self.spec(spec))


def _price(offer: Offer) -> tuple[bool, float]:
    return (offer.hourly is None, offer.hourly or 0.0)


def _show(message: str) -> None:
    print(f"flotilla: {message}", file=sys.stderr, flush=True)


def as_provider(provider: Any, allocation: str) -> Any:
    """``provider`` as one provider: a list or tuple becomes a :class:`Fallback`."""
    if isinstance(provider, list | tuple):
        return Fallback(provider, allocation)
    if allocation not in ALLOCATIONS:
        raise ConfigurationError(
            f"allocation={allocation!r}: use {' or '.join(map(repr, ALLOCATIONS))}"
        )
    return provider
