"""What Container pools leave when their client and its janitor die, and removing it.

Every container and own network of a pool is labelled ``flotilla.managed=true``,
``flotilla.pool=<id>`` and ``flotilla.client=<host:pid:start>`` (see ``provider``). A pool
whose client ran on this machine and is gone is an orphan: :func:`remove_orphans` removes
its containers and network. Pools of clients on other machines (a remote engine) cannot be
checked from here and are left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

from ..._errors import ProvisionError
from ..cloud.identity import orphaned
from .provider import CLIENT_LABEL, MANAGED, POOL_LABEL, Engine, pool_labels
from .settings import ContainerSettings


@dataclass(frozen=True)
class Orphans:
    """What :func:`remove_orphans` found (and removed, unless it was a dry run).

    Attributes:
        pools: ids of the orphan pools.
        containers: their containers' names.
        networks: their networks.
        skipped: pools whose client ran on another machine (not checked, not touched).
    """

    pools: tuple[str, ...]
    containers: tuple[str, ...]
    networks: tuple[str, ...]
    skipped: tuple[str, ...]


async def _labelled(engine: Engine, kind: list[str]) -> list[dict[str, object]]:
    """``inspect`` entries of the containers (``kind=[]``) or networks (``["network"]``)
    flotilla made."""
    listing = ["ps", "-a", "-q"] if not kind else ["network", "ls", "-q"]
    names = (await engine.call([*listing, "--filter", f"label={MANAGED}"])).split()
    if not names:
        return []
    try:
        data = json.loads(await engine.call([*kind, "inspect", *names]))
    except ProvisionError:  # one was removed since the listing (its pool's end): each alone
        data = []
        for name in names:
            with contextlib.suppress(ProvisionError):
                data += json.loads(await engine.call([*kind, "inspect", name]))
    return list(data if isinstance(data, list) else [data])


async def find_and_remove(settings: ContainerSettings, dry_run: bool = False) -> Orphans:
    engine = Engine(settings)
    pools: dict[str, tuple[list[str], list[str]]] = {}
    skipped: set[str] = set()
    for kind in ([], ["network"]):
        for info in await _labelled(engine, kind):
            labels = pool_labels(info)
            pool, client = labels.get(POOL_LABEL, ""), labels.get(CLIENT_LABEL, "")
            if not pool:
                continue
            if orphaned(pool, client, skipped):
                name = str(info.get("Name") or info.get("name") or "").lstrip("/")
                pools.setdefault(pool, ([], []))[1 if kind else 0].append(name)
    if not dry_run:
        for pool, (_, networks) in pools.items():
            await engine.remove_pool(pool, None)
            for network in networks:
                await engine.remove_pool(pool, network)
    return Orphans(
        pools=tuple(sorted(pools)),
        containers=tuple(sorted(c for cs, _ in pools.values() for c in cs)),
        networks=tuple(sorted(n for _, ns in pools.values() for n in ns)),
        skipped=tuple(sorted(skipped - set(pools))),
    )


def remove_orphans(settings: ContainerSettings, dry_run: bool = False) -> Orphans:
    """Remove the containers and networks of pools whose client ran on this machine and is
    gone (for the settings' engine); what was found."""
    return asyncio.run(find_and_remove(settings, dry_run))
