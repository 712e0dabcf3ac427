"""The RunPod provider: GPU pods rented on RunPod for a pool and terminated after it,
reached over SSH with pinned host keys.

Acquiring a pool (:meth:`RunPod.acquire`): list RunPod's GPU types and prices (GraphQL
``gpuTypes``), keep those the pool's accelerator names in the clouds and markets asked for
(``choice``), refuse before renting when nothing fits or costs too little; create the
pods one after the other through REST v1 (``POST /pods``: the GPU type, cloud, data
center, ``interruptible`` for spot, ``globalNetworking`` so that the pods reach each
other, the login key as ``PUBLIC_KEY`` and a start command that installs the pool's SSH
host key and a guard, see ``cloud/selfdestruct.py``); RunPod's "no instances available"
moves to the next data center, then the next GPU type; wait until every pod runs with its
port 22 mapped to a public port.

An elastic pool (``nodes=Nodes(desired, max=..., min=...)``) creates no pod at its
start: each node added is one pod created as above (the candidates and data centers
walked from the first; a capacity error leaves the pool at its size, and it tries again),
each node released (drained first) one pod terminated (``cloud.allocation``).

A pod is then an SSH host at its public address and mapped port whose host key is pinned
(never trusted on first use). The nodes' addresses are the pods' names on RunPod's global
network, ``{pod id}.runpod.internal``: distributed frameworks talk over it.

Nothing is left: :meth:`RunPodAllocation.release` (the end of the block, an exception,
Ctrl-C) terminates every pod of the pool (also ones a lost answer did not report, found by
name). A client killed with SIGKILL leaves pods that terminate themselves with the key
RunPod gives each pod for itself (``RUNPOD_API_KEY`` inside the pod, scoped to it): the
agent's watchdog ``ttl`` s after the client's last contact, the start command's guard
``max(ttl, start_timeout)`` s after the start when no agent started. ``flotilla down
--orphans --provider runpod`` (:meth:`RunPod.remove_orphans`) terminates what a dead
client on this machine left.
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
from .api import RunPodApi, connect, find
from .choice import GPU_TYPES, as_offer, candidates
from .pool import RunPodAllocation
from .settings import RunPodSettings


def configured() -> bool:
    """Whether this machine has a RunPod key (``market.configured``)."""
    return bool(find(None)[0])


class RunPodOrphans(CloudOrphans):
    """What :meth:`RunPod.remove_orphans` found (and terminated unless a dry run): its
    ``instances`` are pod ids, also called ``pods``."""

    @property
    def pods(self) -> tuple[str, ...]:
        return self.instances


class RunPod(MarketProvider[RunPodSettings, RunPodApi]):
    """Run the nodes on RunPod GPU pods rented for the pool and terminated after it.

    Needs a RunPod API key (``api_key=``, ``RUNPOD_API_KEY`` or ``runpod config``) and
    OpenSSH's ``ssh`` and ``ssh-keygen`` on this machine. The pool's ``accelerator``
    (required) selects the GPU types; the cheapest that has room is rented.
    """

    name = "runpod"

    @provider_init(RunPodSettings)
    def __init__(self) -> None: ...

    def connect(self) -> RunPodApi:
        return connect(self.settings)

    def check(self) -> str:
        """Whether the key works: the account it opens, or a ConfigurationError saying
        why not (naming where the key came from)."""
        api = self.api
        me = api.query("query { myself { id } }", "read the account").get("myself") or {}
        pods = self.instances()
        return f"key accepted by {api.url} (account {me.get('id', '?')}, {len(pods)} pod(s))"

    def instances(self) -> list[Any]:
        return self.api.call("GET", "/pods", "list pods") or []

    def validate(self, spec: PoolSpec) -> None:
        """A key the API accepts, ssh, a TTL longer than the heartbeat, and an
        accelerator RunPod has: all before anything is rented."""
        self.check()
        check_ttl(self, spec, "the pods would terminate themselves")
        check_stoppable(self, spec)
        if spec.most > 1 and spec.options.cluster and not self.settings.global_networking:
            raise ConfigurationError(
                "a cluster pool of several RunPod pods needs RunPod(global_networking=True): "
                "without it the pods cannot reach each other"
            )
        self._types(spec)

    def _types(self, spec: PoolSpec, listing: bool = False) -> list[Any]:
        types = self.api.query(GPU_TYPES, "list GPU types").get("gpuTypes") or []
        return candidates(list(types), spec, self.settings, listing)

    def offers(self, spec: PoolSpec) -> list[Offer]:
        """What RunPod offers now for one node of ``spec`` (every GPU type when it names
        no accelerator), cheapest first."""
        return [as_offer(c) for c in self._types(spec, listing=True)]

    async def acquire(self, spec: PoolSpec) -> RunPodAllocation:
        """The pool's pods: a stoppable pool's stopped ones resumed (see ``stopstart``),
        else new ones."""
        allocation = RunPodAllocation(self.settings, self.api, spec)
        return await acquired(allocation, self.keep, allocation.launch)

    def remove_kept(self, kept: KeptPool) -> None:
        """Terminate a stopped pool's pods (and their volumes)."""
        for ident in kept.ids:
            try:
                self.api.call("DELETE", f"/pods/{ident}", f"terminate pod {ident}")
            except ApiError as e:
                if e.status != 404:
                    raise

    def remove_orphans(self, dry_run: bool = False) -> RunPodOrphans:
        """Terminate the pods (found by their name) of pools whose client process on this
        machine is gone. Pools of clients on other machines are listed in ``skipped``, not
        touched (their pods terminate themselves after ``ttl``). The local key folders of
        pools whose client is gone are removed too."""
        from ..cloud.identity import remove_dead_folders
        from .pool import FOLDER_PREFIX

        rows = self.instances()
        # a stopped cluster's pods (EXITED; an outbid spot pod is EXITED too, and is an
        # orphan) are no orphans: `flotilla down NAME` removes them
        rows = [r for r in rows if r.get("desiredStatus") != "EXITED" or r.get("interruptible")]
        pools, skipped, gone = orphans_in(rows, "name")
        if not dry_run:
            for ident in gone:
                self.api.call("DELETE", f"/pods/{ident}", f"terminate pod {ident}")
            remove_dead_folders(FOLDER_PREFIX)  # keys of killed clients' pools
        return RunPodOrphans(tuple(sorted(pools)), tuple(sorted(gone)), tuple(sorted(skipped)))
