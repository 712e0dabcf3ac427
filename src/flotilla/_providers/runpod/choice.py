"""Which RunPod GPU types a pool may rent, cheapest first: the candidates.

RunPod's GPU types (GraphQL ``gpuTypes``) carry a price per GPU-hour for each cloud (secure,
community) and market (on-demand; ``Spot``: interruptible, at the minimum bid). A pool's
``accelerator`` selects the types the catalog reads as that model and variant
(``_accelerators.offered_as``: ``NVIDIA A100-SXM4-80GB`` is an ``A100`` of 80 GB, SXM);
``RunPod(cloud_type=, allocation=)`` the clouds and markets. Each (type, cloud, market) is
a :class:`Candidate`, priced for the pool's GPUs per node; those above
``max_node_hourly_cost`` are dropped, and a pool whose cheapest candidate costs more than
``max_hourly_cost`` is refused before anything is rented. The acquire walks them in order,
and within each the data centers (``RunPod(data_centers=)``; none: RunPod chooses): a
capacity error moves to the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._accelerators import offered_as, unknown_name
from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..base import PoolSpec
from ..cloud.market import over_budget
from ..offers import Offer
from .settings import RunPodSettings

GPU_TYPES = """query GpuTypes {
  gpuTypes {
    id displayName memoryInGb secureCloud communityCloud maxGpuCount
    securePrice communityPrice secureSpotPrice communitySpotPrice
  }
}"""


@dataclass(frozen=True)
class Candidate:
    """One kind of pod the pool may rent.

    Attributes:
        gpu_type: RunPod's GPU type id ("NVIDIA A100 80GB PCIe").
        name: its display name ("A100 PCIe").
        count: GPUs per pod (0: a CPU pod is not offered by flotilla).
        cloud: "SECURE" or "COMMUNITY".
        interruptible: an interruptible (spot) pod.
        hourly: what one pod costs per hour.
    """

    gpu_type: str
    name: str
    count: int
    cloud: str
    interruptible: bool
    hourly: float

    def describe(self) -> str:
        market = "spot" if self.interruptible else "on-demand"
        return (
            f"{self.count} x {self.gpu_type} ({self.cloud.lower()}, {market}, ${self.hourly:.2f}/h)"
        )


def candidates(
    types: list[dict[str, Any]], spec: PoolSpec, settings: RunPodSettings, listing: bool = False
) -> list[Candidate]:
    """Every candidate for one node of ``spec``, cheapest first (see the module
    docstring); ConfigurationError when the accelerator is none RunPod has, naming the
    nearest. ``listing`` (the offers): without an accelerator, one GPU of every type."""
    acc = spec.accelerator
    if acc is None and not listing:
        raise ConfigurationError(
            "RunPod rents GPU pods: give the pool an accelerator (accelerator='A100', "
            "'RTX 4090:2'); `flotilla show-gpus --provider runpod` lists them"
        )
    if acc is not None and acc.fractional:
        raise ConfigurationError(
            f"RunPod has no fractions of a GPU: accelerator {acc} (use a whole count)"
        )
    fits = [t for t in types if acc is None or offered_as(acc, str(t.get("id") or ""), "runpod")]
    if not fits and acc is not None:
        offered = [str(t.get("displayName") or t.get("id")) for t in types]
        raise ConfigurationError(unknown_name(acc.name, "RunPod", {"runpod": offered}))
    clouds = {"secure": ("SECURE",), "community": ("COMMUNITY",), "all": ("SECURE", "COMMUNITY")}
    markets = {"on-demand": (False,), "spot": (True,), "spot-if-available": (True, False)}
    out = []
    count = int(acc.count) if acc is not None else 1
    for t in fits:
        if int(t.get("maxGpuCount") or 8) < count:
            continue
        for cloud in clouds[settings.cloud_type]:
            if not t.get("secureCloud" if cloud == "SECURE" else "communityCloud"):
                continue
            for spot in markets[settings.allocation]:
                key = ("secure" if cloud == "SECURE" else "community") + (
                    "SpotPrice" if spot else "Price"
                )
                price = t.get(key)
                if price is None:
                    continue
                out.append(
                    Candidate(
                        str(t["id"]),
                        str(t.get("displayName") or t["id"]),
                        count,
                        cloud,
                        spot,
                        round(float(price) * count, 4),
                    )
                )
    # spot-if-available: every spot candidate first, cheapest first, then on-demand
    out.sort(
        key=lambda c: (not c.interruptible if settings.allocation != "on-demand" else 0, c.hourly)
    )
    return out


def affordable(found: list[Candidate], spec: PoolSpec) -> list[Candidate]:
    """``found`` without those above the pool's cost caps; ProvisionError (before
    renting) when none is left."""
    if not found:
        raise ProvisionError(
            f"RunPod offers no {spec.accelerator} pod in the clouds and markets asked for "
            "(RunPod(cloud_type=..., allocation=...))",
            cause=ProvisionCause.CAPACITY,
        )
    cap = spec.max_node_hourly_cost
    cheap = [c for c in found if cap is None or c.hourly <= cap]
    if not cheap:
        raise ProvisionError(
            f"every RunPod pod of {spec.accelerator} costs more than max_node_hourly_cost="
            f"${cap:.2f}/h a node (the cheapest: ${min(c.hourly for c in found):.2f}/h): "
            "nothing was rented",
            cause=ProvisionCause.CAPACITY,
        )
    nodes = max(1, spec.nodes)  # an elastic pool (nodes 0): its first node
    over_budget(
        min(c.hourly for c in cheap) * nodes,
        spec.max_hourly_cost,
        f"the cheapest RunPod pods for {nodes} node(s) of {spec.accelerator} cost",
    )
    return cheap


def as_offer(c: Candidate) -> Offer:
    return Offer(
        provider="runpod",
        accelerator=c.name,
        count=c.count,
        hourly=c.hourly,
        region=c.cloud.lower(),
        spot=c.interruptible,
        detail=c.gpu_type,
    )
