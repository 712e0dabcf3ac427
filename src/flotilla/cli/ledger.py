"""The resource-aware queue of a cluster: what each node has (GPUs, vCPUs, memory) and what
the jobs running on it hold (:class:`Ledger`). Light on imports: ``flotilla exec`` checks
a job against it before sending it to the daemon.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .jobspec import JobSpec
    from .state import NodeRecord


@dataclass(frozen=True)
class Demand:
    """What a job holds on each of its nodes while it runs (its task's ``resources``).

    Attributes:
        gpus: accelerators per node; a fraction below 1 shares one device (``A100:0.5``).
        cpus: vCPUs per node (``cpus: 4`` or ``4+``: 4).
        memory: memory per node in GB.

    A job that declares none of them holds its nodes whole: it runs alone on them, as
    every job did before the queue knew resources.
    """

    gpus: float = 0.0
    cpus: float = 0.0
    memory: float = 0.0

    @property
    def whole(self) -> bool:
        return not (self.gpus or self.cpus or self.memory)

    def describe(self, accelerator: str = "") -> str:
        """``A100:0.5 cpus=2 mem=4GB`` (``whole`` when nothing is declared)."""
        if self.whole:
            return "whole"
        parts = []
        if self.gpus:
            parts.append(f"{accelerator or 'gpus'}:{self.gpus:g}")
        if self.cpus:
            parts.append(f"cpus={self.cpus:g}")
        if self.memory:
            parts.append(f"mem={self.memory:g}GB")
        return " ".join(parts)


JOBS_PER_NODE = 4
"""Jobs a node runs at once at most, whatever room they leave (each takes one of the
node's task slots; one more slot serves syncs, ports and reaping)."""


def demand_of(spec: JobSpec, candidate: int | None = None) -> Demand:
    """What a job asks of each of its nodes on a cluster started on its candidate at
    position ``candidate`` (a task with ``any_of``/``ordered``: that candidate's
    accelerators, as ``JobSpec.gpus_on``; None: the task's own)."""
    if spec.candidate_gpus and candidate is not None:
        gpus = float(spec.gpus_on(candidate))
    else:
        gpus = spec.gpu_share or float(spec.gpus_per_node)
    return Demand(gpus, spec.cpus, spec.memory)


@dataclass(frozen=True)
class Allocation:
    """Where a job runs: its nodes in rank order, and the devices each lends it."""

    nodes: list[int]
    devices: dict[int, list[int]]
    demand: Demand


class _NodeRoom:
    """One node's size (0 vCPUs or memory: unknown, not counted) and what jobs hold."""

    def __init__(self, node: NodeRecord) -> None:
        self.size = node
        self.cpus = 0.0  # held by running jobs
        self.memory = 0.0
        self.devices = [1.0] * node.gpus  # what is free of each device
        self.jobs = 0
        self.whole = False

    def devices_for(self, gpus: float) -> list[int] | None:
        """The devices a job needing ``gpus`` of them would get here (None: no room).
        A fraction goes where it fits most tightly; whole devices must be wholly free."""
        if gpus <= 0:
            return []
        if gpus < 1:
            fits = [(free, i) for i, free in enumerate(self.devices) if free >= gpus - 1e-9]
            return [min(fits)[1]] if fits else None
        free = [i for i, f in enumerate(self.devices) if f >= 1 - 1e-9]
        want = math.ceil(gpus - 1e-9)
        return free[:want] if len(free) >= want else None

    def held(self, d: Demand) -> tuple[float, float]:
        """The vCPUs and memory ``d`` holds here: what it asks, at most the node's size (a
        larger ask is a hint the provider could not honour and warned about: the job
        runs anyway, holding all of it)."""
        cpus = min(d.cpus, self.size.cpus) if self.size.cpus else d.cpus
        memory = min(d.memory, self.size.memory_gb) if self.size.memory_gb else d.memory
        return cpus, memory

    def fits(self, d: Demand) -> list[int] | None:
        if self.whole or (d.whole and self.jobs):
            return None
        cpus, memory = self.held(d)
        if self.size.cpus and self.cpus + cpus > self.size.cpus + 1e-9:
            return None
        if self.size.memory_gb and self.memory + memory > self.size.memory_gb + 1e-9:
            return None
        return self.devices_for(d.gpus)


class Ledger:
    """What each node of a cluster has (GPUs, vCPUs, memory) and what the running jobs
    hold: a job starts when ``take`` finds it room, and ``give_back`` frees it.

    Accelerators are a requirement: a job asking more per node than a node has is refused
    (``refusal``). vCPUs and memory are, as on ``launch``, hints: a job asking more than a
    node has holds all of it (and runs alone there), it is not refused."""

    def __init__(self, nodes: list[NodeRecord], jobs_per_node: int = JOBS_PER_NODE) -> None:
        self.sizes = list(nodes)
        self.rooms = [_NodeRoom(n) for n in nodes]
        self.jobs_per_node = jobs_per_node

    def refusal(self, d: Demand, count: int, cluster: str, accelerator: str = "") -> str:
        """Why a job of ``count`` nodes needing ``d`` on each can never run on this
        cluster, even alone ('' when it can)."""
        if count > len(self.sizes):
            return f"the job needs {count} nodes but cluster {cluster} has {len(self.sizes)}"
        empty = [_NodeRoom(n) for n in self.sizes]
        fit = [i for i, room in enumerate(empty) if room.fits(d) is not None]
        if len(fit) >= count:
            return ""
        best = max(self.sizes, key=lambda n: n.gpus)
        if d.gpus and not best.gpus:
            return (
                f"the job asks for {accelerator or 'GPU'}:{d.gpus:g} per node but cluster "
                f"{cluster}'s nodes have no GPU: drop --gpus/accelerators, or launch a "
                "cluster with GPUs"
            )
        if d.gpus and max(n.gpus for n in self.sizes) < d.gpus:
            return (
                f"the job asks for {d.gpus:g} GPU(s) per node but cluster {cluster}'s nodes "
                f"have at most {best.gpus}"
            )
        return (
            f"the job needs {count} node(s) with {d.describe(accelerator)} but only "
            f"{len(fit)} of cluster {cluster}'s nodes have that much"
        )

    def take(self, d: Demand, count: int) -> Allocation | None:
        """Room for the job on ``count`` nodes (the first ones that have it), held until
        ``give_back``; None when the running jobs leave too little."""
        chosen: dict[int, list[int]] = {}
        for i, room in enumerate(self.rooms):
            devices = room.fits(d) if room.jobs < self.jobs_per_node else None
            if devices is not None:
                chosen[i] = devices
                if len(chosen) == count:
                    break
        if len(chosen) < count:
            return None
        share = d.gpus if d.gpus < 1 else 1.0
        for i, devices in chosen.items():
            room = self.rooms[i]
            room.jobs += 1
            room.whole = d.whole
            cpus, memory = room.held(d)
            room.cpus += cpus
            room.memory += memory
            for dev in devices:
                room.devices[dev] -= share
        return Allocation(list(chosen), chosen, d)

    def give_back(self, a: Allocation) -> None:
        d = a.demand
        share = d.gpus if d.gpus < 1 else 1.0
        for i, devices in a.devices.items():
            room = self.rooms[i]
            room.jobs -= 1
            room.whole = False
            cpus, memory = room.held(d)
            room.cpus -= cpus
            room.memory -= memory
            for dev in devices:
                room.devices[dev] = min(1.0, room.devices[dev] + share)
