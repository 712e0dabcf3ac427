"""The Google Cloud provider: Compute Engine instances created for a pool and deleted
after it, reached over SSH with the host keys their guest agent publishes pinned.

Acquiring a pool (:meth:`GCP.acquire`): the machine type that carries the pool's
accelerators (``choice``), refused before anything is created when GCP has no such
accelerator or count, or when its list price is above ``max_hourly_cost``; the zones that
offer it (``GCP(zone=...)``, else every zone of ``region`` that lists the machine type and
accelerator type); in the first zone, every instance at once (``insert``, label
``flotilla-pool``, the client's identity in the metadata, the pool's login key in
``ssh-keys``, a startup script with self-deletion and the boot guard, see ``startup``).
A zone out of capacity (``ZONE_RESOURCE_POOL_EXHAUSTED``) has its instances deleted and the
pool moves to the next zone; none left: a ProvisionError (cause CAPACITY), which moves a
provider list (``Compute(provider=[GCP(), ...])``) to its next candidate.

An elastic pool (``nodes=Nodes(desired, max=..., min=...)``) creates no instance at its
start: each node added is one instance, in the zone of the pool's instances when it has
room, else the next zone of the list (the VPC network spans them), each node released
(drained first) one instance deleted (``cloud.allocation``).

The nodes share one VPC network: peers and ``head_addr`` are the internal addresses
(``networkIP``); the client reaches each instance at its external address (``natIP``)
on port 22, with the host keys from its guest attributes pinned (never trusted on first
use).

Nothing is left: the release (end of the block, an exception, Ctrl-C) deletes every
instance of the pool (also ones a lost answer did not report, found by label). A client
killed with SIGKILL leaves instances that delete themselves with their own service
account: the agent's watchdog ``ttl`` s after the client's last contact, the startup
script's guard ``max(ttl, start_timeout)`` s after the boot when no agent started. ``flotilla
down --orphans --provider gcp`` (:meth:`GCP.remove_orphans`) deletes what a dead client on
this machine left. SPOT instances (``allocation="spot"``) are deleted when preempted; the
preemption is noticed on the node (the metadata server's ``instance/preempted``) and the
node replaced.
"""

from __future__ import annotations

from typing import Any

from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..base import PoolSpec
from ..cloud.identity import remove_dead_folders
from ..cloud.kept import KeptPool
from ..cloud.market import CloudOrphans, MarketProvider, check_stoppable, check_ttl, find_orphans
from ..cloud.stopstart import acquired
from ..offers import Offer
from ..options import provider_init
from .api import GcpApi, base_url
from .api import configured as configured
from .choice import as_offer, machine_for
from .pool import FOLDER_PREFIX, POOL_LABEL, GCPAllocation, delete_instance, markets
from .settings import GCPSettings
from .stopstart import CLIENT_KEY


class GCPOrphans(CloudOrphans):
    """What :meth:`GCP.remove_orphans` found (and deleted unless a dry run): its
    ``instances`` are ``zone/name``."""


