"""What Kubernetes pools leave when their client dies, and removing it.

Every pod of a pool is labelled ``app.kubernetes.io/managed-by=flotilla`` and
``flotilla/pool=<id>``, and annotated ``flotilla/client = host:pid:start`` (as AWS
resources are tagged, see ``aws.orphans``). A pool whose client ran on this machine and is
gone is an orphan: :func:`remove_orphans` deletes its pods (ended ones too: a killed
client's pods end by themselves, see ``provider``). Pools of clients on other machines
cannot be checked from here and are left alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..aws.orphans import client_alive
from .kubectl import Kubectl
from .provider import CLIENT_ANNOTATION, MANAGED, POOL_LABEL
from .settings import KubernetesSettings


@dataclass(frozen=True)
class Orphans:
    """What :func:`remove_orphans` found (and removed, unless it was a dry run).

    Attributes:
        pools: ids of the orphan pools.
        pods: their pods.
        skipped: pools whose client ran on another machine (not checked, not touched).
    """

    pools: tuple[str, ...]
    pods: tuple[str, ...]
    skipped: tuple[str, ...]


async def find_and_remove(settings: KubernetesSettings, dry_run: bool = False) -> Orphans:
    kubectl = Kubectl(settings)
    pods = await kubectl.get("pods", MANAGED)
    pools: dict[str, list[str]] = {}
    skipped: set[str] = set()
    for pod in pods:
        meta = pod.get("metadata", {})
        pool = (meta.get("labels") or {}).get(POOL_LABEL, "")
        client = (meta.get("annotations") or {}).get(CLIENT_ANNOTATION, "")
        alive = client_alive(client) if client else None
        if not pool:
            continue
        if alive is None:
            skipped.add(pool)
        elif not alive:
            pools.setdefault(pool, []).append(meta.get("name", ""))
    if not dry_run:
        for pool in pools:
            await kubectl.delete("pods", f"{POOL_LABEL}={pool}", wait=True)
    return Orphans(
        pools=tuple(sorted(pools)),
        pods=tuple(sorted(n for names in pools.values() for n in names)),
        skipped=tuple(sorted(skipped - set(pools))),
    )


async def remove_client_pools(settings: KubernetesSettings, client: str) -> list[str]:
    """Delete the pods of every pool the client ``client`` (``host:pid:start``) made; their
    names."""
    kubectl = Kubectl(settings)
    pods = [
        p.get("metadata", {})
        for p in await kubectl.get("pods", MANAGED)
        if (p.get("metadata", {}).get("annotations") or {}).get(CLIENT_ANNOTATION) == client
    ]
    for pool in sorted({(m.get("labels") or {}).get(POOL_LABEL, "") for m in pods} - {""}):
        await kubectl.delete("pods", f"{POOL_LABEL}={pool}", wait=True)
    return sorted(m.get("name", "") for m in pods)


def remove_orphans(settings: KubernetesSettings, dry_run: bool = False) -> Orphans:
    """Delete the pods of pools whose client ran on this machine and is gone (in the
    settings' namespace and context); what was found."""
    return asyncio.run(find_and_remove(settings, dry_run))
