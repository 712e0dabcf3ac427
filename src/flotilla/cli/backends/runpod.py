"""``--provider runpod``: RunPod GPU pods rented for the cluster and terminated by
``flotilla down`` (see ``flotilla._providers.runpod``).

A task file chooses it with ``resources: infra: runpod`` (``runpod/EU-RO-1`` for a data
center); its ``accelerators`` select the GPU types, ``use_spot`` interruptible pods,
``disk_size`` the container disk, ``image_id`` the image, ``region`` the data centers. The
API key is never a flag nor kept in the cluster's state: it comes from
``RUNPOD_API_KEY`` or the official client's ``~/.runpod/config.toml``, as for the library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._providers.runpod.settings import RunPodSettings
from .base import Backend, ResourceSpec, ShellCommand
from .base import ssh_shell as remote_shell

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths


@dataclass(frozen=True)
class RunPodSpec(ResourceSpec):
    """RunPod instances (settings: ``RunPodSettings``); the task's resources (see
    :class:`ResourceSpec`) select the offers."""

    kind = "runpod"

    def describe(self) -> str:
        regions = self.value("data_centers", ())
        return "runpod" + (f" ({', '.join(regions)})" if regions else "")


class RunPodBackend(Backend[RunPodSpec]):
    spec_type = RunPodSpec
    summary = "RunPod GPU pods rented for the cluster, terminated by `flotilla down`"
    settings_type = RunPodSettings
    hint_reason = "RunPod's pods have no such setting flotilla knows of"
    infra = ("runpod",)

    def make_provider(self, spec: RunPodSpec, nodes_dir: Path) -> Provider:
        from ..._providers.runpod import RunPod

        return RunPod.from_settings(self.settings_of(spec))

    def remove_orphans(self, spec: RunPodSpec, dry_run: bool) -> list[str]:
        """Pods of pools whose client (a killed program, or a cluster daemon) on this
        machine is gone, found by their label; others are listed, not touched."""
        from ..._providers.runpod import RunPod

        found = RunPod.from_settings(self.settings_of(spec)).remove_orphans(dry_run=dry_run)
        verb = "would terminate" if dry_run else "terminated"
        lines = [
            f"{len(found.pools)} orphan pool(s){': ' if found.pools else ''}"
            + ", ".join(found.pools)
        ]
        if found.pods:
            lines.append(f"{verb} {len(found.pods)} pod(s): " + ", ".join(found.pods))
        if found.skipped:
            lines.append(f"not checked (clients on other machines): {', '.join(found.skipped)}")
        return lines

    def market_provider(self) -> Provider:
        from ..._providers.runpod import RunPod

        return RunPod()

    def check(self) -> str:
        from ..._providers.runpod import RunPod

        return RunPod().check()

    def shell(
        self, paths: Paths, spec: RunPodSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        from ..._providers.runpod.pool import ssh_login

        login = ssh_login(nodes[node].ip)
        tty, remote = remote_shell(nodes[node].workdir, command)
        return ShellCommand(("ssh", *login, *tty, remote))


BACKEND = RunPodBackend()
