"""What the configured providers offer now: :func:`offers` (``flotilla.offers``) and
:func:`configured` (the cloud providers this machine has credentials for)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .offers import Offer

if TYPE_CHECKING:
    from .._accelerators import Accelerator


MARKETS: tuple[tuple[str, str], ...] = (
    ("vast", "VastAI"),
    ("runpod", "RunPod"),
    ("lambda_cloud", "LambdaCloud"),
    ("gcp", "GCP"),
    ("verda", "Verda"),
)
"""The GPU markets (package under ``_providers``, provider class) asked when no provider
is named: each package's ``provider`` module has ``configured() -> bool``, whether this
machine has its credentials (a key in its variable or its CLI's file; it must not call
the API nor need an SDK installed)."""


def configured() -> list[Any]:
    """The cloud providers this machine has credentials for, with their defaults: those of
    :data:`MARKETS` whose ``configured()`` says so (Vast.ai: ``VAST_API_KEY`` or the
    official CLI's key file; RunPod: ``RUNPOD_API_KEY``...) and AWS (boto3, a region and
    credentials)."""
    import importlib
    import importlib.util

    found: list[Any] = []
    for package, name in MARKETS:
        module_name = f"{__package__}.{package}.provider"
        if importlib.util.find_spec(f"{__package__}.{package}") is None:
            continue  # a market this version of flotilla does not have
        module = importlib.import_module(module_name)
        if module.configured():
            found.append(getattr(module, name)())
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
