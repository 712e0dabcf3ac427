"""The EC2 instances of one pool: launch, agents, replace, add and remove (an elastic pool),
release (see ``provider`` for the design). The pool's network is ``network``'s, the stop and
start of a stoppable pool ``stopstart``'s."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import time
from typing import Any

from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..base import AgentProcess, AllocationState, Machine, MachineState, PoolSpec
from ..cloud import login
from ..cloud.allocation import CloudAllocation, CloudShell
from ..cloud.identity import pool_folder
from ..cloud.keys import KeyPair, keygen, pin
from ..cloud.notice import watch_notices
from ..ssh_shell import Target
from .agent import cloud_env
from .api import CAPACITY_CODES, SPOT_QUOTA_CODES, Api, error_code, error_message, translate
from .choice import InstanceChoice, choose_for
from .kept import Keep, KeptPool
from .keys import FOLDER_PREFIX, remove_folder, user_data
from .network import TAG_POOL, PoolNetwork, public_cidr
from .price import Bill, on_demand_price, spot_price
from .price import describe as describe_price
from .settings import AWSSettings
from .steps import RELEASE_TIMEOUT, nothing, run_all, show
from .stopstart import StopStart

logger = logging.getLogger("flotilla.aws")


class AWSAllocation(CloudAllocation):
    """The EC2 instances of one pool (see the module docstring).

    Attributes:
        choice: the instance type and zones.
        market: ``"spot"`` or ``"on-demand"``, as launched.
        zone: the zone the pool launched in.
        instances: instance id -> its description at launch, for every instance launched.
        security_group: the pool's security group id ("" before it exists).
        placement_group: the pool's cluster placement group (network_tier="best"), or "".
        network: the pool's VPC, subnets, groups and tags (``network``).
        stopping: the stop and start of a stoppable pool (``stopstart``).
        ami: the AMI's description (checked against the choice).
        no_choice: why a started pool cannot launch instances ("" when it can).
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
        self.network = PoolNetwork(api, settings, self.tag, self.creating)
        self.folder = pool_folder(FOLDER_PREFIX, self.tag)  # its ``client``: this one
        self.known_hosts = os.path.join(self.folder, "known_hosts")
        self.login_key: KeyPair | None = None
        self.host_keys: dict[str, str] = {}  # instance id -> the public host key it got
        self.no_choice = ""
        self.ami: dict[str, Any] = {}
        self._launches = itertools.count(1)  # (next() is atomic: launches run in threads)
        self.stopping = StopStart(self)
        self.bill = Bill()
        self.instance_type = ""
        self.image_id = ""
        self.python = settings.python or "python3"
        self.workdir = settings.workdir
        with open(os.path.join(self.folder, "place"), "w") as f:
            f.write(api.place)

    @property
    def security_group(self) -> str:
        """The pool's security group id ("" before it exists; see ``network``)."""
        return self.network.security_group

    @property
    def placement_group(self) -> str:
        """The pool's cluster placement group (network_tier="best"), or ""."""
        return self.network.placement_group

    # -- launch ------------------------------------------------------------------------
    async def launch(self) -> None:
        """Check everything, then make the group and launch. Independent API calls run at
        once (the network, the instance choice and AMI, the keys; then the group and the
        spot price): a pool's start waits for 4 API round trips before RunInstances, not 9."""
        settings, spec = self.settings, self.spec
        net = self.network
        network, choice, login_key = await run_all(
            self._in_thread(net.find_subnets),
            self._in_thread(self._choose),
            self._in_thread(keygen, self.folder, "login_key", f"flotilla-{spec.pool_id}"),
        )
        net.subnets, net.vpc, cidrs = network
        zones = tuple(z for z in choice.zones if z in net.subnets)
        if not zones:
            raise ConfigurationError(
                f"{choice.instance_type} is offered in {', '.join(choice.zones)} but the "
                f"subnets are in {', '.join(net.subnets)}: pass AWS(subnet=...) in a zone "
                "that offers it, or another instance type"
            )
        self.choice = choice = dataclasses.replace(choice, zones=zones)
        self.instance_type, self.image_id = choice.instance_type, self.ami["ImageId"]
        self.use_login_key(login_key)
        if settings.private_ips:
            net.client_cidrs = cidrs
        else:
            net.client_cidrs = [await self._in_thread(public_cidr)]
        spot = settings.allocation != "on-demand" and choice.spot
        fallback = spot and settings.allocation == "spot-if-available"
        kind, api = choice.instance_type, self.api
        best = settings.network_tier == "best"
        _, _, spot_cost, on_demand_cost = await run_all(
            self._in_thread(net.make_security_group),
            self._in_thread(net.make_placement_group) if best else nothing(),
            self._in_thread(spot_price, api, kind, zones) if spot else nothing(),
            self._in_thread(on_demand_price, api, kind) if fallback or not spot else nothing(),
        )
        market = "spot" if spot else "on-demand"
        prices = describe_price("spot", spot_cost) + describe_price("on-demand", on_demand_cost)
        known = [p for p in (spot_cost if spot else None, on_demand_cost) if p is not None]
        self.bill.prices = {"spot": spot_cost if spot else None, "on-demand": on_demand_cost}
        node_limit = spec.max_node_hourly_cost
        if node_limit is not None and known and min(known) > node_limit:
            raise ProvisionError(
                f"AWS {self.api.region}: one {choice.instance_type} costs ${min(known):.4g}/h, "
                f"above max_node_hourly_cost=${node_limit:.4g}/h: nothing was launched",
                cause=ProvisionCause.CAPACITY,
            )
        limit = spec.max_hourly_cost
        least = max(spec.nodes, 1 if spec.max_nodes else 0)  # an elastic pool: its first node
        if limit is not None and known and min(known) * least > limit:
            raise ProvisionError(
                f"AWS {self.api.region}: {least} x {choice.instance_type} costs "
                f"${min(known) * least:.2f}/h, above max_hourly_cost=${limit:.2f}/h: "
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
        count = f"up to {spec.most}" if spec.max_nodes else str(spec.nodes)
        show(
            f"AWS {self.api.region}: {count} x {choice.describe()}, {market}"
            f"{' (on-demand if no spot capacity)' if fallback else ''}, "
            f"zones {', '.join(zones)}{prices}, AMI {self.ami['ImageId']}{tier}{more}"
        )
        # an elastic pool's instances are launched one by one as it grows (``candidate``)
        instances = await self._in_thread(self._run, spec.nodes) if spec.nodes else []
        self.machines = [self.machine_of(rank, inst) for rank, inst in enumerate(instances)]
        self.bill.add(*instances)
        self.state = AllocationState.READY
        if self.keep is not None:
            await self._in_thread(self.stopping.record, False)

    async def resume(self, kept: KeptPool) -> None:
        """Start the kept, stopped instances of a stoppable pool instead of launching new
        ones (see ``stopstart``)."""
        await self.stopping.resume(kept)

    def use_login_key(self, login_key: KeyPair) -> None:
        """Log in with ``login_key``, the instances' host keys pinned in ``known_hosts``."""
        self.login_key = login_key
        self.shell = CloudShell(
            self.target,
            key=login_key.path,
            known_hosts=self.known_hosts,
            accept_new_host_keys=False,
            connect_timeout=self.settings.connect_timeout,
        )

    def _choose(self) -> InstanceChoice:
        """The instance choice and its AMI (checked, see ``choice.choose_for``)."""
        choice, self.ami = choose_for(self.api, self.settings, self.spec)
        return choice

    def _run(self, count: int) -> list[dict[str, Any]]:
        """Launch ``count`` instances with one RunInstances (all or none), trying the zones
        and markets in order; the instances in launch-index order, host key pinned."""
        assert self.choice is not None and self.login_key is not None
        launch = next(self._launches)  # an elastic pool's grow steps run at once
        host_key = keygen(self.folder, f"host_key_{launch}", f"flotilla-{self.spec.pool_id}")
        settings = self.settings
        guard = self.guard(settings.poweroff_command)
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
                params = self._launch_params(count, market, zone, data, launch)
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
                    show(f"AWS: launched {market} in {zone} after: {'; '.join(failures)}")
                self.market, self.zone = market, zone
                instances = sorted(reply["Instances"], key=lambda i: int(i["AmiLaunchIndex"]))
                for inst in instances:
                    self.instances[inst["InstanceId"]] = inst
                    self.host_keys[inst["InstanceId"]] = host_key.public
                if not self.settings.private_ips:
                    instances = self._public_addresses(instances)
                for inst in instances:
                    pin(self.known_hosts, self.connect_addr(inst), host_key)
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

    def _launch_params(
        self, count: int, market: str, zone: str, data: str, launch: int
    ) -> dict[str, Any]:
        """RunInstances' arguments (``launch``: the pool's launch number, in its
        idempotency token)."""
        assert self.choice is not None
        params: dict[str, Any] = {
            "ImageId": self.ami["ImageId"],
            "InstanceType": self.choice.instance_type,
            "MinCount": count,
            "MaxCount": count,
            "UserData": data,
            "ClientToken": f"flotilla-{self.spec.pool_id}-{launch}-{market}-{zone}",
            "InstanceInitiatedShutdownBehavior": "terminate",
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
            "NetworkInterfaces": [
                {
                    "DeviceIndex": 0,
                    "SubnetId": self.network.subnets[zone],
                    "Groups": [self.security_group],
                    "AssociatePublicIpAddress": not self.settings.private_ips,
                    "DeleteOnTermination": True,
                }
            ],
            "TagSpecifications": [self.network.tags("instance"), self.network.tags("volume")],
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
                    "DeviceName": self.ami.get("RootDeviceName", "/dev/sda1"),
                    "Ebs": {
                        "VolumeSize": self.settings.disk_gb,
                        "VolumeType": "gp3",
                        "DeleteOnTermination": True,
                    },
                }
            ]
        return params

    def _public_addresses(
        self, instances: list[dict[str, Any]], deadline: float | None = None, after: str = ""
    ) -> list[dict[str, Any]]:
        """The instances once every one has a public address (assigned while pending, or
        while starting again: ``after`` says so in the error), in the same order, recorded
        in ``instances``; ``deadline`` by default start_timeout from now."""
        ids = [i["InstanceId"] for i in instances]
        if deadline is None:
            deadline = time.monotonic() + self.spec.options.start_timeout
        delay = 0.5
        while True:
            if all(i.get("PublicIpAddress") for i in instances):
                return instances
            if self.ending.is_set():
                raise ProvisionError(f"pool {self.tag}: released while starting")
            if time.monotonic() > deadline:
                raise ProvisionError(
                    f"instances {', '.join(ids)} got no public address{after}: use a subnet "
                    "that assigns them, or AWS(private_ips=True) from inside the VPC"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 3.0)
            found = {i["InstanceId"]: i for i in self._describe(ids)}
            instances = [found[i] for i in ids]
            for inst in instances:
                self.instances[inst["InstanceId"]] = inst

    def _describe(self, ids: list[str]) -> list[dict[str, Any]]:
        reply = self.api.call(
            "ec2", "describe_instances", "check the pool's instances", InstanceIds=ids
        )
        return [i for r in reply["Reservations"] for i in r["Instances"]]

    def connect_addr(self, inst: dict[str, Any]) -> str:
        if self.settings.private_ips:
            return str(inst["PrivateIpAddress"])
        return str(inst["PublicIpAddress"])

    def machine_of(self, rank: int, inst: dict[str, Any]) -> Machine:
        return Machine(rank, inst["InstanceId"], inst["PrivateIpAddress"], inst["InstanceId"])

    # -- agents ------------------------------------------------------------------------
    hourly = property(lambda self: self.bill.hourly)  # its instances' $/h (``price.Bill``)
    handover = "handed over in its user-data (or the AMI does not run cloud-init)"

    def target(self, machine: Machine) -> Target:
        return Target(self.connect_addr(self.instances[machine.ident]), self.settings.ssh_user, 22)

    async def start_agent(self, machine: Machine) -> AgentProcess:
        """Wait until the instance answers on port 22, then start the agent over SSH with
        its host key pinned, tried again while it fails as on a booting instance (see
        ``cloud.allocation``); spot interruption notices on its stderr are reported."""
        agent = await super().start_agent(machine)
        # ``flotilla ssh`` and a re-attach find the node by the address peers know it by
        # (private); the client reaches it (host key pinned) at ``target``: public or private
        login.remember(self.folder, machine.address, self.target(machine))
        return watch_notices(
            agent, self.name(machine), lambda notice: self._on_notice(machine.ident, notice)
        )

    def agent_env(self, machine: Machine) -> dict[str, str]:
        """``FLOTILLA_CLOUD``: the instance watchdog's settings (see ``agent.cloud_env``)."""
        instance = self.instances[machine.ident]
        return cloud_env(self.settings, machine.ident, instance, bool(self.placement_group))

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
            raise ProvisionError(f"cannot replace node {rank}: {self.no_choice}")
        old = self.machines[rank]
        (inst,) = await self._in_thread(self._run, 1)
        machine = self.machine_of(rank, inst)
        logger.info("node %d: %s replaced by %s (%s)", rank, old.ident, machine.ident, reason)
        await self._terminate(old.ident, "terminate the lost instance")
        if self.keep is not None:  # the kept record follows (the machine is put later)
            ids = [m.ident for m in self.machines]
            ids[rank] = machine.ident
            await self._in_thread(self.stopping.record, False, ids)
        return machine

    # -- elastic pools: one instance more, one fewer ----------------------------------
    async def candidate(self, rank: int) -> Machine | None:
        """Launch one instance (an elastic pool grows), as the pool's first ones were (type,
        group, tags, zones and markets in order; a new host key). ProvisionError (CAPACITY
        when no zone or market has room): the pool keeps its size and asks again later."""
        if self.state is not AllocationState.READY or self.choice is None:
            why = self.no_choice or f"the pool's allocation is {self.state.value}"
            raise ProvisionError(f"cannot add an instance to pool {self.tag}: {why}")
        (inst,) = await self._in_thread(self._run, 1)
        self.bill.add(inst)
        return self.machine_of(rank, inst)

    async def give_back(self, machine: Machine, failed: bool) -> None:
        """Terminate the instance of a node the pool released (drained first, see
        ``_client/elastic.py``) or whose agent did not start: its bill stops there. A
        failure is logged: the release terminates it (by the pool's tag) in any case."""
        if not await self._terminate(machine.ident, "terminate an instance the pool released"):
            return
        self.bill.remove(machine.ident)
        logger.info("%s terminated (%s)", machine.ident, "did not start" if failed else "released")

    async def _terminate(self, ident: str, what: str) -> bool:
        """Terminate instance ``ident`` (``what`` in an error); whether it was. A failure is
        logged: the release terminates it (by the pool's tag) in any case."""
        try:
            await self._in_thread(
                lambda: self.api.call("ec2", "terminate_instances", what, InstanceIds=[ident])
            )
        except ProvisionError as e:
            logger.warning("%s: %s", ident, e)
            return False
        return True

    # -- release -----------------------------------------------------------------------
    def sweep(self) -> None:
        """Terminate everything of the pool, found by its tag (or stop its instances: a
        stoppable pool closed with ``stop``); synchronous (see ``base.Allocation.sweep``)."""
        keep = self.keep
        try:
            if keep is not None and keep.stop and self.stopping.node_ids():
                if self.market != "spot":
                    self.stopping.stop()
                    return
                show("AWS: spot instances cannot be stopped (EC2 only terminates them)")
            self._release()
            if keep is not None:
                keep.forget()
        except Exception as e:  # release never raises: report what is left
            what = "stop" if keep is not None and keep.stop else "release"
            show(f"AWS: could not {what} everything of pool {self.tag}: {e}")
        finally:
            remove_folder(self.folder)

    def _release(self) -> None:
        from .orphans import delete_group, delete_placement_group, terminate

        pool = [{"Name": f"tag:{TAG_POOL}", "Values": [self.tag]}]
        terminate(self.api, pool, set(self.instances), RELEASE_TIMEOUT)
        self.bill.clear()
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
