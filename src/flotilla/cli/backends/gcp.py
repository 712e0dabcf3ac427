"""``--provider gcp``: Compute Engine instances created for the cluster and deleted by
``flotilla down`` (see ``flotilla._providers.gcp``).

A task file chooses it with ``resources: infra: gcp``, ``gcp/<region>`` or
``gcp/<region>/<zone>``; its ``accelerators``, ``cpus`` and ``memory`` choose the machine,
``instance_type`` names one, ``use_spot`` asks for SPOT instances, ``disk_size`` and
``image_id`` set the boot disk. Credentials are Google's Application Default Credentials
(``GOOGLE_APPLICATION_CREDENTIALS``...), never a flag nor kept in the cluster's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._providers.gcp.settings import GCPSettings
from .base import Backend, ResourceSpec, ShellCommand
from .base import ssh_shell as remote_shell

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths


@dataclass(frozen=True)
class GCPSpec(ResourceSpec):
    """Compute Engine instances (settings: ``GCPSettings``); the task's resources (see
    :class:`ResourceSpec`) choose the machine."""

    kind = "gcp"

    def describe(self) -> str:
        where = self.value("zone") or self.value("region", "us-central1")
        market = self.value("allocation", "on-demand")
        return f"gcp ({where}{'' if market == 'on-demand' else ', ' + market})"


class GCPBackend(Backend[GCPSpec]):
    spec_type = GCPSpec
    summary = "Compute Engine instances created for the cluster, deleted by `flotilla down`"
    settings_type = GCPSettings
    honours = frozenset({"cpus", "memory"})
    hint_reason = "Compute Engine has no such setting flotilla knows of"
    infra = ("gcp",)

    def make_provider(self, spec: GCPSpec, nodes_dir: Path) -> Provider:
        from ..._providers.gcp import GCP

        return GCP.from_settings(self.settings_of(spec))

    def remove_orphans(self, spec: GCPSpec, dry_run: bool) -> list[str]:
        """Instances of pools whose client (a killed program, or a cluster daemon) on this
        machine is gone, found by their label; others are listed, not touched."""
        from ..._providers.gcp import GCP

        found = GCP.from_settings(self.settings_of(spec)).remove_orphans(dry_run=dry_run)
        verb = "would delete" if dry_run else "deleted"
        lines = [
            f"{len(found.pools)} orphan pool(s){': ' if found.pools else ''}"
            + ", ".join(found.pools)
        ]
        if found.instances:
            lines.append(f"{verb} {len(found.instances)} instance(s): {', '.join(found.instances)}")
        if found.skipped:
            lines.append(f"not checked (clients on other machines): {', '.join(found.skipped)}")
        return lines

    def market_provider(self) -> Provider:
        from ..._providers.gcp import GCP

        return GCP()

    def check(self) -> str:
        from ..._providers.gcp import GCP

        return GCP().check()

    def shell(
        self, paths: Paths, spec: GCPSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        login = self.ssh_login(paths, spec, nodes, node)
        tty, remote = remote_shell(nodes[node].workdir, command)
        return ShellCommand(("ssh", *login, *tty, remote))

    def ssh_login(
        self, paths: Paths, spec: GCPSpec, nodes: Sequence[NodeRecord], node: int
    ) -> list[str]:
        """The instance's external address, the pool's key, its pinned host keys."""
        from ..._providers.gcp.pool import ssh_login

        return ssh_login(nodes[node].ip)


BACKEND = GCPBackend()
