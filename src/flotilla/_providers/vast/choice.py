"""Which Vast offers a pool rents: the search query, and the choice of N machines.

The query is the official client's (``search__offers``, vast.py 3021-3100): the default
filters (verified, not external, rentable, not rented), one condition per field (``num_gpus``
``eq``, ``gpu_name`` ``in``, ``cpu_cores_effective``/``cpu_ram``/``disk_space``/
``reliability`` ``gte``, ``geolocation`` ``in``), ``order`` by ``dph_total``, ``type``
``on-demand``, POSTed to ``/bundles/``. ``cpu_ram`` is in MB (``offers_mult``, 700-705).

A cluster pool of several nodes needs a private network between them: Vast instances have
none of their own, so its machines must be in one physical cluster (the offers'
``cluster_id``), whose instances can join one overlay network. A standalone pool
(``Options(cluster=False)``) or a single node takes the cheapest machines anywhere.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ..._accelerators import Accelerator
from ..._errors import ProvisionCause, ProvisionError
from ..base import PoolSpec
from ..offers import Offer
from .settings import VastSettings

GPU_NAMES: dict[str, tuple[str, ...]] = {
    "A100": ("A100 SXM4", "A100 PCIE", "A100X", "A100 SXM"),
    "H100": ("H100 SXM", "H100 PCIE", "H100 NVL"),
    "H200": ("H200", "H200 NVL"),
    "B200": ("B200",),
    "GH200": ("GH200 SXM",),
    "A10": ("A10",),
    "A10G": ("A10g",),
    "A40": ("A40",),
    "L4": ("L4",),
    "L40S": ("L40S",),
    "T4": ("Tesla T4",),
    "V100": ("Tesla V100",),
    "P100": ("Tesla P100",),
    "K80": ("Tesla K80",),
    "RTX4090": ("RTX 4090",),
    "RTX3090": ("RTX 3090",),
    "RTX5090": ("RTX 5090",),
}
"""flotilla's accelerator names -> Vast's ``gpu_name`` values."""
GIB_MB = 1073.741824
"""MB (Vast's ``cpu_ram`` unit) per GiB."""


def gpu_names(accelerator: Accelerator) -> list[str]:
    """Vast's names for ``accelerator``'s type (a Vast name given as it is also works)."""
    key = accelerator.name.upper().replace(" ", "").replace("_", "").replace("-", "")
    names = GPU_NAMES.get(key)
    return list(names) if names else [accelerator.name.replace("_", " ")]


def query(spec: PoolSpec, settings: VastSettings) -> dict[str, Any]:
    """The ``/bundles/`` search body for one node of ``spec``."""
    q: dict[str, Any] = {
        "verified": {"eq": True},
        "external": {"eq": False},
        "rentable": {"eq": True},
        "rented": {"eq": False},
        "reliability": {"gte": settings.min_reliability},
        "disk_space": {"gte": settings.disk_gb},
    }
    if spec.accelerator is not None:
        q["num_gpus"] = {"eq": spec.accelerator.count}
        q["gpu_name"] = {"in": gpu_names(spec.accelerator)}
    if spec.vcpus is not None:
        q["cpu_cores_effective"] = {"gte": spec.vcpus}
    if spec.memory_gb is not None:
        q["cpu_ram"] = {"gte": spec.memory_gb * GIB_MB}
    if settings.regions:
        q["geolocation"] = {"in": list(settings.regions)}
    q["order"] = [["dph_total", "asc"]]
    q["type"] = "on-demand"
    q["allocated_storage"] = settings.disk_gb
    return q


def describe(spec: PoolSpec, settings: VastSettings) -> str:
    """The request in words, for errors."""
    what = [
        f"{spec.accelerator.count} x {spec.accelerator.name}" if spec.accelerator else "any GPU"
    ]
    if spec.vcpus is not None:
        what.append(f">= {spec.vcpus:g} vCPUs")
    if spec.memory_gb is not None:
        what.append(f">= {spec.memory_gb:g} GiB memory")
    what.append(f">= {settings.disk_gb:g} GB disk")
    what.append(f"reliability >= {settings.min_reliability:g}")
    if settings.regions:
        what.append(f"in {', '.join(settings.regions)}")
    return ", ".join(what) + " per node"


@dataclass(frozen=True)
class Choice:
    """The offers a pool rents, one per node, and the cluster they are in (None: any)."""

    offers: tuple[dict[str, Any], ...]
    cluster_id: int | None

    @property
    def hourly(self) -> float:
        return sum(float(o.get("dph_total") or 0) for o in self.offers)


def as_offer(raw: dict[str, Any]) -> Offer:
    cluster = raw.get("cluster_id")
    return Offer(
        provider="vast",
        accelerator=str(raw.get("gpu_name") or "") or None,
        count=int(raw.get("num_gpus") or 0),
        hourly=float(raw["dph_total"]) if raw.get("dph_total") is not None else None,
        region=str(raw.get("geolocation") or ""),
        spot=False,
        detail=f"offer {raw.get('id')} (machine {raw.get('machine_id')})",
        available=1,
        cluster="" if cluster is None else str(cluster),
    )


def choose(
    offers: list[dict[str, Any]],
    spec: PoolSpec,
    settings: VastSettings,
    max_hourly_cost: float | None = None,
) -> Choice:
    """The cheapest ``spec.nodes`` offers on distinct machines (one physical cluster for a
    cluster pool of several nodes); ProvisionError saying why there is none, and, with
    ``max_hourly_cost``, when the cheapest choice costs more (all before renting)."""
    nodes = spec.nodes
    want = describe(spec, settings)
    if not offers:
        raise ProvisionError(
            f"Vast has no offer for {want} (none matches the search; relax the request, "
            "VastAI(min_reliability=..., regions=...), or try later)",
            cause=ProvisionCause.CAPACITY,
        )
    cap = spec.max_node_hourly_cost
    if cap is not None:
        cheap = [o for o in offers if float(o.get("dph_total") or 0) <= cap]
        if not cheap:
            low = min(float(o.get("dph_total") or 0) for o in offers)
            raise ProvisionError(
                f"every Vast offer for {want} costs more than max_node_hourly_cost="
                f"${cap:.2f}/h a node (the cheapest: ${low:.2f}/h): nothing was rented",
                cause=ProvisionCause.CAPACITY,
            )
        offers = cheap
    together = spec.options.cluster and nodes > 1
    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for o in sorted(offers, key=lambda o: float(o.get("dph_total") or 0)):
        key = o.get("cluster_id") if together else "any"
        if key is None:
            continue
        if all(o.get("machine_id") != p.get("machine_id") for p in groups[key]):
            groups[key].append(o)
    choices = [
        Choice(tuple(g[:nodes]), key if together else None)
        for key, g in groups.items()
        if len(g) >= nodes
    ]
    if not choices:
        if together:
            biggest = max((len(g) for g in groups.values()), default=0)
            raise ProvisionError(
                f"no physical cluster on Vast has {nodes} machines offering {want} "
                f"({len(offers)} offer(s) found; the largest cluster has {biggest}): the "
                "nodes of a cluster pool must be in one physical cluster to share an overlay "
                "network; use Options(cluster=False) for standalone workers anywhere, or "
                "fewer nodes",
                cause=ProvisionCause.CAPACITY,
            )
        raise ProvisionError(
            f"Vast has {len(groups.get('any', []))} machine(s) offering {want}, not {nodes}: "
            "ask for fewer nodes, relax the request, or try later",
            cause=ProvisionCause.CAPACITY,
        )
    best = min(choices, key=lambda c: c.hourly)
    if max_hourly_cost is not None and best.hourly > max_hourly_cost:
        raise ProvisionError(
            f"the cheapest Vast offer for {nodes} node(s) of {want} costs "
            f"${best.hourly:.2f}/h, above max_hourly_cost=${max_hourly_cost:.2f}/h: nothing "
            "was rented",
            cause=ProvisionCause.CAPACITY,
        )
    return best
