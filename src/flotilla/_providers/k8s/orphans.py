"""What Kubernetes pools leave when their client dies, and removing it.

Every object of a pool (its pods, its headless Service, its Secret) is labelled
``app.kubernetes.io/managed-by=flotilla`` and ``flotilla/pool=<id>``, and annotated
``flotilla/client = host:pid:start`` (as AWS resources are tagged, see ``cloud.identity``). A
pool whose client ran on this machine and is gone is an orphan: :func:`remove_orphans`
deletes its objects (ended pods too: a killed client's pods end by themselves, see
``provider``; its Service and Secret stay until then). Pools of clients on other machines
cannot be checked from here and are left alone.

The search covers every namespace the user can list (``kubectl get --all-namespaces``);
where that is forbidden (RBAC that grants one namespace only), the namespace of the
kubeconfig's current context, and saying so; or one namespace, when asked.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Any

from ..._errors import ProvisionError
from ..cloud.identity import orphaned
from .kubectl import Kubectl, said
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
        others: their other objects, as ``kind/name`` (``service/flotilla-ab12cd34``),
            with ``namespace/`` before the name when the search covered several.
        note: how far the search went, when it could not list every namespace.
    """

    pools: tuple[str, ...]
    pods: tuple[str, ...]
    skipped: tuple[str, ...]
    others: tuple[str, ...] = ()
    note: str = ""


def _pool_of(item: dict[str, Any]) -> tuple[str, str, str, str]:
    """(pool id, client annotation, kind, name) of one object."""
    meta = item.get("metadata", {})
    return (
        (meta.get("labels") or {}).get(POOL_LABEL, ""),
        (meta.get("annotations") or {}).get(CLIENT_ANNOTATION, ""),
        str(item.get("kind", "")).lower(),
        meta.get("name", ""),
    )


async def _managed_everywhere(kubectl: Kubectl) -> tuple[list[dict[str, Any]], str]:
    """Every flotilla object in the namespaces the user can list, and a note ('' when
    that is all of them; else the current context's namespace only, and why)."""
    status, out, err = await kubectl.run(
        ["get", KINDS, "-l", MANAGED, "--all-namespaces", "-o", "json"], namespaced=False
    )
    if status == 0:
        items: list[dict[str, Any]] = json.loads(out).get("items", [])
        return items, ""
    if "forbidden" not in err.lower():
        raise ProvisionError(f"kubectl get --all-namespaces failed: {said(err)}")
    status, out, _ = await kubectl.run(
        ["config", "view", "--minify", "-o", "jsonpath={..namespace}"], namespaced=False
    )
    current = (out.strip() if status == 0 else "") or "default"
    here = Kubectl(replace(kubectl.settings, namespace=current))
    note = (
        f"looked in namespace {current} only (the current context's): listing every "
        "namespace is forbidden; --namespace NAME looks in another"
    )
    return [_in(item, current) for item in await here.get(KINDS, MANAGED)], note


def _in(item: dict[str, Any], namespace: str) -> dict[str, Any]:
    item.setdefault("metadata", {}).setdefault("namespace", namespace)
    return item


async def _delete_pools(kubectl: Kubectl, pools: list[str]) -> None:
    """Delete every object of ``pools``, waiting until their pods are gone."""
    for pool in pools:
        selector = f"{POOL_LABEL}={pool}"
        await kubectl.delete("pods", selector, wait=True)
        await kubectl.delete("services,secrets", selector, wait=False)


async def find_and_remove(
    settings: KubernetesSettings, dry_run: bool = False, every_namespace: bool = False
) -> Orphans:
    """Find (and unless ``dry_run`` delete) the orphan pools in the settings' namespace,
    or, with ``every_namespace``, in every one the user can list."""
    kubectl = Kubectl(settings)
    note = ""
    if every_namespace:
        items, note = await _managed_everywhere(kubectl)
    else:
        items = [_in(item, settings.namespace) for item in await kubectl.get(KINDS, MANAGED)]
    pools: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (namespace, pool) -> objects
    skipped: set[str] = set()
    for item in items:
        pool, client, kind, name = _pool_of(item)
        if not pool:
            continue
        if orphaned(pool, client, skipped):
            where = str(item["metadata"]["namespace"])
            pools.setdefault((where, pool), []).append((kind, name))
    if not dry_run:
        for where in sorted({ns for ns, _ in pools}):
            there = Kubectl(replace(settings, namespace=where))
            await _delete_pools(there, sorted(p for ns, p in pools if ns == where))
    several = len({ns for ns, _ in pools}) > 1 or {ns for ns, _ in pools} - {settings.namespace}

    def named(where: str, name: str) -> str:
        return f"{where}/{name}" if several else name

    objects = [(ns, kind, name) for (ns, _), found in pools.items() for kind, name in found]
    return Orphans(
        pools=tuple(sorted({p for _, p in pools})),
        pods=tuple(sorted(named(ns, name) for ns, kind, name in objects if kind == "pod")),
        skipped=tuple(sorted(skipped - {p for _, p in pools})),
        others=tuple(
            sorted(f"{kind}/{named(ns, name)}" for ns, kind, name in objects if kind != "pod")
        ),
        note=note,
    )


async def remove_client_pools(settings: KubernetesSettings, client: str) -> list[str]:
    """Delete every object of every pool the client ``client`` (``host:pid:start``) made;
    the names of their pods."""
    kubectl = Kubectl(settings)
    mine = [o for o in map(_pool_of, await kubectl.get(KINDS, MANAGED)) if o[1] == client]
    await _delete_pools(kubectl, sorted({pool for pool, *_ in mine} - {""}))
    return sorted(name for _, _, kind, name in mine if kind == "pod")


def remove_orphans(
    settings: KubernetesSettings, dry_run: bool = False, every_namespace: bool = False
) -> Orphans:
    """Delete the objects of pools whose client ran on this machine and is gone (in the
    settings' namespace and context, or every namespace: see :func:`find_and_remove`);
    what was found."""
    return asyncio.run(find_and_remove(settings, dry_run, every_namespace))
