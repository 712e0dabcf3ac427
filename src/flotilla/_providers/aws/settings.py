"""The AWS provider's settings: one frozen object, checked when made (before anything
starts), that the provider and its allocations read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..._errors import ConfigurationError, check_number
from ..cloud.guard import USER_NAME, guard_command
from ..options import MARKET_OF_TASK, MARKETS, From, option

NETWORK_TIERS = ("standard", "best")
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_NET_GDR_LEVEL": "PHB"}
"""What processes on EFA instances get (unless set): libfabric's EFA provider, GPUDirect
RDMA on p4d/p5, and NCCL's use of it (the aws-ofi-nccl plugin of the Deep Learning AMI)."""


@dataclass(frozen=True)
class AWSSettings:
    """How the AWS provider launches a pool's instances.

    Attributes:
        region: AWS region (default: the configured one, e.g. AWS_DEFAULT_REGION).
        instance_type: use this type instead of choosing one.
        allocation: ``"on-demand"``, ``"spot"`` or ``"spot-if-available"`` (spot, falling
            back to on-demand when no zone has spot capacity). A task file follows
            SkyPilot: ``use_spot: true`` is ``"spot"``, no ``use_spot`` is ``"on-demand"``.
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
            after its boot (the boot guard, see ``cloud.guard``).
        tags: extra tags for every resource of the pool.
        profile: AWS profile of ~/.aws/config (default: the default credential chain).
        ports: TCP ports (``8000``) or ranges (``"8000-8010"``) opened to everyone in the
            pool's security group (a task file's ``ports``); none by default.
        workdir: folder on the instances for flotilla's files.
        python: interpreter on the instances (default: ``python3``, or one of the client's
            minor version found there; see docs/guide.md, "Python on the nodes").
        poweroff_command: what the instance watchdog runs when ``ttl`` expires, and the
            boot guard (as root, with ``FLOTILLA_BOOT_GUARD=1`` set) when no agent started.
        connect_timeout: seconds for one SSH connection attempt.
        network_tier: ``"standard"``, or ``"best"`` (SkyPilot's): an EFA-capable type, the
            instances in a cluster placement group with an EFA interface each, and the
            libfabric/NCCL variables that make NCCL use it (see ``EFA_ENV``).
    """

    region: str | None = option(None, flag="--region", task=From(("infra", "region")))
    instance_type: str | None = option(None, flag="--instance-type", task="instance_type")
    allocation: str = option(
        "spot-if-available", flag="--allocation", choices=MARKETS, task=MARKET_OF_TASK
    )
    ami: str | None = option(None, task="image_id")
    ssh_user: str = option("ubuntu", flag="--aws-user")
    subnet: str | None = option(None, flag="--subnet")
    private_ips: bool = option(False, flag="--private-ips")
    disk_gb: int | None = option(None, task="disk_size")
    ttl: float = option(600.0, flag="--ttl")
    tags: Mapping[str, str] = option(default_factory=dict, task="labels")
    profile: str | None = None
    ports: Sequence[int | str] = option((), task="ports")
    workdir: str = "~/.flotilla"
    python: str | None = None
    poweroff_command: Sequence[str] = option(("sudo", "-n", "poweroff"), flag="--poweroff-command")
    connect_timeout: float = 10.0
    network_tier: str = option("standard", choices=NETWORK_TIERS, task="network_tier")

    def __post_init__(self) -> None:
        if self.network_tier not in NETWORK_TIERS:
            raise ConfigurationError(
                f"AWS(network_tier={self.network_tier!r}): use one of "
                f"{', '.join(map(repr, NETWORK_TIERS))}"
            )
        if self.allocation not in MARKETS:
            raise ConfigurationError(
                f"AWS(allocation={self.allocation!r}): use one of {', '.join(map(repr, MARKETS))}"
            )
        for what, value, prefix in (("ami", self.ami, "ami-"), ("subnet", self.subnet, "subnet-")):
            if value is not None and (not isinstance(value, str) or not value.startswith(prefix)):
                raise ConfigurationError(
                    f"AWS({what}={value!r}): expected an id like {prefix}0123456789abcdef0"
                )
        kind = self.instance_type
        if kind is not None and (not isinstance(kind, str) or "." not in kind):
            raise ConfigurationError(
                f"AWS(instance_type={kind!r}): expected a type name like 'c5.large'"
            )
        disk = self.disk_gb
        check_number(
            disk,
            f"AWS(disk_gb={disk!r}): a whole number of GiB between 8 and 16384",
            whole=True,
            at_least=8,
            at_most=16384,
            or_none=True,
        )
        ttl = self.ttl
        check_number(ttl, f"AWS(ttl={ttl!r}): a positive number of seconds", above=0)
        tags = dict(self.tags or {})
        for key, value in tags.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigurationError(f"AWS(tags=...): keys and values must be strings: {key!r}")
            if key.startswith(("aws:", "flotilla:")) or not 0 < len(key) <= 128 or len(value) > 256:
                raise ConfigurationError(
                    f"AWS(tags=...): tag key {key!r} is not allowed (1-128 characters, not "
                    "starting with 'aws:' or 'flotilla:'; values up to 256 characters)"
                )
        poweroff = self.poweroff_command
        if not poweroff or not all(isinstance(w, str) for w in poweroff):
            raise ConfigurationError("AWS(poweroff_command=...): a non-empty list of strings")
        if not isinstance(self.ssh_user, str) or not USER_NAME.fullmatch(self.ssh_user):
            raise ConfigurationError(
                f"AWS(ssh_user={self.ssh_user!r}): a login name (letters, digits, '_', '.', '-')"
            )
        if not isinstance(self.workdir, str) or not self.workdir.strip():
            raise ConfigurationError(f"AWS(workdir={self.workdir!r}): a folder on the instances")
        try:
            guard_command(ttl, 0, self.workdir, self.ssh_user, poweroff)
        except ValueError as e:
            raise ConfigurationError(
                f"AWS(workdir={self.workdir!r}): {e}; use an absolute path or one under ~ "
                "(the ssh_user's home)"
            ) from None
        object.__setattr__(self, "private_ips", bool(self.private_ips))
        object.__setattr__(self, "ttl", float(ttl))
        object.__setattr__(self, "tags", tags)
        object.__setattr__(self, "ports", tuple(self.ports))
        object.__setattr__(self, "poweroff_command", tuple(poweroff))
        object.__setattr__(self, "connect_timeout", float(self.connect_timeout))
        self.port_ranges()  # checks them

    def port_ranges(self) -> tuple[tuple[int, int], ...]:
        """``ports`` as (first, last) ranges."""
        return tuple(_port_range(p) for p in self.ports)


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