class GCP(MarketProvider[GCPSettings, GcpApi]):
    """Run the nodes on Compute Engine instances created for the pool and deleted after it.

    Needs Google's client (``pip install 'flotilla[gcp]'``), Application Default
    Credentials (``GOOGLE_APPLICATION_CREDENTIALS`` or ``gcloud auth application-default
    login``), a project, and OpenSSH's ``ssh`` and ``ssh-keygen`` on this machine.
    """

    name = "gcp"
    _checked = False  # the credentials were accepted

    @provider_init(GCPSettings)
    def __init__(self) -> None: ...

    def connect(self) -> GcpApi:
        return GcpApi(self.settings)

    def check(self) -> str:
        """Whether the credentials work: a description, or a ConfigurationError naming
        where they came from (ProvisionError when the API does not answer)."""
        said = self.api.check()
        self._checked = True
        return said

    def validate(self, spec: PoolSpec) -> None:
        from .startup import startup_script

        machine_for(spec, self.settings.machine_type)  # an accelerator GCP has
        check_ttl(self, spec, "the instances would delete themselves")
        check_stoppable(self, spec)
        try:
            startup_script(base_url(self.settings), 1, 1, self.settings.workdir, "x")
        except ValueError as e:
            raise ConfigurationError(f"GCP(api_endpoint=...): {e}") from None
        if not self._checked:  # credentials refused: before anything is created
            self.check()

    def zones(self, spec: PoolSpec) -> list[str]:
        """The zones to try, in order: ``zone``, else those of ``region`` that offer the
        pool's machine type (and attached accelerator type)."""
        if self.settings.zone:
            return [self.settings.zone]
        choice = machine_for(spec, self.settings.machine_type)
        api = self.api
        region = self.settings.region

        def scan() -> list[str]:
            machines = api.client("MachineTypesClient").aggregated_list(project=api.project)
            zones = {
                key.rsplit("/", 1)[-1]
                for key, scoped in machines
                if any(m.name == choice.machine_type for m in scoped.machine_types)
            }
            if choice.attached:
                accs = api.client("AcceleratorTypesClient").aggregated_list(project=api.project)
                zones &= {
                    key.rsplit("/", 1)[-1]
                    for key, scoped in accs
                    if any(a.name == choice.accelerator for a in scoped.accelerator_types)
                }
            return sorted(z for z in zones if z.startswith(region + "-"))

        return api.call(f"list the zones offering {choice.machine_type}", scan)

    def offers(self, spec: PoolSpec) -> list[Offer]:
        """What GCP offers for one node of ``spec``: its machine in each zone that has it
        (list prices)."""
        choice = machine_for(spec, self.settings.machine_type)
        zones = self.zones(spec)
        return [as_offer(choice, z, spot) for spot in markets(self.settings) for z in zones]

    async def acquire(self, spec: PoolSpec) -> GCPAllocation:
        """The pool's instances: a stoppable pool's stopped ones started again (see
        ``stopstart``), else new ones in the first zone with room."""
        allocation = GCPAllocation(self.settings, self.api, spec)

        async def launch() -> None:
            zones = await allocation._in_thread(self.zones, spec)
            if not zones:
                raise ProvisionError(
                    f"GCP: no zone of {self.settings.region} offers "
                    f"{allocation.choice.machine_type}: try another GCP(region=...)",
                    cause=ProvisionCause.CAPACITY,
                )
            await allocation.launch(zones)

        return await acquired(allocation, self.keep, launch)

    def remove_kept(self, kept: KeptPool) -> None:
        """Delete a stopped pool's instances (and their disks)."""
        import time

        deadline = time.monotonic() + 300
        for name in kept.ids:
            delete_instance(self.api, kept.place, name, deadline)

    def remove_orphans(self, dry_run: bool = False) -> GCPOrphans:
        """Delete the instances (found by their label) of pools whose client process on
        this machine is gone, and the local key folders of pools whose client is gone.
        Pools of clients on other machines are listed in ``skipped``, not touched (their
        instances delete themselves after ``ttl``)."""
        import time

        from google.cloud import compute_v1 as c

        api = self.api
        instances = api.client("InstancesClient")
        request = c.AggregatedListInstancesRequest(
            project=api.project, filter=f"labels.{POOL_LABEL}:*"
        )
        rows = api.call("list instances", lambda: list(instances.aggregated_list(request=request)))

        def found() -> Any:
            for key, scoped in rows:
                zone = key.rsplit("/", 1)[-1]
                for inst in scoped.instances:
                    if inst.status in ("STOPPING", "TERMINATED"):
                        continue  # a stopped cluster's (`flotilla down NAME` removes it)
                    pool = inst.labels.get(POOL_LABEL, "")
                    items = inst.metadata.items if inst.metadata else []
                    client = next((i.value for i in items if i.key == CLIENT_KEY), "")
                    if pool:
                        yield pool, client, (zone, inst.name)

        pools, skipped, gone = find_orphans(found())
        if not dry_run:
            deadline = time.monotonic() + 300
            for zone, name in gone:
                delete_instance(api, zone, name, deadline)
            remove_dead_folders(FOLDER_PREFIX)  # keys of killed clients' pools
        return GCPOrphans(
            tuple(sorted(pools)), tuple(f"{z}/{n}" for z, n in sorted(gone)), tuple(sorted(skipped))
        )
