"""Which Compute Engine machine a pool's node is, and what it costs.

An accelerator is a machine family (Google's table "GPU machine types", read through the
catalog, ``_accelerators``): A100 40GB are
``a2-highgpu-{1,2,4,8}g`` (``a2-megagpu-16g``), A100 80GB ``a2-ultragpu-*``, H100
``a3-highgpu-*``, H200 ``a3-ultragpu-8g``, B200 ``a4-highgpu-8g``, L4 ``g2-standard-*``; the
older T4, V100, P100 and P4 are attached to an N1 machine (``guestAccelerators``), as
Skyward does (``n1-standard-{8,16,32,96}`` for 1, 2, 4, 8). No accelerator: the smallest
``n2-standard`` with the vCPUs and memory asked.

Prices are Google's list prices in us-central1 (USD per hour, on-demand; SPOT about a third
of it, it varies): informative, to order offers and hold ``max_hourly_cost``; the Compute API
has none (the Cloud Billing Catalog does, per SKU).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._accelerators import Accelerator, lookup, offered_as, unknown_name
from ..._errors import ConfigurationError
from ..base import PoolSpec
from ..cloud.market import over_budget
from ..offers import Offer

N1_FOR: dict[int, str] = {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32"}
N1_FOR[8] = "n1-standard-96"
GPU_TYPES: tuple[tuple[str, dict[int, str], bool], ...] = (
    ("nvidia-tesla-t4", N1_FOR, True),
    ("nvidia-tesla-p4", N1_FOR, True),
    (
        "nvidia-l4",
        {1: "g2-standard-4", 2: "g2-standard-24", 4: "g2-standard-48", 8: "g2-standard-96"},
        False,
    ),
    ("nvidia-tesla-p100", N1_FOR, True),
    ("nvidia-tesla-v100", N1_FOR, True),
    (
        "nvidia-tesla-a100",
        {
            1: "a2-highgpu-1g",
            2: "a2-highgpu-2g",
            4: "a2-highgpu-4g",
            8: "a2-highgpu-8g",
            16: "a2-megagpu-16g",
        },
        False,
    ),
    (
        "nvidia-a100-80gb",
        {1: "a2-ultragpu-1g", 2: "a2-ultragpu-2g", 4: "a2-ultragpu-4g", 8: "a2-ultragpu-8g"},
        False,
    ),
    (
        "nvidia-h100-80gb",
        {1: "a3-highgpu-1g", 2: "a3-highgpu-2g", 4: "a3-highgpu-4g", 8: "a3-highgpu-8g"},
        False,
    ),
    ("nvidia-h200-141gb", {8: "a3-ultragpu-8g"}, False),
    ("nvidia-b200", {8: "a4-highgpu-8g"}, False),
)
"""GCP's accelerator types, cheapest first: (type, GPUs -> machine type, attached to an N1
machine rather than built into the machine type). The catalog (``identify``) reads each
type as a model, memory and form factor."""
PRICES: dict[str, float] = {
    "a2-highgpu-1g": 3.67,
    "a2-highgpu-2g": 7.35,
    "a2-highgpu-4g": 14.69,
    "a2-highgpu-8g": 29.39,
    "a2-megagpu-16g": 55.74,
    "a2-ultragpu-1g": 5.07,
    "a2-ultragpu-2g": 10.14,
    "a2-ultragpu-4g": 20.28,
    "a2-ultragpu-8g": 40.55,
    "a3-highgpu-1g": 11.06,
    "a3-highgpu-2g": 22.12,
    "a3-highgpu-4g": 44.24,
    "a3-highgpu-8g": 88.49,
    "g2-standard-4": 0.71,
    "g2-standard-24": 2.0,
    "g2-standard-48": 4.0,
    "g2-standard-96": 8.0,
    "n1-standard-8": 0.38,
    "n1-standard-16": 0.76,
    "n1-standard-32": 1.52,
    "n1-standard-96": 4.56,
    "n2-standard-2": 0.097,
    "n2-standard-4": 0.194,
    "n2-standard-8": 0.388,
    "n2-standard-16": 0.777,
    "n2-standard-32": 1.554,
    "n2-standard-64": 3.108,
}
"""On-demand list prices in us-central1 (USD/h) of machine types."""
ATTACHED_PRICES = {
    "nvidia-tesla-t4": 0.35,
    "nvidia-tesla-v100": 2.48,
    "nvidia-tesla-p100": 1.46,
    "nvidia-tesla-p4": 0.6,
}
"""On-demand list prices of an attached GPU (USD/h each)."""
SPOT_FACTOR = 0.35
N2_SIZES = (2, 4, 8, 16, 32, 64, 96, 128)


@dataclass(frozen=True)
class MachineChoice:
    """One node's machine.

    Attributes:
        machine_type: the machine type's name.
        accelerator: the GCP accelerator type ("" for none).
        gpus: GPUs per node.
        attached: the GPUs are attached (``guestAccelerators``), not built in.
        name: flotilla's name of the accelerator ("" for none).
    """

    machine_type: str
    accelerator: str = ""
    gpus: int = 0
    attached: bool = False
    name: str = ""

    def hourly(self, spot: bool) -> float | None:
        """Per node, from the list prices (None: not known)."""
        price = PRICES.get(self.machine_type)
        if price is None:
            return None
        if self.attached:
            price += ATTACHED_PRICES.get(self.accelerator, 0.0) * self.gpus
        return round(price * (SPOT_FACTOR if spot else 1.0), 4)


def machine_for(spec: PoolSpec, machine_type: str | None) -> MachineChoice:
    """The machine of one node of ``spec``: the cheapest GCP accelerator type that is the
    accelerator asked for (its model, and memory and form factor when it names them: the
    catalog, ``offered_as``), in the machine type with that many GPUs (``machine_type``
    given: that one). ConfigurationError for an accelerator or count GCP does not have,
    naming what it has."""
    acc = spec.accelerator
    if acc is None:
        if machine_type:
            return MachineChoice(machine_type)
        cpus = spec.vcpus or 2
        memory = spec.memory_gb or 0
        for n in N2_SIZES:
            if n >= cpus and 4 * n >= memory:
                return MachineChoice(f"n2-standard-{n}")
        raise ConfigurationError(
            f"no n2-standard machine has {cpus:g} vCPUs and {memory:g} GiB: give "
            "GCP(machine_type=...)"
        )
    count = acc.whole
    matching = [t for t in GPU_TYPES if offered_as(acc, t[0], "gcp")]
    if not matching:
        offered = {"gcp": [t[0] for t in GPU_TYPES]}
        model = lookup(acc.name)
        if model is not None and model.architecture == "TPU":
            raise ConfigurationError(tpu_refusal(model.name, offered["gcp"]))
        raise ConfigurationError(unknown_name(acc.name, "GCP", offered))
    for gpu_type, sizes, attached in matching:
        chosen = machine_type or sizes.get(count)
        if chosen is not None:
            return MachineChoice(chosen, gpu_type, count, attached, acc.name)
    counts = sorted({n for _, sizes, _ in matching for n in sizes})
    raise ConfigurationError(
        f"GCP has no machine with {count} x {acc.name}: its {', '.join(t[0] for t in matching)} "
        f"machines have {', '.join(map(str, counts))} GPUs"
    )


def tpu_refusal(name: str, offered: list[str]) -> str:
    """Why GCP(...) does not offer a TPU: Cloud TPUs are TPU VMs of the Cloud TPU API
    (``tpu.googleapis.com``), not Compute Engine instances (the ``ct5lp``/``ct5p`` machine
    types the Compute API lists are for GKE node pools only)."""
    return (
        f"GCP(...) does not offer {name}: Cloud TPUs are TPU VMs made through the Cloud TPU "
        "API (tpu.googleapis.com), not Compute Engine instances, and flotilla's GCP provider "
        f"uses the Compute Engine API only; it offers the GPUs {', '.join(offered)} (or no "
        "accelerator: an n2-standard machine)"
    )


def as_offer(choice: MachineChoice, zone: str, spot: bool) -> Offer:
    return Offer(
        provider="gcp",
        accelerator=choice.name or None,
        count=choice.gpus,
        hourly=choice.hourly(spot),
        region=zone,
        spot=spot,
        detail=choice.machine_type
        + (f" + {choice.gpus} x {choice.accelerator}" if choice.attached else ""),
        available=1,
    )


def within_cost(choice: MachineChoice, spec: PoolSpec, spot: bool) -> None:
    """ProvisionError (before renting) when the known price is above
    ``spec.max_node_hourly_cost`` (a node's) or ``spec.max_hourly_cost`` (the pool's)."""
    price = choice.hourly(spot)
    over_budget(
        price,
        spec.max_node_hourly_cost,
        f"GCP {choice.machine_type} costs",
        " a node (list price)",
        "max_node_hourly_cost",
    )
    nodes = max(1, spec.nodes)  # an elastic pool (nodes 0): its first node
    over_budget(
        None if price is None else price * nodes,
        spec.max_hourly_cost,
        f"{nodes} x GCP {choice.machine_type} cost",
        " (list price)",
    )


def describe(accelerator: Accelerator | None, choice: MachineChoice) -> str:
    what = f"{accelerator.count} x {accelerator.name} on " if accelerator else ""
    return what + choice.machine_type
