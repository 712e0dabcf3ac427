"""Offers: what a provider can give for a pool's request, and at what price.

A provider that can tell (:meth:`Provider.offers`) lists :class:`Offer` objects: the
accelerator type and count per node, the price per node-hour, where, spot or not. The
fallback across providers (``fallback``) orders candidates by them with
``allocation="cheapest"`` and refuses what costs more than ``max_hourly_cost``;
``flotilla.offers()`` (``market``) and ``flotilla show-gpus`` show them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Offer:
    """One kind of node a provider offers.

    Attributes:
        provider: the provider's name ("vast", "aws").
        accelerator: the accelerator type ("A100 SXM4"), or None for CPU only.
        count: accelerators per node.
        hourly: price per node-hour in USD (None: unknown).
        region: where (a country code, an AWS region).
        spot: interruptible (spot, bid) or not.
        detail: what the provider calls it (an offer id and machine, an instance type).
        available: how many such nodes can be had now (None: unknown).
        cluster: the physical cluster the machine is in ("" if none).
    """

    provider: str
    accelerator: str | None
    count: int
    hourly: float | None
    region: str
    spot: bool = False
    detail: str = ""
    available: int | None = None
    cluster: str = ""

    def pool_cost(self, nodes: int) -> float | None:
        """What ``nodes`` such nodes cost per hour (None: unknown)."""
        return None if self.hourly is None else self.hourly * nodes


def describe_cost(hourly: float | None) -> str:
    return "price unknown" if hourly is None else f"${hourly:.4g}/h"
