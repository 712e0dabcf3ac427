"""Stopping and starting a stoppable AWS pool (a named cluster's, see ``kept``): its
instances are stopped (their disks kept) and recorded when it closes, and the next pool
starts the same instances again, at the same ranks, with their recorded host keys pinned
at their current addresses."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

from ..._errors import ConfigurationError, FlotillaError, ProvisionCause, ProvisionError
from ..base import AllocationState, Machine, PoolSpec
from ..cloud.keys import KeyPair, pin_public
from .api import CAPACITY_CODES, Api, error_code, error_message, translate
from .choice import InstanceChoice, check_ami, choose
from .kept import TAG_STOPPED, Keep, KeptInstance, KeptPool
from .network import TAG_CLIENT, TAG_POOL, PoolNetwork
from .settings import AWSSettings
from .steps import RELEASE_TIMEOUT, run_all, show

_T = TypeVar("_T")


class Stoppable(Protocol):
    """What :class:`StopStart` uses of the pool's allocation (``pool.AWSAllocation``,
    whose docstring says what each is)."""

    api: Api
    settings: AWSSettings
    spec: PoolSpec
    state: AllocationState
    keep: Keep | None
    network: PoolNetwork
    choice: InstanceChoice | None
    no_choice: str
    ami: dict[str, Any]
    tag: str
    market: str
    zone: str
    instance_type: str
    image_id: str
    instances: dict[str, dict[str, Any]]
    host_keys: dict[str, str]
    login_key: KeyPair | None
    folder: str
    known_hosts: str

    @property
    def machines(self) -> list[Machine]: ...

    @machines.setter
    def machines(self, machines: Sequence[Machine]) -> None: ...

    def use_login_key(self, login_key: KeyPair) -> None: ...

    def machine_of(self, rank: int, inst: dict[str, Any]) -> Machine: ...

    def connect_addr(self, inst: dict[str, Any]) -> str: ...

    def _public_addresses(
        self, instances: list[dict[str, Any]], deadline: float | None = None, after: str = ""
    ) -> list[dict[str, Any]]: ...

    def creating(self, what: str, key: str) -> AbstractContextManager[None]: ...

    async def _in_thread(self, fn: Callable[..., _T], *args: Any) -> _T: ...


class StopStart:
    """The stop and start of one pool's instances (see the module docstring).

    Attributes:
        pool: the pool's allocation.
        kept_ids: the kept instances a start is starting.
    """

    def __init__(self, pool: Stoppable) -> None:
        self.pool = pool
        self.kept_ids: list[str] = []

    async def resume(self, kept: KeptPool) -> None:
        """Start the kept, stopped instances of a stoppable pool instead of launching
        new ones: the same instances (and disks) at the same ranks, their recorded host
        keys pinned at their current addresses (a public address may change), the tag
        that protected them while stopped removed. A failed start stops them again."""
        pool = self.pool
        assert pool.keep is not None
        pool.keep.stop = True  # until the pool is up: a failure keeps the instances
        ids = [i.id for i in kept.instances]
        self.kept_ids = ids
        if kept.region != pool.api.region:
            raise ConfigurationError(
                f"the stopped instances are in {kept.region}, not {pool.api.region}"
            )
        if len(ids) != pool.spec.nodes:
            raise ConfigurationError(
                f"{len(ids)} stopped instance(s) cannot make a pool of {pool.spec.nodes} nodes"
            )
        pool.market, pool.zone = kept.market, kept.zone
        pool.network.security_group = kept.security_group
        pool.network.placement_group = kept.placement_group
        pool.instance_type, pool.image_id = kept.instance_type, kept.image
        pool.host_keys = {i.id: i.host_key for i in kept.instances}
        login = pool.keep.restore_login_key(pool.folder)
        with open(login + ".pub") as f:
            pool.use_login_key(KeyPair(login, f.read().strip()))
        network, _ = await run_all(
            pool._in_thread(pool.network.find_subnets), pool._in_thread(self.choose_again, kept)
        )
        pool.network.subnets, pool.network.vpc, _ = network
        if pool.choice is not None:
            zones = tuple(z for z in pool.choice.zones if z in pool.network.subnets)
            pool.choice = dataclasses.replace(pool.choice, zones=zones)
        show(
            f"AWS {pool.api.region}: starting {len(ids)} stopped x {kept.instance_type}, "
            f"{kept.market}, zone {kept.zone}: {', '.join(ids)}"
        )
        instances = await pool._in_thread(self.start_kept, ids)
        pool.machines = [pool.machine_of(rank, inst) for rank, inst in enumerate(instances)]
        pool.state = AllocationState.READY
        await pool._in_thread(self.record, False)
        pool.keep.stop = False

    def choose_again(self, kept: KeptPool) -> None:
        """The instance choice of a started pool, for replacements (which launch): the
        kept type and AMI. When they can no longer be had, the pool still starts, and
        replacing a node says why it cannot."""
        pool = self.pool
        try:
            choice = choose(
                pool.api,
                kept.instance_type,
                pool.spec.accelerator,
                pool.spec.vcpus,
                pool.spec.memory_gb,
                kept.market == "spot",
                None,
                efa=bool(kept.placement_group),
            )
            pool.ami = check_ami(pool.api, kept.image, choice)
            pool.choice = choice
        except FlotillaError as e:
            pool.no_choice = str(e)

    def start_kept(self, ids: list[str]) -> list[dict[str, Any]]:
        """StartInstances for the kept instances ``ids`` (in rank order; those already
        running are left so); their descriptions once they have their addresses."""
        pool = self.pool
        self.retag(ids, stopped=False)
        found = {i["InstanceId"]: i for i in self.describe_ids(ids)}
        gone = [
            i
            for i in ids
            if i not in found or found[i]["State"]["Name"] in ("shutting-down", "terminated")
        ]
        if gone:
            raise ProvisionError(
                f"instance(s) {', '.join(gone)} of the stopped pool are terminated (their "
                "disks with them): the pool cannot be started again; tear it down and "
                "launch a new one"
            )
        deadline = time.monotonic() + pool.spec.options.start_timeout
        delay = 0.2
        while any(found[i]["State"]["Name"] == "stopping" for i in ids):
            if time.monotonic() > deadline:  # StartInstances refuses a stopping instance
                raise ProvisionError(f"instances {', '.join(ids)} are still stopping")
            time.sleep(delay)
            delay = min(delay * 1.5, 3.0)
            found = {i["InstanceId"]: i for i in self.describe_ids(ids)}
        start = [i for i in ids if found[i]["State"]["Name"] == "stopped"]
        if start:
            try:
                with pool.creating("started instances", pool.tag):
                    pool.api.raw("ec2", "start_instances", InstanceIds=start)
            except Exception as e:
                code = error_code(e)
                if code in CAPACITY_CODES:
                    raise ProvisionError(
                        f"AWS has no capacity to start {len(start)} x {pool.instance_type} in "
                        f"{pool.zone} now ({code}: {error_message(e)}): the instances stay "
                        "stopped; try again later",
                        cause=ProvisionCause.CAPACITY,
                    ) from e
                raise translate(e, f"start the stopped instances {', '.join(start)}") from e
        found = {i["InstanceId"]: i for i in self.describe_ids(ids)}
        instances = [found[i] for i in ids]
        if not pool.settings.private_ips:
            instances = pool._public_addresses(instances, deadline, " after starting")
        for inst in instances:  # a started instance may have a new public address
            pool.instances[inst["InstanceId"]] = inst
            pin_public(
                pool.known_hosts, pool.connect_addr(inst), pool.host_keys[inst["InstanceId"]]
            )
        return instances

    def describe_ids(self, ids: list[str]) -> list[dict[str, Any]]:
        """The instances ``ids`` (those EC2 still knows: a filter, not InstanceIds, so an
        unknown id is left out instead of failing the call)."""
        pool = self.pool
        reply = pool.api.call(
            "ec2",
            "describe_instances",
            "check the pool's instances",
            Filters=[{"Name": "instance-id", "Values": ids}],
        )
        return [i for r in reply["Reservations"] for i in r["Instances"]]

    def retag(self, ids: list[str], stopped: bool) -> None:
        """Mark the pool's instances and security group as stopped (the orphan sweep
        leaves them alone while no client runs) or as this client's again."""
        pool = self.pool
        resources = [*ids, *([pool.network.security_group] if pool.network.security_group else [])]
        if stopped:
            tag, what = (TAG_STOPPED, pool.network.created), "the pool's instances as stopped"
        else:
            tag, what = (TAG_CLIENT, pool.network.client), "the stopped instances as this client's"
        tags = [{"Key": tag[0], "Value": tag[1]}]
        pool.api.call("ec2", "create_tags", f"mark {what}", Resources=resources, Tags=tags)
        if not stopped:
            pool.api.call(
                "ec2",
                "delete_tags",
                "unmark the stopped instances",
                Resources=resources,
                Tags=[{"Key": TAG_STOPPED}],
            )

    def node_ids(self) -> list[str]:
        """The instances of the nodes, in rank order (those a start was starting, if it
        failed before the pool had its machines)."""
        pool = self.pool
        return [m.ident for m in pool.machines] or list(self.kept_ids)

    def record(self, stopped: bool, ids: list[str] | None = None) -> None:
        """Write the pool's instances (``ids``, default the nodes') to the keep folder
        (see ``kept``)."""
        pool = self.pool
        if pool.keep is None:
            return
        ids = self.node_ids() if ids is None else ids
        nodes = [KeptInstance(i, pool.host_keys.get(i, "")) for i in ids]
        pool.keep.save(
            KeptPool(
                pool=pool.tag,
                region=pool.api.region,
                stopped=stopped,
                market=pool.market,
                zone=pool.zone,
                instance_type=pool.instance_type,
                image=pool.image_id,
                security_group=pool.network.security_group,
                placement_group=pool.network.placement_group,
                instances=nodes,
            ),
            pool.login_key.path if pool.login_key is not None else None,
        )

    def stop(self) -> None:
        """Stop the nodes' instances (their disks stay) and record them for the next
        pool; the pool's other instances (replaced nodes' ones, launches a lost answer
        did not report) are terminated."""
        from .orphans import terminate

        pool = self.pool
        ids = self.node_ids()
        tagged = [{"Name": f"tag:{TAG_POOL}", "Values": [pool.tag]}]
        others = [
            i["InstanceId"]
            for r in pool.api.call(
                "ec2", "describe_instances", "find the pool's instances", Filters=tagged
            )["Reservations"]
            for i in r["Instances"]
            if i["InstanceId"] not in ids and i["State"]["Name"] != "terminated"
        ]
        if others:
            terminate(
                pool.api,
                [{"Name": "instance-id", "Values": others}],
                set(others),
                RELEASE_TIMEOUT,
            )
        self.retag(ids, stopped=True)
        self.record(True)  # before StopInstances: `down` finds them whatever happens next
        try:
            pool.api.raw("ec2", "stop_instances", InstanceIds=ids)
        except Exception as e:
            raise translate(e, f"stop the pool's instances {', '.join(ids)}") from e
        deadline = time.monotonic() + RELEASE_TIMEOUT
        delay = 0.2
        while True:
            states = {i["InstanceId"]: i["State"]["Name"] for i in self.describe_ids(ids)}
            left = [i for i in ids if states.get(i) not in ("stopped", "terminated", None)]
            if not left:
                break
            if time.monotonic() > deadline:
                raise ProvisionError(f"instances {', '.join(left)} still not stopped")
            time.sleep(delay)
            delay = min(delay * 1.5, 5.0)
        show(
            f"AWS: stopped {len(ids)} instance(s) of pool {pool.tag} ({', '.join(ids)}); "
            "their disks are kept"
        )
