"""Offers: what a provider can give for a pool's request, and at what price.

A provider that can tell (:meth:`Provider.offers`) lists :class:`Offer` objects: the
accelerator type and count per node, the price per node-hour, where, spot or not. The
fallback across providers (``fallback``) orders candidates by them with
``allocation="cheapest"`` and refuses what costs more than ``max_hourly_cost``;
``flotilla.offers()`` and ``flotilla show-gpus`` show them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._accelerators import Accelerator


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


def configured() -> list[Any]:
    """The cloud providers this machine has credentials for, with their defaults: Vast.ai
    (an API key: ``VAST_API_KEY`` or the official CLI's key file) and AWS (boto3, a region
    and credentials)."""
    found: list[Any] = []
    from .vast.api import find_key

    if find_key(None)[0]:
        from .vast import VastAI

        found.append(VastAI())
    try:
        from .aws import AWS

        aws = AWS()
        aws.api.check()
        found.append(aws)
    except Exception:  # no boto3, region or credentials: not configured
        pass
    return found


def offers(
    accelerator: str | Accelerator | None = None,
    *,
    providers: Sequence[Any] | None = None,
    vcpus: float | None = None,
    memory_gb: float | None = None,
    nodes: int = 1,
) -> list[Offer]:
    """What each provider can give now for one node with ``accelerator`` (``"A100"``,
    ``"A100:8"``), ``vcpus`` and ``memory_gb``: every :class:`Offer` (type, count, price
    per node-hour, region, spot or not), cheapest first (unknown prices last).

    Args:
        providers: the providers to ask (default: every configured one, see
            :func:`configured`).
        nodes: for a pool of that many nodes (a cluster of several needs them together).

    A provider whose search fails is left out with a warning on stderr.
    """
    from .._accelerators import parse_accelerator
    from .base import Options, PoolSpec

    acc = parse_accelerator(accelerator)
    spec = PoolSpec("offers", nodes, acc, None, (), Options(), vcpus, memory_gb)
    found: list[Offer] = []
    for provider in configured() if providers is None else providers:
        try:
            mine = provider.offers(spec)
        except Exception as e:
            print(f"flotilla: {provider!r}: cannot list offers: {e}", file=sys.stderr)
            continue
        found.extend(mine or [])
    return sorted(found, key=lambda o: (o.hourly is None, o.hourly or 0.0))
