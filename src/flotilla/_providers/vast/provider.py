"""The Vast.ai provider: GPU instances rented on Vast's marketplace for a pool and
destroyed after it, reached over SSH with pinned host keys.

Acquiring a pool (:meth:`VastAI.acquire`): search the offers that fit one node
(``choice``: accelerator type and count, vCPUs, memory, disk, reliability, region, cheapest
first), choose ``nodes`` machines (for a cluster pool of several nodes, all in one physical
cluster), refuse before renting when nothing fits or the choice costs more than
``max_hourly_cost``; create the pool's overlay network on that cluster; rent every offer at
once (``PUT /asks/{id}/``, label ``flotilla:{pool}:{client}``, an on-start script that
installs the pool's SSH host key and a guard, see ``onstart``), attach the pool's login key,
join each instance to the overlay, and wait until all run with their SSH port mapped.

An instance is then an SSH host at its public address and mapped port, whose host key is
pinned (never trusted on first use); the launch layer starts the agents there. Peers and
``head_addr`` are the overlay addresses (a cluster pool), so distributed frameworks talk
over the overlay network.

Nothing is left: :meth:`VastAllocation.release` (end of the block, an exception, Ctrl-C)
destroys every instance of the pool (also ones a lost answer did not report, found by
label) and deletes the overlay. A client killed with SIGKILL leaves instances that destroy
themselves: the agent's watchdog ``ttl`` s after the client's last contact, the on-start
guard ``max(ttl, start_timeout)`` s after the start when no agent started; both with the
key Vast gives the instance for itself. ``flotilla down --orphans --provider vast``
(:meth:`VastAI.remove_orphans`) destroys what a dead client on this machine left.
"""

from __future__ import annotations

from typing import Any

from ..._errors import ConfigurationError
from ..base import PoolSpec
from ..cloud.identity import remove_dead_folders
from ..cloud.keys import KeyPair
from ..cloud.market import CloudOrphans, MarketProvider, check_ttl, launched, orphans_in
from ..offers import Offer
from ..options import provider_init
from .api import VastApi, connect, find_key, find_url
from .choice import as_offer, query
from .pool import FOLDER_PREFIX, VastAllocation
from .settings import VastSettings


def configured() -> bool:
    """Whether this machine has a Vast key (``market.configured``)."""
    return bool(find_key(None)[0])


class VastOrphans(CloudOrphans):
    """What :meth:`VastAI.remove_orphans` found (and destroyed unless a dry run): its
    ``instances`` are instance ids (int)."""


class VastAI(MarketProvider[VastSettings, VastApi]):
    """Run the nodes on Vast.ai instances rented for the pool and destroyed after it.

    Needs a Vast API key (``api_key=``, ``VAST_API_KEY`` or ``vastai set api-key``) and
    OpenSSH's ``ssh`` and ``ssh-keygen`` on this machine. The pool's ``accelerator``,
    ``vcpus`` and ``memory_gb`` select the offers; the cheapest that fit are rented.
    """

    name = "vast"
    elastic = True
    """Elastic pools: an instance is rented per node added (on another machine of the
    pool's cluster: the one chosen where ``max`` nodes fit) and destroyed per node
    released; a pool born empty rents none until its first call."""

    @provider_init(VastSettings)
    def __init__(self) -> None: ...

    def connect(self) -> VastApi:
        return connect(self.settings)

    def instances(self) -> list[Any]:
        listed = self.api.call("GET", "/instances", "list instances", owner="me")
        return list(listed.get("instances", []))

    def validate(self, spec: PoolSpec) -> None:
        _ = self.api  # a key, before anything else
        check_ttl(self, spec, "the instances would destroy themselves")
        _check_onstart(find_url(self.settings.url), self.settings, spec)
        if spec.vcpus is not None and spec.vcpus <= 0:
            raise ConfigurationError(f"vcpus={spec.vcpus!r}: a positive number")
        if spec.memory_gb is not None and spec.memory_gb <= 0:
            raise ConfigurationError(f"memory_gb={spec.memory_gb!r}: a positive number")

    def offers(self, spec: PoolSpec) -> list[Offer]:
        """What Vast offers now for one node of ``spec``, cheapest first."""
        reply = self.api.call("POST", "/bundles/", "search offers", query(spec, self.settings))
        return [as_offer(o) for o in reply.get("offers", [])]

    async def acquire(self, spec: PoolSpec) -> VastAllocation:
        allocation = VastAllocation(self.settings, self.api, spec, self.api.url)
        return await launched(allocation, allocation.launch)

    def remove_orphans(self, dry_run: bool = False) -> VastOrphans:
        """Destroy the instances (found by their label) of pools whose client process on
        this machine is gone, and the local key folders of pools whose client is gone.
        Pools of clients on other machines are listed in ``skipped``, not touched (their
        instances destroy themselves after ``ttl``)."""
        api = self.api
        pools, skipped, found = orphans_in(self.instances(), "label")
        gone = [int(i) for i in found]
        if not dry_run:
            for ident in gone:
                api.call("DELETE", f"/instances/{ident}/", f"destroy instance {ident}")
            overlays = api.call("GET", "/overlay/", "list overlay networks")
            for o in overlays if isinstance(overlays, list) else []:
                if str(o.get("name", "")).removeprefix("flotilla-") in pools:
                    api.call(
                        "DELETE", "/overlay/", "delete an overlay", {"overlay_name": o["name"]}
                    )
            remove_dead_folders(FOLDER_PREFIX)  # keys of killed clients' pools
        return VastOrphans(tuple(sorted(pools)), tuple(sorted(gone)), tuple(sorted(skipped)))


class _SizedKey(KeyPair):
    """A stand-in ed25519 key of the real one's size (the on-start script's length)."""

    def private(self) -> str:
        return "\n".join(
            [
                "-----BEGIN OPENSSH PRIVATE KEY-----",
                *["x" * 70] * 5,
                "x" * 20,
                "-----END OPENSSH PRIVATE KEY-----",
            ]
        )


def _check_onstart(url: str, settings: VastSettings, spec: PoolSpec) -> None:
    """Refuse, before anything is rented, settings whose on-start script Vast would not
    take (see ``onstart``)."""
    from .onstart import onstart_script

    key = _SizedKey("", "ssh-ed25519 " + "x" * 68 + " flotilla")
    try:
        onstart_script(
            spec.pool_id, key, url, settings.workdir, settings.ttl, spec.options.start_timeout
        )
    except ValueError as e:  # a URL the script cannot quote
        raise ConfigurationError(f"VastAI(url=...): {e}") from None
