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
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..._node.cloud import ENV as CLOUD_ENV
from ..base import AgentProcess, AllocationState, Machine, MachineState, PoolSpec
from ..launch import ShellAllocation, start_remote_agent
from ..ssh_shell import SSHShell, Target
from .agent import RETRIED, AWSAgent, wait_port
from .api import CAPACITY_CODES, SPOT_QUOTA_CODES, Api, error_code, error_message, translate
from .choice import InstanceChoice, check_ami, choose, default_ami
from .guard import contact_path, guard_command
from .keys import KeyPair, keygen, pin, pool_folder, remove_folder, user_data
from .orphans import client_id
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
_T = TypeVar("_T")
_executor = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="flotilla-aws")


class AWSAllocation(ShellAllocation):
    """The EC2 instances of one pool (see the module docstring).

    Attributes:
        choice: the instance type and zones.
        market: ``"spot"`` or ``"on-demand"``, as launched.
        zone: the zone the pool launched in.
        instances: instance id -> its description at launch, for every instance launched.
        security_group: the pool's security group id ("" before it exists).
        placement_group: the pool's cluster placement group (network_tier="best"), or "".
        folder: the local folder with the pool's keys and known_hosts.
    """

    def __init__(self, settings: AWSSettings, api: Api, spec: PoolSpec) -> None:
        super().__init__(spec, [])
        self.state = AllocationState.ACQUIRING
        self.settings = settings
        self.api = api
        self.choice: InstanceChoice | None = None
        self.market = ""
        self.zone = ""
        self.instances: dict[str, dict[str, Any]] = {}
        self.security_group = ""
        self.placement_group = ""  # with network_tier="best": the pool's cluster group
        self.folder = pool_folder(spec.pool_id)
        self.known_hosts = os.path.join(self.folder, "known_hosts")
        self.login_key: KeyPair | None = None
        self._image: dict[str, Any] = {}
        self._subnets: dict[str, str] = {}  # zone -> subnet id
        self._vpc = ""
        self._client_cidrs: list[str] = []
        self._created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._client = client_id()
        self._busy: set[concurrent.futures.Future[Any]] = set()
        self._launches = 0
        self.hourly = 0.0
        """What the pool costs per hour when its price is known (0: unknown)."""
        self.python = settings.python or "python3"
        self.workdir = settings.workdir
        with open(os.path.join(self.folder, "client"), "w") as f:
            f.write(self._client)

    # -- running blocking API calls --------------------------------------------------
    async def _in_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in a worker thread. release() waits for calls still running
        (a cancelled caller does not stop the thread), so nothing made escapes it."""
        fut = _executor.submit(fn, *args)
        self._busy.add(fut)
        fut.add_done_callback(self._busy.discard)
        return await asyncio.wrap_future(fut)

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
        self.login_key = login_key
        self.shell = SSHShell(
            lambda machine: Target(
                self._connect_addr(self.instances[machine.ident]), settings.ssh_user, 22
            ),
            key=login_key.path,
            known_hosts=self.known_hosts,
            accept_new_host_keys=False,
            connect_timeout=settings.connect_timeout,
        )
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
            "Name": f"flotilla-{self.spec.pool_id}",
            TAG_POOL: self.spec.pool_id,
            TAG_OWNER: _owner(),
            TAG_CLIENT: self._client,
            TAG_CREATED: self._created,
            **self.settings.tags,
        }
        return {"ResourceType": resource, "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}

    def _make_placement_group(self) -> None:
        """A cluster placement group for the pool (network_tier="best"): its instances
        land close together, as EFA traffic wants."""
        name = f"flotilla-{self.spec.pool_id}"
        self.api.call(
            "ec2",
            "create_placement_group",
            "create the pool's placement group",
            GroupName=name,
            Strategy="cluster",
            TagSpecifications=[self._tags("placement-group")],
        )
        self.placement_group = name

    def _make_security_group(self) -> None:
        group = self.api.call(
            "ec2",
            "create_security_group",
            "create the pool's security group",
            GroupName=f"flotilla-{self.spec.pool_id}",
            Description=f"flotilla pool {self.spec.pool_id}: SSH from its client, members",
            VpcId=self._vpc,
            TagSpecifications=[self._tags("security-group")],
        )
        self.security_group = group["GroupId"]
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
    async def start_agent(self, machine: Machine) -> AgentProcess:
        """Wait until the instance answers on port 22, then start the agent over SSH with
        its host key pinned; a start that fails as on a booting instance (see
        ``agent.RETRIED``) is tried again until the start timeout."""
        addr = self._connect_addr(self.instances[machine.ident])
        timeout = self.spec.options.start_timeout
        deadline = time.monotonic() + timeout
        name = f"{machine.ident} ({addr})"
        await wait_port(addr, 22, deadline, name, timeout)
        while True:
            try:
                agent = await start_remote_agent(
                    self.shell,
                    machine,
                    python=self.python,
                    workdir=self.workdir,
                    timeout=max(1.0, deadline - time.monotonic()),
                    env=self.agent_env(machine),
                )
                break
            except ProvisionError as e:
                if e.cause is ProvisionCause.IDENTITY:
                    raise ProvisionError(
                        f"{name}: REFUSED: the instance does not present the SSH host key "
                        "flotilla generated for it and handed over in its user-data (the "
                        "connection may be intercepted, or the AMI does not run cloud-init): "
                        f"{e}",
                        cause=e.cause,
                    ) from None
                if e.cause not in RETRIED or time.monotonic() > deadline:
                    raise ProvisionError(f"{name}: {e}", cause=e.cause) from None
                await asyncio.sleep(0.2)
        return AWSAgent(agent, name, lambda notice: self._on_notice(machine.ident, notice))

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
        return machine

    # -- release -----------------------------------------------------------------------
    async def free(self) -> None:
        busy = list(self._busy)
        if busy:  # an API call of a cancelled launch may still be creating something
            await asyncio.get_running_loop().run_in_executor(None, concurrent.futures.wait, busy)
        try:
            await asyncio.get_running_loop().run_in_executor(_executor, self._release)
        except Exception as e:  # release never raises: report what is left
            _show(f"AWS: could not release everything of pool {self.spec.pool_id}: {e}")
        finally:
            remove_folder(self.folder)

    def _release(self) -> None:
        from .orphans import delete_group, delete_placement_group, terminate

        pool = [{"Name": f"tag:{TAG_POOL}", "Values": [self.spec.pool_id]}]
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
