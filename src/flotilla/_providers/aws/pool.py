"""The EC2 instances of one pool: launch, replace, release (see ``provider`` for the design)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import socket
import sys
import time
import urllib.request
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any

from ..._errors import ConfigurationError, FlotillaError, ProvisionCause, ProvisionError
from ..._wire.protocol import CLOUD_ENV
from ..base import AgentProcess, AllocationState, Machine, MachineState, PoolSpec
from ..cloud.allocation import CloudAllocation, CloudShell
from ..cloud.guard import contact_path, guard_command
from ..cloud.identity import client_id
from ..cloud.keys import KeyPair, keygen, pin, pin_public
from ..ssh_shell import Target
from .agent import AWSAgent
from .api import CAPACITY_CODES, SPOT_QUOTA_CODES, Api, error_code, error_message, translate
from .choice import InstanceChoice, check_ami, choose, default_ami
from .kept import TAG_STOPPED, Keep, KeptInstance, KeptPool
from .keys import pool_folder, remove_folder, user_data
from .price import describe as describe_price
from .price import on_demand_price, spot_price
from .settings import EFA_ENV, AWSSettings

logger = logging.getLogger("flotilla.aws")

IMDS = "http://169.254.169.254"
TAG_POOL = "flotilla:pool"
TAG_OWNER = "flotilla:owner"
TAG_CLIENT = "flotilla:client"
TAG_CREATED = "flotilla:created"
RELEASE_TIMEOUT = 600.0
"""Seconds release() keeps checking that instances terminated and the group can go."""


class AWSAllocation(CloudAllocation):
    """The EC2 instances of one pool (see the module docstring).

    Attributes:
        choice: the instance type and zones.
        market: ``"spot"`` or ``"on-demand"``, as launched.
        zone: the zone the pool launched in.
        instances: instance id -> its description at launch, for every instance launched.
        security_group: the pool's security group id ("" before it exists).
        placement_group: the pool's cluster placement group (network_tier="best"), or "".
        folder: the local folder with the pool's keys and known_hosts.
        keep: where a stoppable pool records its instances, and whether closing it stops
            them (see ``kept``); None: closing terminates everything.
        tag: the ``flotilla:pool`` tag of the pool's resources: its id, or the id of the
            first pool of the kept instances it started again.
    """

    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=4, thread_name_prefix="flotilla-aws"
    )

    def __init__(
        self,
        settings: AWSSettings,
        api: Api,
        spec: PoolSpec,
        keep: Keep | None = None,
        kept: KeptPool | None = None,
    ) -> None:
        super().__init__(spec, [])
        self.keep = keep
        self.tag = kept.pool if kept is not None else spec.pool_id
        self.state = AllocationState.ACQUIRING
        self.settings = settings
        self.api = api
        self.choice: InstanceChoice | None = None
        self.market = ""
        self.zone = ""
        self.instances: dict[str, dict[str, Any]] = {}
        self.security_group = ""
        self.placement_group = ""  # with network_tier="best": the pool's cluster group
        self.folder = pool_folder(self.tag)
        self.known_hosts = os.path.join(self.folder, "known_hosts")
        self.login_key: KeyPair | None = None
        self.host_keys: dict[str, str] = {}  # instance id -> the public host key it got
        self._no_choice = ""  # why a started pool cannot launch replacements
        self._image: dict[str, Any] = {}
        self._subnets: dict[str, str] = {}  # zone -> subnet id
        self._vpc = ""
        self._client_cidrs: list[str] = []
        self._created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._client = client_id()
        self._launches = 0
        self.hourly = 0.0
        self.instance_type = ""
        self.image_id = ""
        self._kept_ids: list[str] = []  # the kept instances a start is starting
        """What the pool costs per hour when its price is known (0: unknown)."""
        self.python = settings.python or "python3"
        self.workdir = settings.workdir
        with open(os.path.join(self.folder, "client"), "w") as f:
            f.write(self._client)

    # -- launch ------------------------------------------------------------------------
    async def launch(self) -> None:
        """Check everything, then make the group and launch. Independent API calls run at
        once (the network, the instance choice and AMI, the keys; then the group and the
        spot price): a pool's start waits for 4 API round trips before RunInstances, not 9."""
        settings, spec = self.settings, self.spec
        network, choice, login_key = await _all(
            self._in_thread(self._find_subnets),
            self._in_thread(self._choose),
            self._in_thread(keygen, self.folder, "login_key", f"flotilla-{spec.pool_id}"),
        )
        self._subnets, self._vpc, cidrs = network
        zones = tuple(z for z in choice.zones if z in self._subnets)
        if not zones:
            raise ConfigurationError(
                f"{choice.instance_type} is offered in {', '.join(choice.zones)} but the "
                f"subnets are in {', '.join(self._subnets)}: pass AWS(subnet=...) in a zone "
                "that offers it, or another instance type"
            )
        self.choice = choice = dataclasses.replace(choice, zones=zones)
        self.instance_type, self.image_id = choice.instance_type, self._image["ImageId"]
        self._use_login_key(login_key)
        if settings.private_ips:
            self._client_cidrs = cidrs
        else:
            self._client_cidrs = [await self._in_thread(_public_cidr)]
        spot = settings.allocation != "on-demand" and choice.spot
        fallback = spot and settings.allocation == "spot-if-available"
        kind, api = choice.instance_type, self.api
        best = settings.network_tier == "best"
        _, _, spot_cost, on_demand_cost = await _all(
            self._in_thread(self._make_security_group),
            self._in_thread(self._make_placement_group) if best else _nothing(),
            self._in_thread(spot_price, api, kind, zones) if spot else _nothing(),
            self._in_thread(on_demand_price, api, kind) if fallback or not spot else _nothing(),
        )
        market = "spot" if spot else "on-demand"
        prices = describe_price("spot", spot_cost) + describe_price("on-demand", on_demand_cost)
        known = [p for p in (spot_cost if spot else None, on_demand_cost) if p is not None]
        self.hourly = min(known) * spec.nodes if known else 0.0
        node_limit = spec.max_node_hourly_cost
        if node_limit is not None and known and min(known) > node_limit:
            raise ProvisionError(
                f"AWS {self.api.region}: one {choice.instance_type} costs ${min(known):.4g}/h, "
                f"above max_node_hourly_cost=${node_limit:.4g}/h: nothing was launched",
                cause=ProvisionCause.CAPACITY,
            )
        limit = spec.max_hourly_cost
        if limit is not None and known and min(known) * spec.nodes > limit:
            raise ProvisionError(
                f"AWS {self.api.region}: {spec.nodes} x {choice.instance_type} costs "
                f"${min(known) * spec.nodes:.2f}/h, above max_hourly_cost=${limit:.2f}/h: "
                "nothing was launched",
                cause=ProvisionCause.CAPACITY,
            )
        acc = spec.accelerator
        more = (
            f"; it has {choice.gpus} x {choice.gpu_name}, more than the {acc.count} asked: no "
            f"type of {self.api.region} has {acc.count}"
            if acc is not None and choice.gpus > acc.count
            else ""
        )
        tier = f", EFA in cluster placement group {self.placement_group}" if best else ""
        _show(
            f"AWS {self.api.region}: {spec.nodes} x {choice.describe()}, {market}"
            f"{' (on-demand if no spot capacity)' if fallback else ''}, "
            f"zones {', '.join(zones)}{prices}, AMI {self._image['ImageId']}{tier}{more}"
        )
        instances = await self._in_thread(self._run, spec.nodes)
        self.machines = [self._machine(rank, inst) for rank, inst in enumerate(instances)]
        self.state = AllocationState.READY
        if self.keep is not None:
            await self._in_thread(self._record, False)

    def _use_login_key(self, login_key: KeyPair) -> None:
        """Log in with ``login_key``, the instances' host keys pinned in ``known_hosts``."""
        self.login_key = login_key
        self.shell = CloudShell(
            self.target,
            key=login_key.path,
            known_hosts=self.known_hosts,
            accept_new_host_keys=False,
            connect_timeout=self.settings.connect_timeout,
        )

    # -- stop and start (a stoppable pool, see ``kept``) ------------------------------
    async def resume(self, kept: KeptPool) -> None:
        """Start the kept, stopped instances of a stoppable pool instead of launching
        new ones: the same instances (and disks) at the same ranks, their recorded host
        keys pinned at their current addresses (a public address may change), the tag
        that protected them while stopped removed. A failed start stops them again."""
        assert self.keep is not None
        self.keep.stop = True  # until the pool is up: a failure keeps the instances
        ids = [i.id for i in kept.instances]
        self._kept_ids = ids
        if kept.region != self.api.region:
            raise ConfigurationError(
                f"the stopped instances are in {kept.region}, not {self.api.region}"
            )
        if len(ids) != self.spec.nodes:
            raise ConfigurationError(
                f"{len(ids)} stopped instance(s) cannot make a pool of {self.spec.nodes} nodes"
            )
        self.market, self.zone = kept.market, kept.zone
        self.security_group, self.placement_group = kept.security_group, kept.placement_group
        self.instance_type, self.image_id = kept.instance_type, kept.image
        self.host_keys = {i.id: i.host_key for i in kept.instances}
        login = os.path.join(self.folder, "login_key")
        for suffix in ("", ".pub"):
            with open(f"{self.keep.login_key}{suffix}", "rb") as src:
                data = src.read()
            fd = os.open(login + suffix, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as dst:
                dst.write(data)
        with open(login + ".pub") as f:
            self._use_login_key(KeyPair(login, f.read().strip()))
        network, _ = await _all(
            self._in_thread(self._find_subnets), self._in_thread(self._choose_again, kept)
        )
        self._subnets, self._vpc, _ = network
        if self.choice is not None:
            zones = tuple(z for z in self.choice.zones if z in self._subnets)
            self.choice = dataclasses.replace(self.choice, zones=zones)
        _show(
            f"AWS {self.api.region}: starting {len(ids)} stopped x {kept.instance_type}, "
            f"{kept.market}, zone {kept.zone}: {', '.join(ids)}"
        )
        instances = await self._in_thread(self._start_kept, ids)
        self.machines = [self._machine(rank, inst) for rank, inst in enumerate(instances)]
        self.state = AllocationState.READY
        await self._in_thread(self._record, False)
        self.keep.stop = False

    def _choose_again(self, kept: KeptPool) -> None:
        """The instance choice of a started pool, for replacements (which launch): the
        kept type and AMI. When they can no longer be had, the pool still starts, and
        replacing a node says why it cannot."""
        try:
            choice = choose(
                self.api,
                kept.instance_type,
                self.spec.accelerator,
                self.spec.vcpus,
                self.spec.memory_gb,
                kept.market == "spot",
                None,
                efa=bool(kept.placement_group),
            )
            self._image = check_ami(self.api, kept.image, choice)
            self.choice = choice
        except FlotillaError as e:
            self._no_choice = str(e)

    def _start_kept(self, ids: list[str]) -> list[dict[str, Any]]:
        """StartInstances for the kept instances ``ids`` (in rank order; those already
        running are left so); their descriptions once they have their addresses."""
        self._retag(ids, stopped=False)
        found = {i["InstanceId"]: i for i in self._describe_ids(ids)}
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
        deadline = time.monotonic() + self.spec.options.start_timeout
        delay = 0.2
        while any(found[i]["State"]["Name"] == "stopping" for i in ids):
            if time.monotonic() > deadline:  # StartInstances refuses a stopping instance
                raise ProvisionError(f"instances {', '.join(ids)} are still stopping")
            time.sleep(delay)
            delay = min(delay * 1.5, 3.0)
            found = {i["InstanceId"]: i for i in self._describe_ids(ids)}
        start = [i for i in ids if found[i]["State"]["Name"] == "stopped"]
        if start:
            try:
                with self.creating("started instances", self.tag):
                    self.api.raw("ec2", "start_instances", InstanceIds=start)
            except Exception as e:
                code = error_code(e)
                if code in CAPACITY_CODES:
                    raise ProvisionError(
                        f"AWS has no capacity to start {len(start)} x {self.instance_type} in "
                        f"{self.zone} now ({code}: {error_message(e)}): the instances stay "
                        "stopped; try again later",
                        cause=ProvisionCause.CAPACITY,
                    ) from e
                raise translate(e, f"start the stopped instances {', '.join(start)}") from e
        while True:
            found = {i["InstanceId"]: i for i in self._describe_ids(ids)}
            instances = [found[i] for i in ids]
            if self.settings.private_ips or all(i.get("PublicIpAddress") for i in instances):
                break
            if time.monotonic() > deadline:
                raise ProvisionError(
                    f"instances {', '.join(ids)} got no public address after starting: use a "
                    "subnet that assigns them, or AWS(private_ips=True) from inside the VPC"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 3.0)
        for inst in instances:  # a started instance may have a new public address
            self.instances[inst["InstanceId"]] = inst
            pin_public(
                self.known_hosts, self._connect_addr(inst), self.host_keys[inst["InstanceId"]]
            )
        return instances

    def _describe_ids(self, ids: list[str]) -> list[dict[str, Any]]:
        """The instances ``ids`` (those EC2 still knows: a filter, not InstanceIds, so an
        unknown id is left out instead of failing the call)."""
        reply = self.api.call(
            "ec2",
            "describe_instances",
            "check the pool's instances",
            Filters=[{"Name": "instance-id", "Values": ids}],
        )
        return [i for r in reply["Reservations"] for i in r["Instances"]]

    def _retag(self, ids: list[str], stopped: bool) -> None:
        """Mark the pool's instances and security group as stopped (the orphan sweep
        leaves them alone while no client runs) or as this client's again."""
        resources = [*ids, *([self.security_group] if self.security_group else [])]
        if stopped:
            self.api.call(
                "ec2",
                "create_tags",
                "mark the pool's instances as stopped",
                Resources=resources,
                Tags=[{"Key": TAG_STOPPED, "Value": self._created}],
            )
            return
        self.api.call(
            "ec2",
            "create_tags",
            "mark the stopped instances as this client's",
            Resources=resources,
            Tags=[{"Key": TAG_CLIENT, "Value": self._client}],
        )
        self.api.call(
            "ec2",
            "delete_tags",
            "unmark the stopped instances",
            Resources=resources,
            Tags=[{"Key": TAG_STOPPED}],
        )

    def _node_ids(self) -> list[str]:
        """The instances of the nodes, in rank order (those a start was starting, if it
        failed before the pool had its machines)."""
        return [m.ident for m in self.machines] or list(self._kept_ids)

    def _record(self, stopped: bool, ids: list[str] | None = None) -> None:
        """Write the pool's instances (``ids``, default the nodes') to the keep folder
        (see ``kept``)."""
        if self.keep is None:
            return
        ids = self._node_ids() if ids is None else ids
        nodes = [KeptInstance(i, self.host_keys.get(i, "")) for i in ids]
        self.keep.save(
            KeptPool(
                pool=self.tag,
                region=self.api.region,
                stopped=stopped,
                market=self.market,
                zone=self.zone,
                instance_type=self.instance_type,
                image=self.image_id,
                security_group=self.security_group,
                placement_group=self.placement_group,
                instances=nodes,
            ),
            self.login_key.path if self.login_key is not None else None,
        )

    def _stop(self) -> None:
        """Stop the nodes' instances (their disks stay) and record them for the next
        pool; the pool's other instances (replaced nodes' ones, launches a lost answer
        did not report) are terminated."""
        from .orphans import terminate

        ids = self._node_ids()
        pool = [{"Name": f"tag:{TAG_POOL}", "Values": [self.tag]}]
        others = [
            i["InstanceId"]
            for r in self.api.call(
                "ec2", "describe_instances", "find the pool's instances", Filters=pool
            )["Reservations"]
            for i in r["Instances"]
            if i["InstanceId"] not in ids and i["State"]["Name"] != "terminated"
        ]
        if others:
            terminate(
                self.api,
                [{"Name": "instance-id", "Values": others}],
                set(others),
                RELEASE_TIMEOUT,
            )
        self._retag(ids, stopped=True)
        self._record(True)  # before StopInstances: `down` finds them whatever happens next
        try:
            self.api.raw("ec2", "stop_instances", InstanceIds=ids)
        except Exception as e:
            raise translate(e, f"stop the pool's instances {', '.join(ids)}") from e
        deadline = time.monotonic() + RELEASE_TIMEOUT
        delay = 0.2
        while True:
            states = {i["InstanceId"]: i["State"]["Name"] for i in self._describe_ids(ids)}
            left = [i for i in ids if states.get(i) not in ("stopped", "terminated", None)]
            if not left:
                break
            if time.monotonic() > deadline:
                raise ProvisionError(f"instances {', '.join(left)} still not stopped")
            time.sleep(delay)
            delay = min(delay * 1.5, 5.0)
        _show(
            f"AWS: stopped {len(ids)} instance(s) of pool {self.tag} ({', '.join(ids)}); "
            "their disks are kept"
        )

    def _choose(self) -> InstanceChoice:
        """The instance choice and its AMI (checked)."""
        settings, spec = self.settings, self.spec
        choice = choose(
            self.api,
            settings.instance_type,
            spec.accelerator,
            spec.vcpus,
            spec.memory_gb,
            settings.allocation == "spot",
            None,
            efa=settings.network_tier == "best",
        )
        ami = settings.ami or default_ami(self.api, choice)
        self._image = check_ami(self.api, ami, choice)
        return choice

    def _find_subnets(self) -> tuple[dict[str, str], str, list[str]]:
        """(zone -> subnet, VPC id, the VPC's CIDRs): the given subnet, or one subnet per
        zone of the default VPC (its default subnets first)."""
        subnet = self.settings.subnet
        if subnet:
            found = self.api.call(
                "ec2", "describe_subnets", f"look up subnet {subnet}", SubnetIds=[subnet]
            )["Subnets"]
            vpc_id = found[0]["VpcId"]
            vpcs = self.api.call("ec2", "describe_vpcs", f"look up VPC {vpc_id}", VpcIds=[vpc_id])[
                "Vpcs"
            ]
        else:
            vpcs = self.api.call(
                "ec2",
                "describe_vpcs",
                "find the default VPC",
                Filters=[{"Name": "isDefault", "Values": ["true"]}],
            )["Vpcs"]
            if not vpcs:
                raise ConfigurationError(
                    f"region {self.api.region} has no default VPC: pass AWS(subnet=...)"
                )
            vpc_id = vpcs[0]["VpcId"]
            found = self.api.call(
                "ec2",
                "describe_subnets",
                "list the default VPC's subnets",
                Filters=[{"Name": "vpc-id", "Values": [vpc_id]}],
            )["Subnets"]
            found.sort(key=lambda s: (not s.get("DefaultForAz", False), s["SubnetId"]))
        subnets: dict[str, str] = {}
        for s in found:
            subnets.setdefault(s["AvailabilityZone"], s["SubnetId"])
        if not subnets:
            raise ConfigurationError(f"VPC {vpc_id} has no subnet: pass AWS(subnet=...)")
        vpc = vpcs[0]
        cidrs = [a["CidrBlock"] for a in vpc.get("CidrBlockAssociationSet", [])] or [
            vpc["CidrBlock"]
        ]
        return dict(sorted(subnets.items())), vpc_id, cidrs

    def _tags(self, resource: str) -> dict[str, Any]:
        tags = {
            "Name": f"flotilla-{self.tag}",
            TAG_POOL: self.tag,
            TAG_OWNER: _owner(),
            TAG_CLIENT: self._client,
            TAG_CREATED: self._created,
            **self.settings.tags,
        }
        return {"ResourceType": resource, "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}

    def _make_placement_group(self) -> None:
        """A cluster placement group for the pool (network_tier="best"): its instances
        land close together, as EFA traffic wants."""
        name = f"flotilla-{self.tag}"
        with self.creating("placement group", self.tag):
            self.api.call(
                "ec2",
                "create_placement_group",
                "create the pool's placement group",
                GroupName=name,
                Strategy="cluster",
                TagSpecifications=[self._tags("placement-group")],
            )
            self.placement_group = name  # before the sweep can look

    def _make_security_group(self) -> None:
        with self.creating("security group", self.tag):
            group = self.api.call(
                "ec2",
                "create_security_group",
                "create the pool's security group",
                GroupName=f"flotilla-{self.tag}",
                Description=f"flotilla pool {self.tag}: SSH from its client, members",
                VpcId=self._vpc,
                TagSpecifications=[self._tags("security-group")],
            )
            self.security_group = group["GroupId"]  # before the sweep can look
        self.api.call(
            "ec2",
            "authorize_security_group_ingress",
            "open the pool's security group to SSH and its members",
            GroupId=self.security_group,
            IpPermissions=[
                {
                    "IpProtocol": "tcp",
                    "FromPort": 22,
                    "ToPort": 22,
                    "IpRanges": [
                        {"CidrIp": c, "Description": "flotilla client"} for c in self._client_cidrs
                    ],
                },
                {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": self.security_group}]},
                *(
                    {
                        "IpProtocol": "tcp",
                        "FromPort": low,
                        "ToPort": high,
                        "IpRanges": [{"CidrIp": "0.0.0.0/0", "Description": "AWS(ports=...)"}],
                    }
                    for low, high in self.settings.port_ranges()
                ),
            ],
        )

    def _run(self, count: int) -> list[dict[str, Any]]:
        """Launch ``count`` instances with one RunInstances (all or none), trying the zones
        and markets in order; the instances in launch-index order, host key pinned."""
        assert self.choice is not None and self.login_key is not None
        self._launches += 1
        host_key = keygen(
            self.folder, f"host_key_{self._launches}", f"flotilla-{self.spec.pool_id}"
        )
        settings = self.settings
        guard = guard_command(
            settings.ttl,
            self.spec.options.start_timeout,
            settings.workdir,
            settings.ssh_user,
            settings.poweroff_command,
        )
        data = user_data(host_key, self.login_key, [guard])
        allocation = self.settings.allocation
        markets = {"spot": ["spot"], "on-demand": ["on-demand"]}.get(
            allocation, ["spot", "on-demand"]
        )
        if not self.choice.spot:
            markets = [m for m in markets if m != "spot"] or ["spot"]
        failures: list[str] = []
        for market in markets:
            for zone in self.choice.zones:
                params = self._launch_params(count, market, zone, data)
                try:
                    with self.creating("instances", self.tag):
                        reply = self.api.raw("ec2", "run_instances", **params)
                except Exception as e:
                    code = error_code(e)
                    spot_quota = market == "spot" and code in SPOT_QUOTA_CODES
                    if code in CAPACITY_CODES or spot_quota:
                        failures.append(f"{market} in {zone}: {code} ({error_message(e)})")
                        if spot_quota:
                            break  # a quota of the account: no zone has more
                        continue
                    raise translate(e, f"launch {count} x {self.choice.instance_type}") from e
                if failures:
                    _show(f"AWS: launched {market} in {zone} after: {'; '.join(failures)}")
                self.market, self.zone = market, zone
                instances = sorted(reply["Instances"], key=lambda i: int(i["AmiLaunchIndex"]))
                for inst in instances:
                    self.instances[inst["InstanceId"]] = inst
                    self.host_keys[inst["InstanceId"]] = host_key.public
                if not self.settings.private_ips:
                    instances = self._public_addresses(instances)
                for inst in instances:
                    pin(self.known_hosts, self._connect_addr(inst), host_key)
                return instances
        how = {
            "spot": "use allocation='spot-if-available' or 'on-demand'",
            "on-demand": "try another instance type or region",
        }[markets[-1]]
        raise ProvisionError(
            f"no capacity for {count} x {self.choice.instance_type} in {self.api.region} "
            f"({'; '.join(failures)}): {how}, or try again later",
            cause=ProvisionCause.CAPACITY,
        )

    def _launch_params(self, count: int, market: str, zone: str, data: str) -> dict[str, Any]:
        assert self.choice is not None
        params: dict[str, Any] = {
            "ImageId": self._image["ImageId"],
            "InstanceType": self.choice.instance_type,
            "MinCount": count,
            "MaxCount": count,
            "UserData": data,
            "ClientToken": f"flotilla-{self.spec.pool_id}-{self._launches}-{market}-{zone}",
            "InstanceInitiatedShutdownBehavior": "terminate",
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
            "NetworkInterfaces": [
                {
                    "DeviceIndex": 0,
                    "SubnetId": self._subnets[zone],
                    "Groups": [self.security_group],
                    "AssociatePublicIpAddress": not self.settings.private_ips,
                    "DeleteOnTermination": True,
                }
            ],
            "TagSpecifications": [self._tags("instance"), self._tags("volume")],
        }
        if self.placement_group:  # network_tier="best": close together, on EFA
            params["Placement"] = {"GroupName": self.placement_group}
            params["NetworkInterfaces"][0]["InterfaceType"] = "efa"
        if market == "spot":
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        if self.settings.disk_gb:
            params["BlockDeviceMappings"] = [
                {
                    "DeviceName": self._image.get("RootDeviceName", "/dev/sda1"),
                    "Ebs": {
                        "VolumeSize": self.settings.disk_gb,
                        "VolumeType": "gp3",
                        "DeleteOnTermination": True,
                    },
                }
            ]
        return params

    def _public_addresses(self, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The instances once every one has a public address (assigned while pending)."""
        ids = [i["InstanceId"] for i in instances]
        deadline = time.monotonic() + self.spec.options.start_timeout
        delay = 0.5
        while True:
            if all(i.get("PublicIpAddress") for i in instances):
                return instances
            if self.ending.is_set():
                raise ProvisionError(f"pool {self.tag}: released while starting")
            if time.monotonic() > deadline:
                raise ProvisionError(
                    f"instances {', '.join(ids)} got no public address: use a subnet that "
                    "assigns them, or AWS(private_ips=True) from inside the VPC"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 3.0)
            found = self._describe(ids)
            instances = sorted(found, key=lambda i: int(i["AmiLaunchIndex"]))
            for inst in instances:
                self.instances[inst["InstanceId"]] = inst

    def _describe(self, ids: list[str]) -> list[dict[str, Any]]:
        reply = self.api.call(
            "ec2", "describe_instances", "check the pool's instances", InstanceIds=ids
        )
        return [i for r in reply["Reservations"] for i in r["Instances"]]

    def _connect_addr(self, inst: dict[str, Any]) -> str:
        if self.settings.private_ips:
            return str(inst["PrivateIpAddress"])
        return str(inst["PublicIpAddress"])

    def _machine(self, rank: int, inst: dict[str, Any]) -> Machine:
        return Machine(rank, inst["InstanceId"], inst["PrivateIpAddress"], inst["InstanceId"])

    # -- agents ------------------------------------------------------------------------
    handover = "handed over in its user-data (or the AMI does not run cloud-init)"

    def target(self, machine: Machine) -> Target:
        return Target(self._connect_addr(self.instances[machine.ident]), self.settings.ssh_user, 22)

    async def start_agent(self, machine: Machine) -> AgentProcess:
        """Wait until the instance answers on port 22, then start the agent over SSH with
        its host key pinned, tried again while it fails as on a booting instance (see
        ``cloud.allocation``); spot interruption notices on its stderr are reported."""
        agent = await super().start_agent(machine)
        return AWSAgent(
            agent, self.name(machine), lambda notice: self._on_notice(machine.ident, notice)
        )

    def agent_env(self, machine: Machine) -> dict[str, str]:
        """``FLOTILLA_CLOUD``: the instance watchdog's settings (see ``_node/cloud.py``)."""
        spot = self.instances[machine.ident].get("InstanceLifecycle") == "spot"
        settings = {
            "contact": contact_path(self.settings.workdir, machine.ident),
            "ttl": self.settings.ttl,
            "poweroff": list(self.settings.poweroff_command),
            "imds": IMDS if spot else "",
        }
        env = {CLOUD_ENV: json.dumps(settings)}
        if self.placement_group:
            env.update(EFA_ENV)
        return env

    def _on_notice(self, ident: str, notice: dict[str, Any]) -> None:
        for rank, machine in enumerate(self.machines):
            if machine.ident == ident and self.machine_states.get(ident) is not MachineState.LOST:
                action, when = notice.get("action", "terminate"), notice.get("time", "soon")
                reason = f"spot interruption notice: AWS will {action} {ident} at {when}"
                logger.warning("%s", reason)
                self.report_lost(rank, reason)

    # -- replace -----------------------------------------------------------------------
    async def replacement(self, rank: int, reason: str) -> Machine:
        """Launch one new instance for ``rank`` (same type, group, tags; a new host key)
        and terminate the old one."""
        if self.state is not AllocationState.READY:
            raise ProvisionError(
                f"cannot replace node {rank}: the pool's allocation is {self.state.value}"
            )
        if self.choice is None:
            raise ProvisionError(f"cannot replace node {rank}: {self._no_choice}")
        old = self.machines[rank]
        (inst,) = await self._in_thread(self._run, 1)
        machine = self._machine(rank, inst)
        logger.info("node %d: %s replaced by %s (%s)", rank, old.ident, machine.ident, reason)
        try:
            await self._in_thread(
                lambda: self.api.call(
                    "ec2",
                    "terminate_instances",
                    "terminate the lost instance",
                    InstanceIds=[old.ident],
                )
            )
        except ProvisionError as e:  # release() terminates it (by tag) in any case
            logger.warning("%s: %s", old.ident, e)
        if self.keep is not None:  # the kept record follows (the machine is put later)
            ids = [m.ident for m in self.machines]
            ids[rank] = machine.ident
            await self._in_thread(self._record, False, ids)
        return machine

    # -- release -----------------------------------------------------------------------
    def sweep(self) -> None:
        """Terminate everything of the pool, found by its tag (or stop its instances: a
        stoppable pool closed with ``stop``); synchronous (see ``base.Allocation.sweep``)."""
        keep = self.keep
        try:
            if keep is not None and keep.stop and self._node_ids():
                if self.market != "spot":
                    self._stop()
                    return
                _show("AWS: spot instances cannot be stopped (EC2 only terminates them)")
            self._release()
            if keep is not None:
                keep.forget()
        except Exception as e:  # release never raises: report what is left
            what = "stop" if keep is not None and keep.stop else "release"
            _show(f"AWS: could not {what} everything of pool {self.tag}: {e}")
        finally:
            remove_folder(self.folder)

    def _release(self) -> None:
        from .orphans import delete_group, delete_placement_group, terminate

        pool = [{"Name": f"tag:{TAG_POOL}", "Values": [self.tag]}]
        terminate(self.api, pool, set(self.instances), RELEASE_TIMEOUT)
        group = self.security_group
        if not group:
            found = self.api.call(
                "ec2", "describe_security_groups", "find the pool's security group", Filters=pool
            )["SecurityGroups"]
            group = found[0]["GroupId"] if found else ""
        if group:
            delete_group(self.api, group, RELEASE_TIMEOUT)
        if self.placement_group:  # its instances are terminated: it can go
            delete_placement_group(self.api, self.placement_group)


async def _all(*steps: Awaitable[Any]) -> list[Any]:
    """Run ``steps`` at once; their results. On a failure every step is still awaited
    (nothing runs on unobserved) and the first failure in order is raised."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


async def _nothing() -> None:
    return None


def _public_cidr() -> str:
    """This machine's public address as a /32, from AWS's checkip service."""
    try:
        with urllib.request.urlopen("https://checkip.amazonaws.com", timeout=5) as resp:
            addr = resp.read().decode().strip()
        socket.inet_aton(addr)
    except (OSError, ValueError) as e:
        raise ProvisionError(
            f"cannot learn this machine's public address (to open SSH to it only): {e}; from "
            "inside the VPC use AWS(private_ips=True)"
        ) from e
    return f"{addr}/32"


def _owner() -> str:
    try:
        user = os.getlogin()
    except OSError:
        user = os.environ.get("USER", "") or str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def _show(message: str) -> None:
    """Tell the user (stderr) what is about to be launched."""
    logger.info("%s", message)
    print(f"flotilla: {message}", file=sys.stderr, flush=True)
