"""The Compute Engine instances of one pool: create, reach, replace, delete (see
``provider``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import shutil
import time
import uuid
from functools import partial
from typing import Any

from ..._errors import ProvisionCause, ProvisionError
from ..._wire.protocol import CLOUD_ENV
from ..base import AgentProcess, AllocationState, Machine, MachineState, PoolSpec
from ..cloud import login
from ..cloud.allocation import show
from ..cloud.guard import contact_path
from ..cloud.identity import client_id, pool_folder
from ..cloud.keys import pin_public
from ..cloud.notice import watch_notices
from ..ssh_shell import Target
from .api import SCOPE, GcpApi, GcpApiError, base_url
from .choice import MachineChoice, describe, machine_for, within_cost
from .settings import GCPSettings
from .startup import METADATA, SELF_DELETE, startup_script
from .stopstart import CLIENT_KEY, GCPStopping

logger = logging.getLogger("flotilla.gcp")

FOLDER_PREFIX = "flotilla-gcp-"
POOL_LABEL = "flotilla-pool"
"""Every instance of a pool has the label ``flotilla-pool={pool id}``."""
POLL = 0.2
RELEASE_TIMEOUT = 300.0
GPU_IMAGE = (
    "projects/deeplearning-platform-release/global/images/family/"
    "common-cu128-ubuntu-2204-nvidia-570"
)
CPU_IMAGE = "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64"


def instance_name(pool_id: str, rank: int, launch: int) -> str:
    """``flotilla-{pool}-{rank}`` (``-{launch}`` for a replacement): a valid GCE name."""
    return f"flotilla-{pool_id}-{rank}" + (f"-{launch}" if launch > 1 else "")


class GCPAllocation(GCPStopping):
    """The instances of one pool, all in one zone of one VPC network (a named cluster's
    can be stopped and started again: ``stopstart``; an elastic pool's come and go one at
    a time: ``cloud.allocation.InstanceAllocation``).

    Attributes:
        choice: the machine of every node.
        zone: the zone the pool is in ("" until chosen; an elastic pool's instances may be
            in several zones of its region, all on its VPC network).
        spot: its instances are SPOT ones (an elastic pool's first market).
        zones: the zones to try, in order.
        markets: whether to try SPOT (True) and on-demand (False), in order.
        spot_names: the instances that are SPOT ones.
        instances: instance name -> its last description (a dict), for every instance made.
    """

    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=16, thread_name_prefix="flotilla-gcp"
    )

    def __init__(self, settings: GCPSettings, api: GcpApi, spec: PoolSpec) -> None:
        super().__init__(spec, [])
        self.state = AllocationState.ACQUIRING
        self.settings = settings
        self.api = api
        self.choice: MachineChoice = machine_for(spec, settings.machine_type)
        self.zone = ""
        self.spot = settings.allocation == "spot"
        self.zones: list[str] = []
        self.markets = markets(settings)
        self.spot_names: set[str] = set()
        self.zones_tried: list[str] = []
        self.instances: dict[str, dict[str, Any]] = {}
        self.pinned: dict[str, list[str]] = {}
        self._open(settings, pool_folder(FOLDER_PREFIX, spec.pool_id))
        self.client = client_id()
        self._launches = itertools.count(2)  # a node added or replaced: its name's suffix

    # -- launch ------------------------------------------------------------------------
    async def launch(self, zones: list[str]) -> None:
        """Create the pool's instances in the first of ``zones`` that has room for all of
        them (a zone out of capacity: its instances are deleted, the next is tried); an
        elastic pool's (``spec.nodes`` 0) one by one as it grows (:meth:`create_one`)."""
        spec = self.spec
        within_cost(self.choice, spec, self.markets[-1])
        await self._make_login_key()
        self.zones = zones
        self.spot = self.markets[0]
        price = self.choice.hourly(self.markets[0])
        cost = f", ${price:.2f}/h a node (list price)" if price else ""
        what = describe(spec.accelerator, self.choice) + (" (SPOT)" if self.markets[0] else "")
        if self.starts_empty(logger, "GCP", f"x {what}", f", in {', '.join(zones)}{cost}"):
            return
        full: list[str] = []
        for spot, zone in self._places():
            self.spot = spot
            price = self.choice.hourly(spot)
            cost = f", ${price * spec.nodes:.2f}/h for the pool (list price)" if price else ""
            _show(
                f"GCP: {spec.nodes} x {describe(spec.accelerator, self.choice)}"
                f"{' (SPOT)' if spot else ''} in {zone}{cost}"
            )
            names = [instance_name(spec.pool_id, r, 1) for r in range(spec.nodes)]
            try:
                await self._create(zone, names, spot)
            except GcpApiError as e:
                if not _full(e):
                    raise
                full.append(_where(zone, spot, e))
                _show(f"GCP: {zone} has no room for the pool: {e}; trying the next zone")
                await self._in_thread(self._delete_all, [zone])
                continue
            self.zone = zone
            break
        else:
            raise ProvisionError(
                f"GCP: no zone had room for {spec.nodes} x {self.choice.machine_type}: "
                f"{', '.join(full) or 'no zone offers it'}",
                cause=ProvisionCause.CAPACITY,
            )
        self.machines = [
            self._machine(r, self.instances[instance_name(spec.pool_id, r, 1)])
            for r in range(spec.nodes)
        ]
        self.state = AllocationState.READY

    def _places(self) -> list[tuple[bool, str]]:
        """(SPOT, zone) to try, in order: each market in turn, the zones of the pool's
        instances first (an elastic pool's), then :attr:`zones`."""
        have = {_zone(self.instances.get(n, {})) for n in list(self.costs)}
        zones = sorted(self.zones, key=lambda z: z not in have)
        return [(spot, zone) for spot in self.markets for zone in zones]

    def _script(self) -> str:
        settings = self.settings
        return startup_script(
            base_url(settings),
            settings.ttl,
            self.spec.options.start_timeout,
            settings.workdir,
            settings.ssh_user,
        )

    async def _create(self, zone: str, names: list[str], spot: bool) -> None:
        """Insert ``names`` in ``zone`` at once, wait for their operations, then until each
        runs with its external address and host keys (which are pinned)."""
        assert self.login_key is not None
        script = self._script()
        deadline = time.monotonic() + self.spec.options.start_timeout
        results = await asyncio.gather(
            *(self._in_thread(self._insert, zone, n, script, deadline, spot) for n in names),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # a capacity error first: the zone is full
            failed.sort(key=lambda e: getattr(e, "cause", None) is not ProvisionCause.CAPACITY)
            raise failed[0]
        await asyncio.gather(*(self._in_thread(self._wait_ready, zone, n, deadline) for n in names))

    def _body(self, zone: str, name: str, script: str, spot: bool) -> Any:
        from google.cloud import compute_v1 as c

        settings, choice = self.settings, self.choice
        assert self.login_key is not None
        image = settings.image or (GPU_IMAGE if choice.gpus else CPU_IMAGE)
        nic = c.NetworkInterface(
            network=f"global/networks/{settings.network}",
            access_configs=[c.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")],
        )
        if settings.subnet:
            nic.subnetwork = f"regions/{zone.rsplit('-', 1)[0]}/subnetworks/{settings.subnet}"
        items = {
            "ssh-keys": f"{settings.ssh_user}:{self.login_key.public}",
            "block-project-ssh-keys": "TRUE",
            "enable-guest-attributes": "TRUE",
            "startup-script": script,
            CLIENT_KEY: self.client,
        }
        if spot:
            scheduling = c.Scheduling(
                provisioning_model="SPOT",
                instance_termination_action="DELETE",
                automatic_restart=False,
                on_host_maintenance="TERMINATE",
            )
        else:
            scheduling = c.Scheduling(on_host_maintenance="TERMINATE" if choice.gpus else "MIGRATE")
        body = c.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{choice.machine_type}",
            labels={POOL_LABEL: self.spec.pool_id},
            disks=[
                c.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    initialize_params=c.AttachedDiskInitializeParams(
                        source_image=image,
                        disk_size_gb=int(settings.disk_size_gb),
                        disk_type=f"zones/{zone}/diskTypes/{settings.disk_type}",
                    ),
                )
            ],
            network_interfaces=[nic],
            metadata=c.Metadata(items=[c.Items(key=k, value=v) for k, v in items.items()]),
            service_accounts=[
                c.ServiceAccount(email=settings.service_account or "default", scopes=[SCOPE])
            ],
            scheduling=scheduling,
        )
        if choice.attached:
            body.guest_accelerators = [
                c.AcceleratorConfig(
                    accelerator_type=f"zones/{zone}/acceleratorTypes/{choice.accelerator}",
                    accelerator_count=choice.gpus,
                )
            ]
        return body

    def _insert(self, zone: str, name: str, script: str, deadline: float, spot: bool) -> None:
        """Insert instance ``name`` in ``zone`` and wait for its operation; it is then
        billed (GcpApiError, CAPACITY, when the zone has no room)."""
        from google.cloud import compute_v1 as c

        if zone not in self.zones_tried:
            self.zones_tried.append(zone)
        api = self.api
        instances = api.client("InstancesClient")
        request = c.InsertInstanceRequest(
            project=api.project,
            zone=zone,
            instance_resource=self._body(zone, name, script, spot),
            request_id=str(uuid.uuid4()),  # the same on a retry: one instance, not two
        )
        with self.creating("instance", name):
            self.instances[name] = {"name": name, "zone": zone}
            op = api.call(
                f"create instance {name}", lambda: instances.insert_unary(request=request)
            )
        api.wait(zone, op, f"create instance {name}", deadline)
        if spot:
            self.spot_names.add(name)
        self.billed(name, self.choice.hourly(spot))

    def _wait_ready(self, zone: str, name: str, deadline: float) -> None:
        """Until ``name`` is RUNNING with an external address and has published its host
        keys (guest attributes); they are pinned for that address."""
        api = self.api
        instances = api.client("InstancesClient")
        row: dict[str, Any] = {}

        def step() -> bool:
            nonlocal row
            inst = api.call(
                f"look up instance {name}",
                lambda: instances.get(project=api.project, zone=zone, instance=name),
            )
            row = type(inst).to_dict(inst)
            self.instances[name] = row
            if row.get("status") == "RUNNING" and _nat_ip(row):
                keys = self._host_keys(zone, name)
                if keys:
                    for key in keys:
                        pin_public(self.known_hosts, _nat_ip(row), key)
                    self.pinned[name] = keys
                    return True
            if row.get("status") in ("STOPPING", "TERMINATED", "SUSPENDED"):
                raise ProvisionError(
                    f"GCP: instance {name} is {row.get('status')} while starting",
                    cause=ProvisionCause.NODE,
                )
            return False

        self.poll(
            step,
            deadline,
            lambda: (
                f"GCP: instance {name} not running with its host keys published within "
                f"{self.spec.options.start_timeout:g} s (status {row.get('status')}; does "
                "the image run the guest agent?); Options(start_timeout=...) sets the limit"
            ),
            POLL,
        )

    def _host_keys(self, zone: str, name: str) -> list[str]:
        """The SSH host keys the instance's guest agent published (``hostkeys/`` guest
        attributes), as ``type key`` lines; [] while there are none."""
        from google.cloud import compute_v1 as c

        instances = self.api.client("InstancesClient")
        request = c.GetGuestAttributesInstanceRequest(
            project=self.api.project, zone=zone, instance=name, query_path="hostkeys/"
        )
        try:
            found = self.api.call(
                f"read the host keys of {name}",
                lambda: instances.get_guest_attributes(request=request),
            )
        except GcpApiError as e:
            if e.status == 404:  # none published yet
                return []
            raise
        items = found.query_value.items if found.query_value else []
        keys = []
        for item in items:
            if item.namespace != "hostkeys":
                continue
            value = item.value.strip()
            keys.append(value if " " in value else f"{item.key} {value}")
        return keys

    def create_one(self, rank: int) -> str:
        """One instance for ``rank`` in the first (market, zone) with room
        (:meth:`_places`); it is not waited for (:meth:`wait_one`)."""
        name = instance_name(self.spec.pool_id, rank, next(self._launches))
        deadline = time.monotonic() + self.spec.options.start_timeout
        full: list[str] = []
        for spot, zone in self._places():
            try:
                self._insert(zone, name, self._script(), deadline, spot)
            except GcpApiError as e:
                if not _full(e):
                    raise
                full.append(_where(zone, spot, e))
                self._delete(zone, name, deadline)
                self.instances.pop(name, None)
                continue
            return name
        raise ProvisionError(
            f"GCP: no zone has room for 1 x {self.choice.machine_type} now: "
            f"{', '.join(full) or 'no zone offers it'}",
            cause=ProvisionCause.CAPACITY,
        )

    def wait_one(self, ident: str) -> None:
        deadline = time.monotonic() + self.spec.options.start_timeout
        self._wait_ready(_zone(self.instances[ident]), ident, deadline)

    def machine_of(self, rank: int, ident: str) -> Machine:
        return self._machine(rank, self.instances[ident])

    def _machine(self, rank: int, row: dict[str, Any]) -> Machine:
        nic = (row.get("network_interfaces") or [{}])[0]
        return Machine(rank, str(row["name"]), str(nic.get("network_i_p", "")), str(row["name"]))

    # -- agents ------------------------------------------------------------------------
    handover = "published by its guest agent as guest attributes"

    def target(self, machine: Machine) -> Target:
        return Target(_nat_ip(self.instances[machine.ident]), self.settings.ssh_user, 22)

    async def start_agent(self, machine: Machine) -> AgentProcess:
        """Wait for port 22, start the agent over SSH with the pinned host keys (see
        ``cloud.allocation``); a SPOT instance's preemption notice is reported."""
        agent = await super().start_agent(machine)
        login.remember(self.folder, machine.address, self.target(machine))  # flotilla ssh
        return watch_notices(
            agent, self.name(machine), lambda notice: self._on_notice(machine.ident, notice)
        )

    def agent_env(self, machine: Machine) -> dict[str, str]:
        """``FLOTILLA_CLOUD``: the watchdog deletes the instance ``ttl`` s after the
        client's last contact (``startup``); a SPOT instance's agent polls for preemption."""
        settings = {
            "contact": contact_path(self.settings.workdir, machine.ident),
            "ttl": self.settings.ttl,
            "poweroff": [SELF_DELETE],
            "imds": METADATA if machine.ident in self.spot_names else "",
            "poll": 1.0,
        }
        return {CLOUD_ENV: json.dumps(settings)}

    def _on_notice(self, ident: str, notice: dict[str, Any]) -> None:
        for rank, machine in enumerate(self.machines):
            if machine.ident == ident and self.machine_states.get(ident) is not MachineState.LOST:
                reason = f"GCP preempted SPOT instance {ident} ({notice.get('time', 'now')})"
                logger.warning("%s", reason)
                self.report_lost(rank, reason)

    # -- release -----------------------------------------------------------------------
    def _delete(self, zone: str, name: str, deadline: float) -> None:
        delete_instance(self.api, zone, name, deadline)

    def end_one(self, ident: str) -> None:
        row = self.instances.get(ident)
        if row is not None:
            self._delete(_zone(row), ident, time.monotonic() + RELEASE_TIMEOUT)
            self.instances.pop(ident, None)

    def _delete_all(self, zones: list[str]) -> None:
        """Delete every instance of the pool in ``zones``: those made, and those found by
        the pool's label (a create whose answer was lost)."""
        from google.cloud import compute_v1 as c

        api = self.api
        instances = api.client("InstancesClient")
        deadline = time.monotonic() + RELEASE_TIMEOUT
        errors = []
        for zone in zones:
            names = {n for n, row in self.instances.items() if _zone(row) == zone}
            request = c.ListInstancesRequest(
                project=api.project,
                zone=zone,
                filter=f'labels.{POOL_LABEL} = "{self.spec.pool_id}"',
            )
            try:
                found = api.call("list the pool's instances", partial(_listed, instances, request))
                names |= {i.name for i in found}
            except ProvisionError as e:
                errors.append(str(e))
            results = list(
                concurrent.futures.ThreadPoolExecutor(max_workers=16).map(
                    lambda n, z=zone: _error_of(self._delete, z, n, deadline), sorted(names)
                )
            )
            errors.extend(r for r in results if r)
            for name in names:
                self.instances.pop(name, None)
                self.unbilled(name)
        if errors:
            raise ProvisionError("; ".join(errors))

    def sweep(self) -> None:
        """Delete everything of the pool (synchronous, see ``base.Allocation.sweep``),
        then remove its local folder."""
        try:
            if self.stop_kept():
                return
            self._delete_all(self.zones_tried)
            self.forget_kept()
        except Exception as e:
            _show(f"GCP: could not delete everything of pool {self.spec.pool_id}: {e}")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def delete_instance(api: GcpApi, zone: str, name: str, deadline: float) -> None:
    """Delete instance ``name`` and wait for it (until ``deadline``); one already gone
    is no error."""
    instances = api.client("InstancesClient")
    try:
        op = api.call(
            f"delete instance {name}",
            lambda: instances.delete_unary(project=api.project, zone=zone, instance=name),
        )
    except GcpApiError as e:
        if e.status == 404:
            return
        raise
    api.wait(zone, op, f"delete instance {name}", deadline)


def markets(settings: GCPSettings) -> list[bool]:
    """Whether to try SPOT (True), on-demand (False), in order, per ``allocation``."""
    return {"spot": [True], "on-demand": [False]}.get(settings.allocation, [True, False])


def _full(e: GcpApiError) -> bool:
    """Whether ``e`` says a zone has no room now (not a quota: that is the account's)."""
    return e.cause is ProvisionCause.CAPACITY and "QUOTA" not in " ".join(e.codes)


def _where(zone: str, spot: bool, e: GcpApiError) -> str:
    return f"{zone}{' SPOT' if spot else ''} ({', '.join(sorted(set(e.codes)))})"


def _listed(instances: Any, request: Any) -> list[Any]:
    return list(instances.list(request=request))


def _error_of(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except Exception as e:
        return str(e)
    return ""


def _zone(row: dict[str, Any]) -> str:
    return str(row.get("zone", "")).rsplit("/", 1)[-1]


def _nat_ip(row: dict[str, Any]) -> str:
    """The instance's external address (its first access config's ``natIP``)."""
    for nic in row.get("network_interfaces") or []:
        for access in nic.get("access_configs") or []:
            if access.get("nat_i_p"):
                return str(access["nat_i_p"])
    return ""


def ssh_login(address: str) -> list[str]:
    """``ssh`` arguments that log in to the running pool instance whose internal address is
    ``address`` as its pool does (``flotilla ssh``: its external address, the pool's login
    key and pinned host keys)."""
    return login.ssh_login(FOLDER_PREFIX, address, "GCP")


def _show(message: str) -> None:
    show(logger, message)
