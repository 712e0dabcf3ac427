"""The Verda provider (formerly DataCrunch): GPU instances created on Verda for a pool and
deleted after it, reached over SSH with pinned host keys.

Acquiring a pool (:meth:`Verda.acquire`): list the instance types with their prices
(``GET /instance-types``) and the locations where each is available (``GET
/instance-availability``, spot apart), keep the types whose GPUs are the pool's
accelerator and count (``_accelerators.offered_as`` on the GPU description: ``8x H100
SXM5 80GB`` is 8 x H100 80 GB SXM), cheapest first; refuse before creating anything when
none fits or costs too much. Register the pool's login key (``POST /sshkeys``), make a
startup script (``POST /scripts``) that installs the pool's SSH host key (pinned, never
trusted on first use), the login key, the instance's delete script and the boot guard
(``cloud.guard``), and create the N instances in ONE location (``POST /instances``, one
each). A location without room for all of them ("not available") gives back what it took
and the next location, then the next type (then on-demand after spot for
``allocation="spot-if-available"``), is tried; none left is a CAPACITY ProvisionError, so
a provider list moves on. The startup script, which holds the host key, is deleted once
the instances run. An elastic pool (``nodes=Nodes(desired, max=..., min=...)``) registers
the key and creates nothing at its start: each node added is one instance (its own startup
script) in the location of the pool's instances (any while it has none), each node
released (drained first) one instance deleted (``cloud.allocation``).

Network: Verda gives each instance a public IPv4 address and no private network between
separate instances (its Instant Clusters have one; not used): the nodes reach each other
at their public addresses, which are also where the client's SSH goes.

Verda has no credential scoped to one instance: to end itself when the client is gone
(the watchdog ``ttl`` s after the last contact, the guard ``max(ttl, start_timeout)`` s
after the boot when no agent started) an instance gets ``ttl_client_id``/
``ttl_client_secret`` (default: the pool's) in a root-only script, which finds the
instance by its own addresses and deletes it (Verda bills a shut-down instance, so
powering off would not do). ``flotilla down --orphans --provider verda`` deletes what a
dead client on this machine left, its SSH keys and startup scripts.

A named cluster's pool can be shut down (``flotilla stop``: ``PUT /instances`` action
``shutdown``, the OS volumes kept) and started again (action ``start``) by the next pool,
the recorded host keys pinned: ``stopstart``.
"""

from __future__ import annotations

from typing import Any

from ..._errors import ConfigurationError
from ..base import PoolSpec
from ..cloud.kept import KeptPool
from ..cloud.market import CloudOrphans, MarketProvider, check_stoppable, check_ttl, orphans_in
from ..cloud.rest import ApiError
from ..cloud.stopstart import acquired
from ..offers import Offer
from ..options import provider_init
from .api import VerdaApi, connect, find
from .pool import VerdaAllocation, as_offers, candidates, delete_keys, delete_scripts
from .settings import VerdaSettings


def configured() -> bool:
    """Whether this machine has Verda client credentials (``market.configured``)."""
    return bool(find(None, None)[0])


class VerdaOrphans(CloudOrphans):
    """What :meth:`Verda.remove_orphans` found (and deleted unless a dry run)."""


class Verda(MarketProvider[VerdaSettings, VerdaApi]):
    """Run the nodes on Verda GPU instances created for the pool and deleted after it.

    Needs Verda API client credentials (``client_id=``/``client_secret=`` or
    ``VERDA_CLIENT_ID``/``VERDA_CLIENT_SECRET``) and OpenSSH's ``ssh`` and
    ``ssh-keygen``. The pool's ``accelerator`` (``"A100:8"``) selects the instance types.
    """

    name = "verda"
    accepted = "credentials"

    @provider_init(VerdaSettings)
    def __init__(self) -> None: ...

    def connect(self) -> VerdaApi:
        return connect(self.settings)

    def instances(self) -> list[Any]:
        return self.api.call("GET", "/instances", "list instances") or []

    def validate(self, spec: PoolSpec) -> None:
        self.check()
        check_ttl(self, spec, "the instances would delete themselves")
        check_stoppable(self, spec)
        if spec.accelerator is not None and spec.accelerator.fractional:
            raise ConfigurationError(f"Verda has no fractions of a GPU: {spec.accelerator}")
        self._types(spec)

    def _types(self, spec: PoolSpec) -> list[Any]:
        api = self.api
        types = api.call("GET", "/instance-types", "list instance types", query={"currency": "usd"})
        demand = api.call(
            "GET", "/instance-availability", "list availability", query={"isSpot": "false"}
        )
        spot = api.call(
            "GET", "/instance-availability", "list spot availability", query={"isSpot": "true"}
        )
        return candidates(types, demand, spot, spec, self.settings)

    def offers(self, spec: PoolSpec) -> list[Offer]:
        """What Verda offers now for one node of ``spec``: each type in each location
        listing it (on-demand and spot), cheapest first."""
        return sorted(
            (o for c in self._types(spec) for o in as_offers(c)),
            key=lambda o: (o.hourly is None, o.hourly or 0.0),
        )

    async def acquire(self, spec: PoolSpec) -> VerdaAllocation:
        s = self.settings
        ttl = (s.ttl_client_id, s.ttl_client_secret)
        if ttl[0] is None or ttl[1] is None:
            ident, secret, _ = find(s.client_id, s.client_secret)
            ttl = (ident, secret)
        allocation = VerdaAllocation(s, self.api, (str(ttl[0]), str(ttl[1])), spec)
        return await acquired(allocation, self.keep, allocation.launch)

    def remove_kept(self, kept: KeptPool) -> None:
        """Delete a shut-down pool's instances, as a pool's release does."""
        try:
            self.api.call(
                "PUT", "/instances", "delete instances", {"id": kept.ids, "action": "delete"}
            )
        except ApiError as e:
            if e.status != 404:
                raise

    def remove_orphans(self, dry_run: bool = False) -> VerdaOrphans:
        """Delete the instances (found by their description) of pools whose client process
        on this machine is gone, and those pools' SSH keys, startup scripts and local key
        folders (also of a dead client's pool whose instances already deleted
        themselves)."""
        import os
        import shutil

        from ..cloud.identity import dead_folders
        from .pool import FOLDER_PREFIX
        from .stopstart import STOPPED, adopted

        api = self.api
        rows = self.instances()
        # a stopped cluster's instances (shut down, or started again by a live pool here)
        # are no orphans: `flotilla down NAME` removes them
        kept = adopted(FOLDER_PREFIX)
        live = [
            r
            for r in rows
            if r.get("status") not in ("deleted", "deleting", STOPPED) and str(r["id"]) not in kept
        ]
        pools, skipped, gone = orphans_in(live, "description")
        if dry_run:
            return VerdaOrphans(tuple(sorted(pools)), tuple(sorted(gone)), tuple(sorted(skipped)))
        if gone:
            api.call("PUT", "/instances", "delete orphans", {"id": gone, "action": "delete"})
        folders = dead_folders(FOLDER_PREFIX)  # killed clients' pools: their local keys
        dead = {os.path.basename(f)[len(FOLDER_PREFIX) :].rsplit("-", 1)[0] for f in folders}
        if pools | dead:
            delete_keys(api, {f"flotilla-{p}" for p in pools | dead})
            delete_scripts(api, pools | dead)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        return VerdaOrphans(tuple(sorted(pools)), tuple(sorted(gone)), tuple(sorted(skipped)))
