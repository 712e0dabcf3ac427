"""``--provider lambda``: Lambda Cloud GPU instances launched for the cluster and
terminated by ``flotilla down`` (see ``flotilla._providers.lambda_cloud``).

A task file chooses it with ``resources: infra: lambda`` or ``lambda/<region>``; its
``accelerators`` select the instance types (``instance_type`` names one). The API key is
never a flag nor kept in the cluster's state: it comes from ``LAMBDA_API_KEY``, as for the
library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._providers.lambda_cloud.settings import LambdaSettings
from .base import Backend, ResourceSpec, ShellCommand
from .base import ssh_shell as remote_shell

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths


@dataclass(frozen=True)
class LambdaSpec(ResourceSpec):
    """Lambda Cloud instances (settings: ``LambdaSettings``); the task's resources (see
    :class:`ResourceSpec`) select the instance types."""

    kind = "lambda"

    def describe(self) -> str:
        region = self.value("region", None)
        return "lambda" + (f" ({region})" if region else "")


class LambdaBackend(Backend[LambdaSpec]):
    spec_type = LambdaSpec
    summary = "Lambda Cloud GPU instances launched for the cluster, terminated by `flotilla down`"
    settings_type = LambdaSettings
    hint_reason = "Lambda's instance types have no such setting flotilla knows of"
    infra = ("lambda", "lambda_cloud", "lambdalabs")

    def make_provider(self, spec: LambdaSpec, nodes_dir: Path) -> Provider:
        from ..._providers.lambda_cloud import LambdaCloud

        return LambdaCloud.from_settings(self.settings_of(spec))

    def remove_orphans(self, spec: LambdaSpec, dry_run: bool) -> list[str]:
        """Instances of pools whose client on this machine is gone, found by their name;
        others are listed, not touched."""
        from ..._providers.lambda_cloud import LambdaCloud

        found = LambdaCloud.from_settings(self.settings_of(spec)).remove_orphans(dry_run=dry_run)
        verb = "would terminate" if dry_run else "terminated"
        lines = [
            f"{len(found.pools)} orphan pool(s){': ' if found.pools else ''}"
            + ", ".join(found.pools)
        ]
        if found.instances:
            lines.append(
                f"{verb} {len(found.instances)} instance(s): " + ", ".join(found.instances)
            )
        if found.skipped:
            lines.append(f"not checked (clients on other machines): {', '.join(found.skipped)}")
        return lines

    def market_provider(self) -> Provider:
        from ..._providers.lambda_cloud import LambdaCloud

        return LambdaCloud()

    def check(self) -> str:
        from ..._providers.lambda_cloud import LambdaCloud

        return LambdaCloud().check()

    def shell(
        self, paths: Paths, spec: LambdaSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        from ..._providers.lambda_cloud.pool import ssh_login

        login = ssh_login(nodes[node].ip)
        tty, remote = remote_shell(nodes[node].workdir, command)
        return ShellCommand(("ssh", *login, *tty, remote))


BACKEND = LambdaBackend()
