"""The AWS provider: ephemeral EC2 instances, reached over SSH with pinned host keys.

Acquiring a pool (:meth:`AWS.acquire`) makes, in order: the instance choice (see
``choice``), a security group of its own (SSH from the client's address, all traffic
between the pool's members, nothing else), the pool's keys (see ``keys``) and ONE
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
client (``_node/cloud.py``). Before the agent starts, a boot guard in the user-data does it
(``guard``): cloud-init starts it at boot, and unless an agent has started (its
watchdog's contact file exists) ``max(ttl, start_timeout)`` s later, it runs the same
power-off command; so an instance that no client ever reaches (the client died right after
RunInstances, SSH is blocked, a bad AMI) ends too. :meth:`AWS.remove_orphans` removes what
such a client left.

Spot interruption notices reach the client as a line on the agent's stderr (see
``_node/cloud.py``); :class:`AWSAgent` takes it out of the stream and reports the machine
lost through :meth:`Allocation.watch`'s callback, two minutes before AWS reclaims it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from ..._errors import ConfigurationError
from ..base import PoolSpec, Provider
from .api import Api
from .guard import USER_NAME, guard_command
from .orphans import Orphans, remove_orphans, sweep
from .pool import AWSAllocation

logger = logging.getLogger("flotilla")

ALLOCATIONS = ("on-demand", "spot", "spot-if-available")


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
            itself off (and so terminates): the bound on what a dead client costs. An
            instance whose agent never starts powers off ``max(ttl, start_timeout)`` s
            after its boot (the boot guard, see ``guard``).
        tags: extra tags for every resource of the pool.
        profile: AWS profile of ~/.aws/config (default: the default credential chain).
        ports: TCP ports (``8000``) or ranges (``"8000-8010"``) opened to everyone in the
            pool's security group (a task file's ``ports``); none by default.
        workdir: folder on the instances for flotilla's files.
        python: interpreter on the instances.
        poweroff_command: what the instance watchdog runs when ``ttl`` expires, and the
            boot guard (as root, with ``FLOTILLA_BOOT_GUARD=1`` set) when no agent started.
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
        if not isinstance(ssh_user, str) or not USER_NAME.fullmatch(ssh_user):
            raise ConfigurationError(
                f"AWS(ssh_user={ssh_user!r}): a login name (letters, digits, '_', '.', '-')"
            )
        if not isinstance(workdir, str) or not workdir.strip():
            raise ConfigurationError(f"AWS(workdir={workdir!r}): a folder on the instances")
        try:
            guard_command(ttl, 0, workdir, ssh_user, poweroff_command)
        except ValueError as e:
            raise ConfigurationError(
                f"AWS(workdir={workdir!r}): {e}; use an absolute path or one under ~ "
                "(the ssh_user's home)"
            ) from None
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
        from ..ssh import _ssh_client

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
        await asyncio.get_running_loop().run_in_executor(None, self._sweep)
        allocation = AWSAllocation(self, spec)
        try:
            await allocation.launch()
        except BaseException:
            await allocation.release()
            raise
        return allocation

    def _sweep(self) -> None:
        """Remove what killed clients of this machine left (see ``orphans.sweep``)."""
        try:
            found = sweep(self.api)
        except Exception as e:  # no permission to list, say: the pool still starts
            logger.debug("the sweep of orphan AWS pools failed: %s", e)
            return
        if found.pools:
            logger.info(
                "removing what killed clients left: pool(s) %s (%d instance(s))",
                ", ".join(found.pools),
                len(found.instances),
            )

    def remove_orphans(self, dry_run: bool = False) -> Orphans:
        """Remove the instances, security groups and key folders of pools whose client
        process (on this machine) is gone: what a killed client left behind. Pools of
        clients on other machines are listed in ``Orphans.skipped``, not touched."""
        self.api.check()
        return remove_orphans(self.api, dry_run)


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
