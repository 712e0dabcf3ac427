"""The AWS provider: ephemeral EC2 instances, reached over SSH with pinned host keys.

Acquiring a pool (:meth:`AWS.acquire`) makes, in order: the instance choice (see
``aws_choice``), a security group of its own (SSH from the client's address, all traffic
between the pool's members, nothing else), the pool's keys (see ``aws_keys``) and ONE
RunInstances call for all the nodes, with ``MinCount = MaxCount = nodes``: EC2 launches all
of them or none, so a partial launch is never kept. Spot (``allocation``) goes through
InstanceMarketOptions; a capacity error moves to the next zone that offers the type, then,
for ``"spot-if-available"``, to on-demand.

An instance is then an SSH host: the SSH provider's path starts the agents (the client's
exact flotilla, shipped by content hash), for all nodes at once, each first waiting for its
instance's port 22. Peers and ``head_addr`` are the private addresses.

Nothing is left behind: :meth:`AWSAllocation.release` (end of the block, an exception,
Ctrl-C) terminates every instance tagged with the pool (also ones a lost response did not
report), checks they are terminated, deletes the security group and the local key folder.
When the client dies, the instances end themselves: shutdown behaviour "terminate" plus a
watchdog started with the agent that powers off ``ttl`` s after the last contact from the
client (``_node/cloud.py``); :meth:`AWS.remove_orphans` removes what such a client left.

Spot interruption notices reach the client as a line on the agent's stderr (see
``_node/cloud.py``); :class:`AWSAgent` takes it out of the stream and reports the machine
lost through :meth:`Allocation.watch`'s callback, two minutes before AWS reclaims it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import shlex
import socket
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from .._errors import ConfigurationError, ProvisionError
from .._node.cloud import ENV as CLOUD_ENV
from .._node.cloud import NOTICE
from .aws_api import CAPACITY_CODES, SPOT_QUOTA_CODES, Api, error_code, error_message, translate
from .aws_choice import InstanceChoice, check_ami, choose, default_ami
from .aws_keys import KeyPair, keygen, pin, pool_folder, remove_folder, user_data
from .aws_orphans import Orphans, client_id, remove_orphans
from .base import (
    AgentProcess,
    Allocation,
    AllocationState,
    FramesCallback,
    Machine,
    MachineState,
    PoolSpec,
    Provider,
)
from .bootstrap import Bundle, client_bundle
from .ssh import SSH, SSHHost, _Target

logger = logging.getLogger("flotilla.aws")

ALLOCATIONS = ("on-demand", "spot", "spot-if-available")
IMDS = "http://169.254.169.254"
TAG_POOL = "flotilla:pool"
TAG_OWNER = "flotilla:owner"
TAG_CLIENT = "flotilla:client"
TAG_CREATED = "flotilla:created"
RELEASE_TIMEOUT = 600.0
"""Seconds release() keeps checking that instances terminated and the group can go."""
_TRANSIENT = (
    "Connection refused",
    "No route to host",
    "timed out",
    "Connection closed",
    "Connection reset",
    "kex_exchange_identification",
    "ended without answering",
)
"""SSH failures of an instance that is still booting (sshd not up or restarting)."""

_T = TypeVar("_T")
_executor = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="flotilla-aws")


class AWS(Provider):
    """Run the nodes on EC2 instances started for the pool and terminated after it.

    Needs boto3 (``pip install 'flotilla[aws]'``), AWS credentials, and OpenSSH's ``ssh``
    and ``ssh-keygen`` on this machine. The pool's ``accelerator``, ``vcpus`` and
    ``memory_gb`` choose the smallest instance type that has them.

    Args:
        region: AWS region (default: the configured one, e.g. AWS_DEFAULT_REGION).
        instance_type: use this type instead of choosing one.
        allocation: ``"on-demand"``, ``"spot"`` or ``"spot-if-available"`` (spot, falling
            back to on-demand when no zone has spot capacity).
        ami: AMI id (default: Ubuntu 24.04, or the Deep Learning Base AMI for GPU types,
            from AWS's public SSM parameters). It must run cloud-init and Python >= 3.11.
        ssh_user: the AMI's login user.
        subnet: subnet id to launch in (default: the default VPC, any zone).
        private_ips: connect to the instances' private addresses (a client inside the VPC
            or on a VPN to it) instead of public ones; no public address is assigned.
        disk_gb: root volume size in GiB (default: the AMI's).
        ttl: seconds after the last contact from the client when an instance powers
            itself off (and so terminates): the bound on what a dead client costs.
        tags: extra tags for every resource of the pool.
        profile: AWS profile of ~/.aws/config (default: the default credential chain).
        ports: TCP ports (``8000``) or ranges (``"8000-8010"``) opened to everyone in the
            pool's security group (a task file's ``ports``); none by default.
        workdir: folder on the instances for flotilla's files.
        python: interpreter on the instances.
        poweroff_command: what the instance watchdog runs when ``ttl`` expires.
        connect_timeout: seconds for one SSH connection attempt.
    """

    name = "aws"

    def __init__(
        self,
        region: str | None = None,
        instance_type: str | None = None,
        allocation: str = "spot-if-available",
        ami: str | None = None,
        ssh_user: str = "ubuntu",
        subnet: str | None = None,
        private_ips: bool = False,
        disk_gb: int | None = None,
        ttl: float = 600,
        tags: dict[str, str] | None = None,
        profile: str | None = None,
        *,
        ports: Sequence[int | str] = (),
        workdir: str = "~/.flotilla",
        python: str = "python3",
        poweroff_command: Sequence[str] = ("sudo", "-n", "poweroff"),
        connect_timeout: float = 10.0,
    ) -> None:
        if allocation not in ALLOCATIONS:
            raise ConfigurationError(
                f"AWS(allocation={allocation!r}): use one of {', '.join(map(repr, ALLOCATIONS))}"
            )
        for what, value, prefix in (("ami", ami, "ami-"), ("subnet", subnet, "subnet-")):
            if value is not None and (not isinstance(value, str) or not value.startswith(prefix)):
                raise ConfigurationError(
                    f"AWS({what}={value!r}): expected an id like {prefix}0123456789abcdef0"
                )
        if instance_type is not None and (
            not isinstance(instance_type, str) or "." not in instance_type
        ):
            raise ConfigurationError(
                f"AWS(instance_type={instance_type!r}): expected a type name like 'c5.large'"
            )
        if disk_gb is not None and (
            isinstance(disk_gb, bool) or not isinstance(disk_gb, int) or not 8 <= disk_gb <= 16384
        ):
            raise ConfigurationError(
                f"AWS(disk_gb={disk_gb!r}): a whole number of GiB between 8 and 16384"
            )
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
            raise ConfigurationError(f"AWS(ttl={ttl!r}): a positive number of seconds")
        tags = dict(tags or {})
        for key, value in tags.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigurationError(f"AWS(tags=...): keys and values must be strings: {key!r}")
            if key.startswith(("aws:", "flotilla:")) or not 0 < len(key) <= 128 or len(value) > 256:
                raise ConfigurationError(
                    f"AWS(tags=...): tag key {key!r} is not allowed (1-128 characters, not "
                    "starting with 'aws:' or 'flotilla:'; values up to 256 characters)"
                )
        if not poweroff_command or not all(isinstance(w, str) for w in poweroff_command):
            raise ConfigurationError("AWS(poweroff_command=...): a non-empty list of strings")
        if not isinstance(ssh_user, str) or not ssh_user.strip():
            raise ConfigurationError(f"AWS(ssh_user={ssh_user!r}): a user name")
        self.region = region
        self.instance_type = instance_type
        self.allocation = allocation
        self.ami = ami
        self.ssh_user = ssh_user
        self.subnet = subnet
        self.private_ips = bool(private_ips)
        self.disk_gb = disk_gb
        self.ttl = float(ttl)
        self.tags = tags
        self.profile = profile
        self.ports = tuple(_port_range(p) for p in ports)
        self.workdir = workdir
        self.home = workdir
        self.python = python
        self.poweroff_command = tuple(poweroff_command)
        self.connect_timeout = float(connect_timeout)
        self._api: Api | None = None

    def __repr__(self) -> str:
        return f"AWS(region={self.region!r}, allocation={self.allocation!r})"

    @property
    def api(self) -> Api:
        if self._api is None:
            self._api = Api(self.region, self.profile)
        return self._api

    def validate(self, spec: PoolSpec) -> None:
        self.api.check()
        from .ssh import _ssh_client

        _ssh_client()
        if self.ttl <= spec.options.heartbeat_timeout:
            raise ConfigurationError(
                f"AWS(ttl={self.ttl:g}) must exceed Options(heartbeat_timeout="
                f"{spec.options.heartbeat_timeout:g}): the client may be silent that long, and "
                "the instances would power themselves off under a live pool"
            )
        if spec.vcpus is not None and spec.vcpus <= 0:
            raise ConfigurationError(f"vcpus={spec.vcpus!r}: a positive number")
        if spec.memory_gb is not None and spec.memory_gb <= 0:
            raise ConfigurationError(f"memory_gb={spec.memory_gb!r}: a positive number")

    def agent_command(self) -> list[str]:
        return [self.python, "-m", "flotilla.agent"]

    async def acquire(self, spec: PoolSpec) -> AWSAllocation:
        """Launch the pool's instances (see the module docstring); on failure or
        cancellation everything made so far is removed before the error propagates."""
        allocation = AWSAllocation(self, spec)
        try:
            await allocation.launch()
        except BaseException:
            await allocation.release()
            raise
        return allocation

    def remove_orphans(self, dry_run: bool = False) -> Orphans:
        """Remove the instances, security groups and key folders of pools whose client
        process (on this machine) is gone: what a killed client left behind. Pools of
        clients on other machines are listed in ``Orphans.skipped``, not touched."""
        self.api.check()
        return remove_orphans(self.api, dry_run)


class _InstanceSSH(SSH):
    """The SSH provider's agent start, for instances: the pool's login key, the pool's
    known_hosts (host keys pinned), and ``FLOTILLA_CLOUD`` set for the agent."""

    def __init__(self, provider: AWS, login_key: str, known_hosts: str) -> None:
        super().__init__(
            [SSHHost("instance")],
            user=provider.ssh_user,
            key=login_key,
            known_hosts=known_hosts,
            python=provider.python,
            workdir=provider.workdir,
            connect_timeout=provider.connect_timeout,
        )
        self.cloud_env: dict[str, str] = {}  # connect address -> FLOTILLA_CLOUD

    def ssh_argv(self, target: _Target, command: str, *extra: str) -> list[str]:
        env = self.cloud_env.get(target.host)
        if env:
            command = f"export {CLOUD_ENV}={shlex.quote(env)}; {command}"
        return super().ssh_argv(target, command, *extra)


class AWSAllocation(Allocation):
    """The EC2 instances of one pool (see the module docstring).

    Attributes:
        choice: the instance type and zones.
        market: ``"spot"`` or ``"on-demand"``, as launched.
        zone: the zone the pool launched in.
        instances: instance id -> its description at launch, for every instance launched.
        security_group: the pool's security group id ("" before it exists).
        folder: the local folder with the pool's keys and known_hosts.
    """

    def __init__(self, provider: AWS, spec: PoolSpec) -> None:
        super().__init__(spec, [])
        self.state = AllocationState.ACQUIRING
        self.provider = provider
        self.api = provider.api
        self.choice: InstanceChoice | None = None
        self.market = ""
        self.zone = ""
        self.instances: dict[str, dict[str, Any]] = {}
        self.security_group = ""
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
        self._ssh: _InstanceSSH | None = None
        self._bundle: Bundle | None = None
        self._launches = 0
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
        provider, spec = self.provider, self.spec
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
        self._ssh = _InstanceSSH(provider, login_key.path, self.known_hosts)
        if provider.private_ips:
            self._client_cidrs = cidrs
        else:
            self._client_cidrs = [await self._in_thread(_public_cidr)]
        spot = provider.allocation != "on-demand" and choice.spot
        _, price = await _all(
            self._in_thread(self._make_security_group),
            self._in_thread(self._spot_price, choice) if spot else _nothing(),
        )
        market = "spot" if spot else "on-demand"
        fallback = ""
        if spot and provider.allocation == "spot-if-available":
            fallback = " (on-demand if no spot capacity)"
        _show(
            f"AWS {self.api.region}: {spec.nodes} x {choice.describe()}, {market}{fallback}, "
            f"zones {', '.join(zones)}{price}, AMI {self._image['ImageId']}"
        )
        instances = await self._in_thread(self._run, spec.nodes)
        self.machines = [self._machine(rank, inst) for rank, inst in enumerate(instances)]
        self.state = AllocationState.READY

    def _choose(self) -> InstanceChoice:
        """The instance choice and its AMI (checked)."""
        provider, spec = self.provider, self.spec
        choice = choose(
            self.api,
            provider.instance_type,
            spec.accelerator,
            spec.vcpus,
            spec.memory_gb,
            provider.allocation == "spot",
            None,
        )
        ami = provider.ami or default_ami(self.api, choice)
        self._image = check_ami(self.api, ami, choice)
        return choice

    def _find_subnets(self) -> tuple[dict[str, str], str, list[str]]:
        """(zone -> subnet, VPC id, the VPC's CIDRs): the given subnet, or one subnet per
        zone of the default VPC (its default subnets first)."""
        subnet = self.provider.subnet
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

    def _spot_price(self, choice: InstanceChoice) -> str:
        try:
            history = self.api.raw(
                "ec2",
                "describe_spot_price_history",
                InstanceTypes=[choice.instance_type],
                ProductDescriptions=["Linux/UNIX"],
                StartTime=datetime.now(UTC),
            )["SpotPriceHistory"]
        except Exception:  # the price is informative only
            return ""
        prices = [float(h["SpotPrice"]) for h in history if h["AvailabilityZone"] in choice.zones]
        return f", spot price from ${min(prices):.4g}/h" if prices else ""

    def _tags(self, resource: str) -> dict[str, Any]:
        tags = {
            "Name": f"flotilla-{self.spec.pool_id}",
            TAG_POOL: self.spec.pool_id,
            TAG_OWNER: _owner(),
            TAG_CLIENT: self._client,
            TAG_CREATED: self._created,
            **self.provider.tags,
        }
        return {"ResourceType": resource, "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}

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
                    for low, high in self.provider.ports
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
        data = user_data(host_key, self.login_key)
        allocation = self.provider.allocation
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
                if not self.provider.private_ips:
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
            f"({'; '.join(failures)}): {how}, or try again later"
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
                    "AssociatePublicIpAddress": not self.provider.private_ips,
                    "DeleteOnTermination": True,
                }
            ],
            "TagSpecifications": [self._tags("instance"), self._tags("volume")],
        }
        if market == "spot":
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        if self.provider.disk_gb:
            params["BlockDeviceMappings"] = [
                {
                    "DeviceName": self._image.get("RootDeviceName", "/dev/sda1"),
                    "Ebs": {
                        "VolumeSize": self.provider.disk_gb,
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
        if self.provider.private_ips:
            return str(inst["PrivateIpAddress"])
        return str(inst["PublicIpAddress"])

    def _machine(self, rank: int, inst: dict[str, Any]) -> Machine:
        machine = Machine(rank, inst["InstanceId"], inst["PrivateIpAddress"], inst["InstanceId"])
        self.mark(machine, MachineState.PENDING)
        return machine

    # -- agents ------------------------------------------------------------------------
    async def start_agent(self, machine: Machine, command: list[str]) -> AgentProcess:
        """Wait until the instance answers on port 22, then start the agent over SSH with
        its host key pinned (``command`` is the bootstrap's, not used)."""
        assert self._ssh is not None
        inst = self.instances[machine.ident]
        addr = self._connect_addr(inst)
        target = _Target(host=addr, user=self.provider.ssh_user, port=22, address=machine.address)
        spot = inst.get("InstanceLifecycle") == "spot"
        self._ssh.cloud_env[addr] = json.dumps(
            {
                "contact": f"{self.provider.workdir}/watchdog/{machine.ident}",
                "ttl": self.provider.ttl,
                "poweroff": list(self.provider.poweroff_command),
                "imds": IMDS if spot else "",
            }
        )
        if self._bundle is None:
            self._bundle = await asyncio.get_running_loop().run_in_executor(None, client_bundle)
        timeout = self.spec.options.start_timeout
        deadline = time.monotonic() + timeout
        name = f"{machine.ident} ({addr})"
        await _wait_port(addr, 22, deadline, name, timeout)
        while True:
            try:
                agent = await self._ssh.start_one(
                    target, self._bundle, max(1.0, deadline - time.monotonic())
                )
                break
            except ProvisionError as e:
                text = str(e)
                if "REFUSED" in text:
                    raise ProvisionError(
                        f"{name}: REFUSED: the instance does not present the SSH host key "
                        "flotilla generated for it and handed over in its user-data (the "
                        "connection may be intercepted, or the AMI does not run cloud-init): "
                        f"{text}"
                    ) from None
                if not any(t in text for t in _TRANSIENT) or time.monotonic() > deadline:
                    raise ProvisionError(f"{name}: {text}") from None
                await asyncio.sleep(0.2)
        return AWSAgent(agent, name, lambda notice: self._on_notice(machine.ident, notice))

    def _on_notice(self, ident: str, notice: dict[str, Any]) -> None:
        for rank, machine in enumerate(self.machines):
            if machine.ident == ident and self.machine_states.get(ident) is not MachineState.LOST:
                action, when = notice.get("action", "terminate"), notice.get("time", "soon")
                reason = f"spot interruption notice: AWS will {action} {ident} at {when}"
                logger.warning("%s", reason)
                self.report_lost(rank, reason)

    # -- replace -----------------------------------------------------------------------
    async def replace(self, rank: int, reason: str) -> Machine:
        """Launch one new instance for ``rank`` (same type, group, tags; a new host key)
        and terminate the old one."""
        if self.state is not AllocationState.READY:
            raise ProvisionError(
                f"cannot replace node {rank}: the pool's allocation is {self.state.value}"
            )
        old = self.machines[rank]
        (inst,) = await self._in_thread(self._run, 1)
        machine = self._machine(rank, inst)
        self.machines[rank] = machine
        self.mark(old, MachineState.RELEASED)
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
    async def release(self) -> None:
        if self.state in (AllocationState.RELEASING, AllocationState.RELEASED):
            return
        self.state = AllocationState.RELEASING
        busy = list(self._busy)
        if busy:  # an API call of a cancelled launch may still be creating something
            await asyncio.get_running_loop().run_in_executor(None, concurrent.futures.wait, busy)
        try:
            await asyncio.get_running_loop().run_in_executor(_executor, self._release)
        except Exception as e:  # release never raises: report what is left
            _show(f"AWS: could not release everything of pool {self.spec.pool_id}: {e}")
        finally:
            remove_folder(self.folder)
            for machine in self.machines:
                self.mark(machine, MachineState.RELEASED)
            self.state = AllocationState.RELEASED

    def _release(self) -> None:
        from .aws_orphans import delete_group, terminate

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


class AWSAgent(AgentProcess):
    """An agent on an instance: the SSH agent, with interruption notices taken out of its
    stderr and handed to ``on_notice``."""

    def __init__(
        self, inner: AgentProcess, host: str, on_notice: Callable[[dict[str, Any]], None]
    ) -> None:
        self.inner = inner
        self.address = inner.address
        self.host = host
        self.on_notice = on_notice

    def write(self, parts: Sequence[Any]) -> None:
        self.inner.write(parts)

    def start_reading(
        self,
        loop: asyncio.AbstractEventLoop,
        on_frames: FramesCallback,
        on_stderr: Callable[[bytes], None],
    ) -> None:
        def filtered(data: bytes) -> None:  # whole lines (the SSH agent passes whole lines)
            kept = []
            for line in data.splitlines(keepends=True):
                if line.startswith(NOTICE):
                    try:
                        notice = json.loads(line[len(NOTICE) :])
                    except ValueError:
                        notice = {}
                    self.on_notice(notice if isinstance(notice, dict) else {})
                else:
                    kept.append(line)
            if kept:
                on_stderr(b"".join(kept))

        self.inner.start_reading(loop, on_frames, filtered)

    async def wait(self, timeout: float) -> int | None:
        return await self.inner.wait(timeout)

    async def terminate(self) -> None:
        await self.inner.terminate()

    def exit_status(self) -> int | None:
        return self.inner.exit_status()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _all(*steps: Awaitable[Any]) -> list[Any]:
    """Run ``steps`` at once; their results. On a failure every step is still awaited
    (nothing runs on unobserved) and the first failure in order is raised."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


async def _nothing() -> str:
    return ""


async def _wait_port(addr: str, port: int, deadline: float, name: str, timeout: float) -> None:
    """Wait until ``addr:port`` accepts a TCP connection (the instance's sshd is up)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProvisionError(
                f"{name}: SSH (port {port}) did not answer within {timeout:g} s of the launch "
                "(Options(start_timeout=...) sets the limit; is the security group's SSH rule "
                "for this machine's address, and private_ips= right?)"
            )
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(addr, port), min(1.0, left))
        except (OSError, TimeoutError):
            await asyncio.sleep(0.1)
            continue
        writer.close()
        return


def _port_range(port: int | str) -> tuple[int, int]:
    """``8000`` or ``"8000-8010"`` as (first, last); ConfigurationError otherwise."""
    text = str(port).strip()
    low, sep, high = text.partition("-")
    try:
        first, last = int(low), int(high if sep else low)
    except ValueError:
        first = last = 0
    if isinstance(port, bool) or not 0 < first <= last < 65536:
        raise ConfigurationError(
            f"AWS(ports=[{port!r}]): a TCP port (8000) or range ('8000-8010') within 1-65535"
        )
    return first, last


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
