"""What Kubernetes pools leave when their client dies, and removing it.

Every object of a pool (its pods, its headless Service, its Secret) is labelled
``app.kubernetes.io/managed-by=flotilla`` and ``flotilla/pool=<id>``, and annotated
``flotilla/client = host:pid:start`` (as AWS resources are tagged, see ``cloud.identity``). A
pool whose client ran on this machine and is gone is an orphan: :func:`remove_orphans`
deletes its objects (ended pods too: a killed client's pods end by themselves, see
``provider``; its Service and Secret stay until then). Pools of clients on other machines
cannot be checked from here and are left alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ..cloud.identity import client_alive
from .kubectl import Kubectl
from .provider import CLIENT_ANNOTATION, MANAGED, POOL_LABEL
from .settings import KubernetesSettings

KINDS = "pods,services,secrets"
"""The kinds of a pool's objects."""


@dataclass(frozen=True)
class Orphans:
    """What :func:`remove_orphans` found (and removed, unless it was a dry run).

    Attributes:
        pools: ids of the orphan pools.
        pods: their pods.
        skipped: pools whose client ran on another machine (not checked, not touched).
        others: their other objects, as ``kind/name`` (``service/flotilla-ab12cd34``).
    """

    pools: tuple[str, ...]
    pods: tuple[str, ...]
    skipped: tuple[str, ...]
    others: tuple[str, ...] = ()


def _pool_of(item: dict[str, Any]) -> tuple[str, str, str, str]:
    """(pool id, client annotation, kind, name) of one object."""
    meta = item.get("metadata", {})
    return (
        (meta.get("labels") or {}).get(POOL_LABEL, ""),
        (meta.get("annotations") or {}).get(CLIENT_ANNOTATION, ""),
        str(item.get("kind", "")).lower(),
        meta.get("name", ""),
    )


async def _delete_pools(kubectl: Kubectl, pools: list[str]) -> None:
    """Delete every object of ``pools``, waiting until their pods are gone."""
    for pool in pools:
        selector = f"{POOL_LABEL}={pool}"
        await kubectl.delete("pods", selector, wait=True)
        await kubectl.delete("services,secrets", selector, wait=False)


async def find_and_remove(settings: KubernetesSettings, dry_run: bool = False) -> Orphans:
    kubectl = Kubectl(settings)
    pools: dict[str, list[tuple[str, str]]] = {}
    skipped: set[str] = set()
    for item in await kubectl.get(KINDS, MANAGED):
        pool, client, kind, name = _pool_of(item)
        if not pool:
            continue
        alive = client_alive(client) if client else None
        if alive is None:
            skipped.add(pool)
        elif not alive:
            pools.setdefault(pool, []).append((kind, name))
    if not dry_run:
        await _delete_pools(kubectl, sorted(pools))
    objects = [o for found in pools.values() for o in found]
    return Orphans(
        pools=tuple(sorted(pools)),
        pods=tuple(sorted(name for kind, name in objects if kind == "pod")),
        skipped=tuple(sorted(skipped - set(pools))),
        others=tuple(sorted(f"{kind}/{name}" for kind, name in objects if kind != "pod")),
    )


async def remove_client_pools(settings: KubernetesSettings, client: str) -> list[str]:
    """Delete every object of every pool the client ``client`` (``host:pid:start``) made;
    the names of their pods."""
    kubectl = Kubectl(settings)
    mine = [o for o in map(_pool_of, await kubectl.get(KINDS, MANAGED)) if o[1] == client]
    await _delete_pools(kubectl, sorted({pool for pool, *_ in mine} - {""}))
    return sorted(name for _, _, kind, name in mine if kind == "pod")


def remove_orphans(settings: KubernetesSettings, dry_run: bool = False) -> Orphans:
    """Delete the objects of pools whose client ran on this machine and is gone (in the
    settings' namespace and context); what was found."""
    return asyncio.run(find_and_remove(settings, dry_run))
