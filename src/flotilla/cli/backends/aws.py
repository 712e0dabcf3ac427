"""``--provider aws``: EC2 instances launched for the cluster and terminated by ``flotilla
down`` (see ``flotilla._providers.aws``).

A task file chooses it with ``resources: infra: aws`` or ``aws/<region>``, and its
``resources`` are acted on (as ``AWSSettings``' fields say): ``use_spot`` (spot only;
otherwise on-demand, as SkyPilot), ``instance_type``, ``accelerators``/``cpus``/``memory``
(the smallest type that has them), ``disk_size`` (GiB), ``image_id``, ``ports`` (opened in
the pool's security group), ``labels`` (tags on every resource) and ``network_tier: best``
(an EFA-capable type in a cluster placement group, EFA interfaces). ``config: {aws: {...}}``
sets any other setting; flags given on the command line win over the task.

``flotilla stop`` stops the instances (StopInstances: their disks stay, no compute is
billed) and ``flotilla start`` (or the next ``launch``) starts the same ones again (see
``flotilla._providers.aws.kept``); spot instances cannot be stopped, so ``stop`` and
``--autostop`` without ``--down`` are refused for spot clusters.

Jobs run in ``WORKDIR/clusters/NAME`` on the instances (``.../node-K`` where instances
share a file system: ``node_ops.describe_nodes``). ``flotilla ssh`` logs in with
the pool's own key and pinned host key, kept by the provider while the cluster runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._errors import ConfigurationError
from ..._providers.aws.settings import AWSSettings
from .base import (
    Backend,
    ResourceSpec,
    ShellCommand,
    orphan_lines,
    ssh_command,
)

if TYPE_CHECKING:
    from ..._providers.aws.kept import KeptPool
    from ..._providers.base import Provider
    from ..state import ClusterRecord, NodeRecord, Paths


@dataclass(frozen=True)
class AWSSpec(ResourceSpec):
    """EC2 instances (settings: ``AWSSettings``); the task's resources (see
    :class:`ResourceSpec`) choose the instance type when none is given."""

    kind = "aws"
    where = "region"
    shown = " {}"


class AWSBackend(Backend[AWSSpec]):
    spec_type = AWSSpec
    settings_type = AWSSettings
    summary = "EC2 instances started for the cluster, terminated by `flotilla down`"
    stop_note = ""  # StopInstances; StartInstances brings the same instances back
    honours = frozenset({"cpus", "memory"})
    hint_reason = "EC2 has no such setting flotilla knows of"
    infra = ("aws",)

    def make_provider(self, spec: AWSSpec, nodes_dir: Path) -> Provider:
        from ..._providers.aws import AWS
        from ..._providers.aws.kept import Keep

        provider = AWS.from_settings(self.settings_of(spec))
        provider.keep = Keep(_keep_folder(nodes_dir.parent))
        return provider

    def stop_refusal(self, paths: Paths, spec: AWSSpec) -> str:
        """Spot instances cannot be stopped: a spot cluster (or a spot-if-available one
        that got spot) is refused."""
        if self.settings_of(spec).allocation == "spot":
            return SPOT_CANNOT_STOP
        kept = _kept(paths)
        if kept is not None and kept.market == "spot":
            return SPOT_CANNOT_STOP
        return ""

    def autostop_refusal(self, spec: AWSSpec) -> str:
        allocation = self.settings_of(spec).allocation
        if allocation != "on-demand":
            return f"{SPOT_CANNOT_STOP} (--allocation {allocation})"
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
        from ..._providers.aws.network import TAG_POOL
        from ..._providers.aws.orphans import delete_group, delete_placement_group, terminate
        from ..._providers.aws.steps import RELEASE_TIMEOUT

        keep = Keep(_keep_folder(paths.dir))
        kept = keep.load()  # unreadable: say so (its instances are not forgotten silently)
        if kept is None:
            keep.forget()
            return
        spec = self.spec_from_dict(record.provider)
        api = AWS.from_settings(self.settings_of(spec)).api
        api.check()
        pool = [{"Name": f"tag:{TAG_POOL}", "Values": [kept.pool]}]
        terminate(api, pool, {i.id for i in kept.instances}, RELEASE_TIMEOUT)
        if kept.security_group:
            delete_group(api, kept.security_group, RELEASE_TIMEOUT)
        if kept.placement_group:
            delete_placement_group(api, kept.placement_group)
        keep.forget()

    def remove_orphans(self, spec: AWSSpec, dry_run: bool) -> list[str]:
        """Instances, security groups and key folders of pools whose client (a killed
        program, or a cluster daemon) is gone, in the region of ``--region`` (else the
        configured one); pools of other machines' clients are listed, not touched."""
        from ..._providers.aws import AWS

        found = AWS.from_settings(self.settings_of(spec)).remove_orphans(dry_run=dry_run)
        removed = (
            ("instance(s)", found.instances),
            ("security group(s)", found.security_groups),
            ("placement group(s)", found.placement_groups),
            ("key folder(s)", found.folders),
        )
        verb = "would remove" if dry_run else "removed"
        lines = orphan_lines(found.pools, verb, removed, found.skipped)
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
        login = self.ssh_login(paths, spec, nodes, node)
        return ssh_command(login, nodes[node].workdir, command)

    def ssh_login(
        self, paths: Paths, spec: AWSSpec, nodes: Sequence[NodeRecord], node: int
    ) -> list[str]:
        """The pool's login key and pinned host key, as its ssh user at the node's address."""
        from ..._providers.aws.keys import ssh_login

        address = nodes[node].ip
        return [*ssh_login(address), f"{self.settings_of(spec).ssh_user}@{address}"]


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
