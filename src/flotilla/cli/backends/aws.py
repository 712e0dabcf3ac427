"""``--provider aws``: EC2 instances launched for the cluster and terminated by ``flotilla
down`` (see ``flotilla._providers.aws``).

A task file chooses it with ``resources: infra: aws`` or ``aws/<region>``, and its
``resources`` are acted on: ``use_spot`` (spot only; otherwise on-demand, as SkyPilot),
``instance_type``, ``accelerators``/``cpus``/``memory`` (the smallest type that has them),
``disk_size`` (GiB), ``image_id``, ``ports`` (opened in the pool's security group),
``labels`` (tags on every resource) and ``network_tier: best`` (an EFA-capable type in a
cluster placement group, EFA interfaces). Flags given on the command line win over the task.

``flotilla stop`` stops the instances (StopInstances: their disks stay, no compute is
billed) and ``flotilla start`` (or the next ``launch``) starts the same ones again (see
``flotilla._providers.aws.kept``); spot instances cannot be stopped, so ``stop`` and
``--autostop`` without ``--down`` are refused for spot clusters.

Jobs run in ``WORKDIR/clusters/NAME/node-K`` on the instances. ``flotilla ssh`` logs in with
the pool's own key and pinned host key, kept by the provider while the cluster runs.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError
from ..._providers.aws.settings import ALLOCATIONS, AWSSettings
from .base import (
    Backend,
    Flag,
    ResourceSpec,
    ShellCommand,
    infra_detail,
    infra_name,
    settings_flags,
    ssh_shell,
)

if TYPE_CHECKING:
    from ..._providers.aws.kept import KeptPool
    from ..._providers.base import Provider
    from ..state import ClusterRecord, NodeRecord, Paths
    from ..taskfile import Task


@dataclass(frozen=True)
class AWSSpec(ResourceSpec):
    """EC2 instances; the task's resources (see :class:`ResourceSpec`) choose the
    instance type when none is given.

    Attributes:
        region: AWS region (None: the configured one).
        instance_type: the instance type (None: the smallest that fits the resources).
        allocation: "on-demand", "spot" or "spot-if-available".
        ami: the AMI id (None: Ubuntu, or the Deep Learning Base AMI for GPU types).
        user: the AMI's login user.
        private_ips: connect to the instances' private addresses (client inside the VPC).
        disk_gb: root volume size in GiB (None: the AMI's).
        ports: TCP ports or ranges ("8000-8010") opened to everyone.
        tags: tags on every resource of the cluster.
        workdir: flotilla's folder on the instances.
        ttl: seconds after the last contact from the client when an instance powers off.
        poweroff_command: what an instance runs when ``ttl`` expires (None: ``sudo -n
            poweroff``).
        network_tier: "standard" or "best" (a task's ``resources.network_tier``).
    """

    kind = "aws"

    region: str | None = None
    instance_type: str | None = None
    allocation: str = "on-demand"
    ami: str | None = None
    user: str = "ubuntu"
    private_ips: bool = False
    disk_gb: int | None = None
    ports: tuple[str, ...] = ()
    tags: tuple[tuple[str, str], ...] = ()
    workdir: str = "~/.flotilla"
    ttl: float = 600.0
    poweroff_command: str | None = None
    network_tier: str = "standard"

    def __post_init__(self) -> None:
        if self.allocation not in ALLOCATIONS:
            raise ConfigurationError(
                f"--allocation {self.allocation!r}: use one of {', '.join(ALLOCATIONS)}"
            )
        # lists of pairs come back from the state file as lists: tuples again
        object.__setattr__(self, "tags", tuple(tuple(t) for t in self.tags))
        self.provider_options()  # the provider's own checks, before anything starts

    def describe(self) -> str:
        return f"aws {self.region}" if self.region else "aws"

    def provider_options(self) -> dict[str, Any]:
        """The AWS provider's arguments (it checks them)."""

        options: dict[str, Any] = {
            "region": self.region,
            "instance_type": self.instance_type,
            "allocation": self.allocation,
            "ami": self.ami,
            "ssh_user": self.user,
            "private_ips": self.private_ips,
            "disk_gb": self.disk_gb,
            "ttl": self.ttl,
            "tags": dict(self.tags),
            "ports": self.ports,
            "workdir": self.workdir,
            "network_tier": self.network_tier,
        }
        if self.poweroff_command:
            options["poweroff_command"] = shlex.split(self.poweroff_command)
        options.update(self.settings)
        AWSSettings(**options)  # raises a ConfigurationError for a bad value
        return options


class AWSBackend(Backend[AWSSpec]):
    spec_type = AWSSpec
    settings_type = AWSSettings
    summary = "EC2 instances started for the cluster, terminated by `flotilla down`"
    stop_note = ""  # StopInstances; StartInstances brings the same instances back
    flags = (
        *settings_flags(
            AWSSettings,
            {
                "region": "--region",
                "instance_type": "--instance-type",
                "allocation": "--allocation",
                "ssh_user": "--aws-user",
                "private_ips": "--private-ips",
                "workdir": "--aws-workdir",
                "ttl": "--ttl",
            },
            choices={"allocation": ALLOCATIONS},
        ),
        Flag(
            "--poweroff-command",
            "what instances run when --ttl expires (sudo -n poweroff)",
            setting="poweroff_command",
        ),
    )
    pass_through = settings_flags(
        AWSSettings,
        {
            "subnet": "--subnet",
            "profile": "--aws-profile",
            "python": "--aws-python",
            "connect_timeout": "--aws-connect-timeout",
        },
    )
    fixed = {
        "ami": "a task's resources.image_id",
        "disk_gb": "a task's resources.disk_size",
        "tags": "a task's resources.labels",
        "ports": "a task's resources.ports",
        "network_tier": "a task's resources.network_tier",
    }
    honours = frozenset(
        {
            "region",
            "instance_type",
            "image_id",
            "use_spot",
            "disk_size",
            "labels",
            "cpus",
            "memory",
            "ports",
            "network_tier",
        }
    )
    hint_reason = "EC2 has no such setting flotilla knows of"
    infra = ("aws",)

    def spec_from_args(self, args: argparse.Namespace) -> AWSSpec:
        options: dict[str, Any] = {
            "region": args.region,
            "instance_type": args.instance_type,
            "private_ips": args.private_ips,
            "poweroff_command": args.poweroff_command,
        }
        for name, value in (
            ("allocation", args.allocation),
            ("user", args.aws_user),
            ("workdir", args.aws_workdir),
            ("ttl", args.ttl),
        ):
            if value is not None:
                options[name] = value
        return AWSSpec(**options)

    def with_task(self, spec: AWSSpec, task: Task) -> AWSSpec:
        res = task.resources
        region = spec.region or res.region
        if infra_name(res.infra) in self.infra:
            region = spec.region or infra_detail(res.infra) or region
        allocation = spec.allocation
        if res.use_spot and allocation == "on-demand":
            allocation = "spot"
        return spec.with_task_resources(
            task,
            region=region,
            instance_type=spec.instance_type or res.instance_type,
            allocation=allocation,
            ami=spec.ami or res.image_id,
            disk_gb=spec.disk_gb or res.disk_size,
            ports=spec.ports or tuple(str(p) for p in res.ports),
            tags=spec.tags or tuple(sorted((str(k), str(v)) for k, v in res.labels.items())),
            network_tier="best" if res.network_tier == "best" else spec.network_tier,
        )

    def make_provider(self, spec: AWSSpec, nodes_dir: Path) -> Provider:
        from ..._providers.aws import AWS
        from ..._providers.aws.kept import Keep

        provider = AWS.from_settings(AWSSettings(**spec.provider_options()))
        provider.keep = Keep(_keep_folder(nodes_dir.parent))
        return provider

    def stop_refusal(self, paths: Paths, spec: AWSSpec) -> str:
        """Spot instances cannot be stopped: a spot cluster (or a spot-if-available one
        that got spot) is refused."""
        if spec.allocation == "spot":
            return SPOT_CANNOT_STOP
        kept = _kept(paths)
        if kept is not None and kept.market == "spot":
            return SPOT_CANNOT_STOP
        return ""

    def autostop_refusal(self, spec: AWSSpec) -> str:
        if spec.allocation != "on-demand":
            return f"{SPOT_CANNOT_STOP} (--allocation {spec.allocation})"
        return ""

    def before_close(self, provider: Provider, keep: bool) -> None:
        """Closing the pool stops the instances (``keep``) or terminates them."""
        from ..._providers.aws import AWS

        if isinstance(provider, AWS) and provider.keep is not None:
            provider.keep.stop = keep

    def restartable(self, paths: Paths) -> bool:
        kept = _kept(paths)
        return kept is not None and kept.stopped

    def on_down(self, paths: Paths, record: ClusterRecord) -> None:
        """``down`` of a stopped cluster (or one whose daemon died): terminate its kept
        instances, delete its security and placement groups and the kept keys."""
        from ..._providers.aws import AWS
        from ..._providers.aws.kept import Keep
        from ..._providers.aws.orphans import delete_group, delete_placement_group, terminate
        from ..._providers.aws.pool import RELEASE_TIMEOUT, TAG_POOL

        keep = Keep(_keep_folder(paths.dir))
        kept = keep.load()  # unreadable: say so (its instances are not forgotten silently)
        if kept is None:
            keep.forget()
            return
        spec = self.spec_from_dict(record.provider)
        api = AWS.from_settings(AWSSettings(**spec.provider_options())).api
        api.check()
        pool = [{"Name": f"tag:{TAG_POOL}", "Values": [kept.pool]}]
        terminate(api, pool, {i.id for i in kept.instances}, RELEASE_TIMEOUT)
        if kept.security_group:
            delete_group(api, kept.security_group, RELEASE_TIMEOUT)
        if kept.placement_group:
            delete_placement_group(api, kept.placement_group)
        keep.forget()

    def remove_orphans(self, region: str | None, dry_run: bool) -> list[str]:
        """Instances, security groups and key folders of pools whose client (a killed
        program, or a cluster daemon) is gone; pools of other machines' clients are
        listed, not touched."""
        from ..._providers.aws import AWS

        found = AWS(region=region).remove_orphans(dry_run=dry_run)
        verb = "would remove" if dry_run else "removed"
        lines = [
            f"{len(found.pools)} orphan pool(s){': ' if found.pools else ''}"
            + ", ".join(found.pools)
        ]
        for what, items in (
            ("instance(s)", found.instances),
            ("security group(s)", found.security_groups),
            ("placement group(s)", found.placement_groups),
            ("key folder(s)", found.folders),
        ):
            if items:
                lines.append(f"{verb} {len(items)} {what}: {', '.join(items)}")
        if found.skipped:
            lines.append(f"not checked (clients on other machines): {', '.join(found.skipped)}")
        if found.stopped:
            lines.append(
                f"kept (stopped clusters; `flotilla down NAME` removes them): "
                f"{', '.join(found.stopped)}"
            )
        return lines

    def market_provider(self) -> Provider:
        from ..._providers.aws import AWS

        return AWS()

    def check(self) -> str:
        from ..._providers.aws import AWS

        aws = AWS()
        aws.api.check()
        aws.api.call(
            "ec2", "describe_regions", "check the credentials", RegionNames=[aws.api.region]
        )
        return f"credentials accepted in {aws.api.region}"

    def shell(
        self, paths: Paths, spec: AWSSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        from ..._providers.aws.keys import ssh_login

        address = nodes[node].ip
        login = [*ssh_login(address), f"{spec.user}@{address}"]
        tty, remote = ssh_shell(nodes[node].workdir, command)
        return ShellCommand(("ssh", *login, *tty, remote))


SPOT_CANNOT_STOP = (
    "its instances are spot instances, which EC2 cannot stop (only terminate, losing their disks)"
)


def _keep_folder(cluster_dir: Path) -> Path:
    """Where a cluster keeps its stoppable pool's instances and login key."""
    return cluster_dir / "aws"


def _kept(paths: Paths) -> KeptPool | None:
    """The cluster's kept pool record (None: none, or unreadable)."""
    from ..._providers.aws.kept import Keep

    try:
        return Keep(_keep_folder(paths.dir)).load()
    except ConfigurationError:
        return None


BACKEND = AWSBackend()
