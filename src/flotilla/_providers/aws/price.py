"""Hourly prices shown before a launch ("price when known"): spot from the EC2 spot price
history, on-demand from the AWS Price List API (``pricing:GetProducts``, served from
us-east-1 for every region). A price is informative only: any failure (no permission, an
API that does not answer, an unknown type) shows no price and never stops the launch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from .api import Api

PRICING_REGION = "us-east-1"
"""Where the Price List API answers for every region."""


def spot_price(api: Api, instance_type: str, zones: Iterable[str]) -> float | None:
    """The lowest current spot price of ``instance_type`` in ``zones`` ($/h)."""
    try:
        history = api.raw(
            "ec2",
            "describe_spot_price_history",
            InstanceTypes=[instance_type],
            ProductDescriptions=["Linux/UNIX"],
            StartTime=datetime.now(UTC),
        )["SpotPriceHistory"]
    except Exception:
        return None
    wanted = set(zones)
    prices = [float(h["SpotPrice"]) for h in history if h["AvailabilityZone"] in wanted]
    return min(prices) if prices else None


def on_demand_price(api: Api, instance_type: str) -> float | None:
    """The on-demand Linux price of ``instance_type`` in the pool's region ($/h)."""
    filters = {
        "instanceType": instance_type,
        "regionCode": api.region,
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
    }
    try:
        reply = api.raw(
            "pricing",
            "get_products",
            region=PRICING_REGION,
            ServiceCode="AmazonEC2",
            Filters=[{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in filters.items()],
            MaxResults=10,
        )
    except Exception:
        return None
    return price_from_products(reply.get("PriceList", []))


def price_from_products(price_list: Iterable[Any]) -> float | None:
    """The lowest non-zero USD hourly on-demand price in a GetProducts ``PriceList`` (each
    item a JSON document: ``terms.OnDemand.<offer>.priceDimensions.<dim>.pricePerUnit.USD``)."""
    prices = []
    for item in price_list:
        try:
            product = json.loads(item) if isinstance(item, str) else item
            for offer in product["terms"]["OnDemand"].values():
                for dim in offer["priceDimensions"].values():
                    if dim.get("unit") in ("Hrs", "Hours"):
                        prices.append(float(dim["pricePerUnit"]["USD"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    prices = [p for p in prices if p > 0]
    return min(prices) if prices else None


def describe(market: str, price: float | None) -> str:
    """``", spot $0.0312/h"`` for the launch line ("" when the price is not known)."""
    return f", {market} ${price:.4g}/h" if price is not None else ""


class Bill:
    """What a pool's instances cost per hour, by the prices found at its launch: each
    instance launched counts at its market's price (the other market's when that one is
    not known) until it is terminated. A pool scaled to zero bills 0.

    Attributes:
        prices: one instance's $/h by market (``"spot"``, ``"on-demand"``; None: unknown).
    """

    def __init__(self) -> None:
        self.prices: dict[str, float | None] = {}
        self._billed: dict[str, float] = {}  # instance id -> its $/h

    @property
    def hourly(self) -> float:
        """The instances' total $/h (0: none, or no price known)."""
        return sum(self._billed.values())

    def add(self, *instances: dict[str, Any]) -> None:
        """``instances`` (DescribeInstances/RunInstances items) were launched."""
        for inst in instances:
            market = "spot" if inst.get("InstanceLifecycle") == "spot" else "on-demand"
            known = [p for p in (self.prices.get(market), *self.prices.values()) if p]
            self._billed[inst["InstanceId"]] = known[0] if known else 0.0

    def remove(self, instance_id: str) -> None:
        """``instance_id`` was terminated."""
        self._billed.pop(instance_id, None)

    def clear(self) -> None:
        """Every instance of the pool was terminated."""
        self._billed.clear()
