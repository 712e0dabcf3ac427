"""The Lambda Cloud provider: GPU instances launched on Lambda for a pool and terminated
after it, reached over SSH with pinned host keys.

Acquiring a pool (:meth:`LambdaCloud.acquire`): list the instance types and the regions
with capacity (``GET /instance-types``), keep the types whose GPUs are the pool's
accelerator and count (``_accelerators.offered_as``: ``gpu_8x_a100_80gb_sxm4`` is 8 x
A100 80 GB SXM), cheapest first; refuse before launching when none fits or costs too much;
register the pool's login key (``POST /ssh-keys``) and launch every node in ONE call
(``quantity``: they share a region, so its private network) with cloud-init user-data that
installs the pool's SSH host key (pinned, never trusted on first use), the instance's
terminate script and the boot guard (``cloud.guard``); Lambda's "insufficient capacity"
moves to the next region, then the next type. The nodes' addresses are their private IPs.
An elastic pool (``nodes=Nodes(desired, max=..., min=...)``) registers the key and
launches nothing at its start: each node added is one launch of quantity 1 in the region
of the pool's instances (their private network; any region with room while it has none),
each node released (drained first) one instance terminated (``cloud.allocation``).

Lambda has no credential scoped to one instance: to end itself when the client is gone
(the watchdog ``ttl`` s after the last contact, the guard ``max(ttl, start_timeout)`` s
after the boot when no agent started) an instance gets ``ttl_api_key`` (default: the
account's key) in a root-only script, which finds the instance by its own addresses and
terminates it. Powering off would not do: Lambda bills a stopped instance until it is
terminated. ``flotilla down --orphans --provider lambda`` terminates what a dead client on
this machine left, and its SSH keys.
"""

from __future__ import annotations

from typing import Any

from ..._errors import ConfigurationError
from ..base import PoolSpec
from ..cloud.market import CloudOrphans, MarketProvider, check_ttl, launched, orphans_in
from ..cloud.rest import RestApi
from ..offers import Offer
from ..options import provider_init
from .api import connect, data, find
from .pool import LambdaAllocation, as_offers, candidates, delete_keys
from .settings import LambdaSettings


def configured() -> bool:
    """Whether this machine has a Lambda key (``market.configured``)."""
    return bool(find(None)[0])


class LambdaOrphans(CloudOrphans):
    """What :meth:`LambdaCloud.remove_orphans` found (and terminated unless a dry run)."""


class LambdaCloud(MarketProvider[LambdaSettings, RestApi]):
    """Run the nodes on Lambda Cloud GPU instances launched for the pool and terminated
    after it.

    Needs a Lambda API key (``api_key=`` or ``LAMBDA_API_KEY``) and OpenSSH's ``ssh`` and
    ``ssh-keygen``. The pool's ``accelerator`` (``"A100:8"``) selects the instance types.
    """

    name = "lambda"

    @provider_init(LambdaSettings)
    def __init__(self) -> None: ...

    def connect(self) -> RestApi:
        return connect(self.settings)

    def instances(self) -> list[Any]:
        return data(self.api.call("GET", "/instances", "list instances")) or []

    def validate(self, spec: PoolSpec) -> None:
        self.check()
        check_ttl(self, spec, "the instances would terminate themselves")
        if spec.accelerator is not None and spec.accelerator.fractional:
            raise ConfigurationError(f"Lambda has no fractions of a GPU: {spec.accelerator}")
        self._types(spec)

    def _types(self, spec: PoolSpec) -> list[Any]:
        types = data(self.api.call("GET", "/instance-types", "list instance types")) or {}
        return candidates(dict(types), spec, self.settings)

    def offers(self, spec: PoolSpec) -> list[Offer]:
        """What Lambda offers now for one node of ``spec``: each type in each region with
        capacity, cheapest first."""
        return [o for c in self._types(spec) for o in as_offers(c)]

    async def acquire(self, spec: PoolSpec) -> LambdaAllocation:
        ttl_key = self.settings.ttl_api_key or find(self.settings.api_key)[0]
        allocation = LambdaAllocation(self.settings, self.api, ttl_key, spec)
        return await launched(allocation, allocation.launch)

    def remove_orphans(self, dry_run: bool = False) -> LambdaOrphans:
        """Terminate the instances (found by their name) of pools whose client process on
        this machine is gone, and delete those pools' SSH keys and local key folders."""
        from ..cloud.identity import remove_dead_folders
        from .pool import FOLDER_PREFIX

        api = self.api
        live = [row for row in self.instances() if row.get("status") != "terminated"]
        pools, skipped, gone = orphans_in(live, "name")
        if not dry_run and gone:
            api.call(
                "POST",
                "/instance-operations/terminate",
                "terminate orphans",
                {"instance_ids": gone},
            )
            delete_keys(api, {f"flotilla-{p}" for p in pools})
        if not dry_run:
            remove_dead_folders(FOLDER_PREFIX)  # keys of killed clients' pools
        return LambdaOrphans(tuple(sorted(pools)), tuple(sorted(gone)), tuple(sorted(skipped)))
