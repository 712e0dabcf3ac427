"""``--provider vast``: Vast.ai instances rented for the cluster and destroyed by ``flotilla
down`` (see ``flotilla._providers.vast``).

A task file chooses it with ``resources: infra: vast``; its ``accelerators``, ``cpus``,
``memory`` and ``disk_size`` select the offers, ``image_id`` the Docker image, ``region``
the country codes. The API key is never a flag nor kept in the cluster's state: it comes
from ``VAST_API_KEY`` or the official CLI's key file, as for the library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._providers.vast.settings import VastSettings
from .base import Backend, ResourceSpec, ShellCommand
from .base import ssh_shell as remote_shell

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths


@dataclass(frozen=True)
class VastSpec(ResourceSpec):
    """Vast.ai instances (settings: ``VastSettings``); the task's resources (see
    :class:`ResourceSpec`) select the offers."""

    kind = "vast"

    def describe(self) -> str:
        regions = self.value("regions", ())
        return "vast" + (f" ({', '.join(regions)})" if regions else "")


class VastBackend(Backend[VastSpec]):
    spec_type = VastSpec
    summary = "Vast.ai instances rented for the cluster, destroyed by `flotilla down`"
    settings_type = VastSettings
    honours = frozenset({"cpus", "memory"})
    hint_reason = "Vast's offers have no such setting flotilla knows of"
    infra = ("vast", "vastai")

    def make_provider(self, spec: VastSpec, nodes_dir: Path) -> Provider:
        from ..._providers.vast import VastAI

        return VastAI.from_settings(self.settings_of(spec))

    def remove_orphans(self, spec: VastSpec, dry_run: bool) -> list[str]:
        """Instances of pools whose client (a killed program, or a cluster daemon) on this
        machine is gone, found by their label; others are listed, not touched."""
        from ..._providers.vast import VastAI

        found = VastAI.from_settings(self.settings_of(spec)).remove_orphans(dry_run=dry_run)
        verb = "would destroy" if dry_run else "destroyed"
        lines = [
            f"{len(found.pools)} orphan pool(s){': ' if found.pools else ''}"
            + ", ".join(found.pools)
        ]
        if found.instances:
            lines.append(
                f"{verb} {len(found.instances)} instance(s): "
                + ", ".join(map(str, found.instances))
            )
        if found.skipped:
            lines.append(f"not checked (clients on other machines): {', '.join(found.skipped)}")
        return lines

    def market_provider(self) -> Provider:
        from ..._providers.vast import VastAI

        return VastAI()

    def check(self) -> str:
        from ..._providers.vast import VastAI

        return VastAI().check()

    def shell(
        self, paths: Paths, spec: VastSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        login = self.ssh_login(paths, spec, nodes, node)
        tty, remote = remote_shell(nodes[node].workdir, command)
        return ShellCommand(("ssh", *login, *tty, remote))

    def ssh_login(
        self, paths: Paths, spec: VastSpec, nodes: Sequence[NodeRecord], node: int
    ) -> list[str]:
        """The instance's public address and mapped port, the pool's key, its host key."""
        from ..._providers.vast.pool import ssh_login

        return ssh_login(nodes[node].ip)


BACKEND = VastBackend()
