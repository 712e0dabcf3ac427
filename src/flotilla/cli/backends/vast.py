"""``--provider vast``: Vast.ai instances rented for the cluster and destroyed by ``flotilla
down`` (see ``flotilla._providers.vast``).

A task file chooses it with ``resources: infra: vast``; its ``accelerators``, ``cpus``,
``memory`` and ``disk_size`` select the offers, ``image_id`` the Docker image, ``region``
the country codes. The API key is never a flag nor kept in the cluster's state: it comes
from ``VAST_API_KEY`` or the official CLI's key file, as for the library.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._providers.vast.settings import VastSettings
from .base import Backend, ResourceSpec, ShellCommand, infra_detail, infra_name, settings_flags
from .base import ssh_shell as remote_shell

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths
    from ..taskfile import Task


@dataclass(frozen=True)
class VastSpec(ResourceSpec):
    """Vast.ai instances; the task's resources (see :class:`ResourceSpec`) select the offers.

    Attributes:
        url: the API's base URL (None: ``VAST_URL``, else Vast's own).
        image: the Docker image (None: the provider's default).
        disk_gb: disk per instance in GB (None: the provider's default).
        regions: two-letter country codes the machines must be in (empty: anywhere).
        ttl: seconds after the last contact from the client when an instance destroys
            itself.
    """

    kind = "vast"

    url: str | None = None
    image: str | None = None
    disk_gb: float | None = None
    regions: tuple[str, ...] = ()
    ttl: float = VastSettings.ttl

    def provider_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"url": self.url, "regions": self.regions, "ttl": self.ttl}
        if self.image:
            options["image"] = self.image
        if self.disk_gb:
            options["disk_gb"] = self.disk_gb
        return {**options, **dict(self.settings)}

    def describe(self) -> str:
        return "vast" + (f" ({', '.join(self.regions)})" if self.regions else "")


class VastBackend(Backend[VastSpec]):
    spec_type = VastSpec
    summary = "Vast.ai instances rented for the cluster, destroyed by `flotilla down`"
    settings_type = VastSettings
    flags = settings_flags(VastSettings, {"url": "--vast-url", "ttl": "--vast-ttl"})
    pass_through = settings_flags(
        VastSettings,
        {
            "min_reliability": "--vast-min-reliability",
            "workdir": "--vast-workdir",
            "python": "--vast-python",
            "connect_timeout": "--vast-connect-timeout",
        },
    )
    fixed = {
        "api_key": "VAST_API_KEY or the official CLI's key file (never a flag or in state)",
        "image": "a task's resources.image_id",
        "disk_gb": "a task's resources.disk_size",
        "regions": "a task's resources.region (country codes, comma-separated)",
    }
    honours = frozenset({"region", "image_id", "disk_size", "cpus", "memory"})
    hint_reason = "Vast's offers have no such setting flotilla knows of"
    infra = ("vast", "vastai")

    def spec_from_args(self, args: argparse.Namespace) -> VastSpec:
        options: dict[str, Any] = {"url": args.vast_url}
        if args.vast_ttl is not None:
            options["ttl"] = args.vast_ttl
        return VastSpec(**options, settings=self.given_settings(args))

    def with_task(self, spec: VastSpec, task: Task) -> VastSpec:
        res = task.resources
        region = res.region
        if infra_name(res.infra) in self.infra:
            region = infra_detail(res.infra) or region
        regions = spec.regions or tuple(
            r.strip().upper() for r in (region or "").split(",") if r.strip()
        )
        return spec.with_task_resources(
            task,
            image=spec.image or res.image_id,
            disk_gb=spec.disk_gb or res.disk_size,
            regions=regions,
        )

    def make_provider(self, spec: VastSpec, nodes_dir: Path) -> Provider:
        from ..._providers.vast import VastAI

        return VastAI.from_settings(VastSettings(**spec.provider_options()))

    def remove_orphans(self, region: str | None, dry_run: bool) -> list[str]:
        """Instances of pools whose client (a killed program, or a cluster daemon) on this
        machine is gone, found by their label; others are listed, not touched."""
        from ..._providers.vast import VastAI

        found = VastAI().remove_orphans(dry_run=dry_run)
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
        from ..._providers.vast.pool import ssh_login

        login = ssh_login(nodes[node].ip)
        tty, remote = remote_shell(nodes[node].workdir, command)
        return ShellCommand(("ssh", *login, *tty, remote))


BACKEND = VastBackend()
