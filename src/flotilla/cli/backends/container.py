"""``--provider container``: one container per node on this machine's engine (podman or
docker; see ``flotilla._providers.container``), each on the pool's own network.

A task file chooses it with ``resources: infra: container``; ``image_id`` is the image
(``docker:`` before it is accepted, as SkyPilot writes it), ``cpus`` and ``memory`` the
containers' limits. The containers live as long as the cluster's daemon holds the pool:
``flotilla down`` removes them; ``flotilla down --orphans --provider container`` removes
those of killed clients (with ``--container-binary podman`` for podman's).
``flotilla ssh NAME --node K`` is an ``exec -it`` shell in the node's container.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._providers.container.settings import ContainerSettings
from .base import Backend, ResourceSpec, ShellCommand

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths


@dataclass(frozen=True)
class ContainerSpec(ResourceSpec):
    """Containers on this machine (settings: ``ContainerSettings``); the task's ``cpus``
    and ``memory`` become each container's limits."""

    kind = "container"

    def describe(self) -> str:
        return f"container ({self.value('binary', ContainerSettings.binary)})"


class ContainerBackend(Backend[ContainerSpec]):
    spec_type = ContainerSpec
    settings_type = ContainerSettings
    summary = "one container per node on this machine (podman or docker)"
    honours = frozenset({"cpus", "memory"})
    hint_reason = "a container gets this machine's resources"
    infra = ("container",)

    def check_nodes(self, spec: ContainerSpec, cluster_nodes: int) -> None:
        """Refuse more nodes than this machine holds (open files, processes, memory)."""
        from ..._providers.limits import check_local_capacity

        check_local_capacity(cluster_nodes)

    def make_provider(self, spec: ContainerSpec, nodes_dir: Path) -> Provider:
        from ..._providers.container import Container

        return Container.from_settings(self.settings_of(spec))

    def remove_orphans(self, spec: ContainerSpec, dry_run: bool) -> list[str]:
        """Containers and networks of pools whose client (a killed program, or a cluster
        daemon) on this machine is gone, on the engine ``--container-binary`` names."""
        from ..._providers.container.orphans import remove_orphans

        found = remove_orphans(self.settings_of(spec), dry_run)
        verb = "would remove" if dry_run else "removed"
        lines = [
            f"{len(found.pools)} orphan pool(s){': ' if found.pools else ''}"
            + ", ".join(found.pools)
        ]
        for what, items in (("container(s)", found.containers), ("network(s)", found.networks)):
            if items:
                lines.append(f"{verb} {len(items)} {what}: {', '.join(items)}")
        if found.skipped:
            lines.append(f"not checked (clients on other machines): {', '.join(found.skipped)}")
        return lines

    def check(self) -> str:
        """The default engine's command answers ``info`` (a docker client without its
        daemon does not)."""
        import subprocess

        from ..._errors import ConfigurationError
        from ..._providers.container.provider import Engine, said

        engine = Engine(ContainerSettings())
        engine.check_local()
        done = subprocess.run([*engine.base(), "info"], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise ConfigurationError(f"{engine.settings.binary} info: {said(done.stderr)}")
        return f"{engine.settings.binary} answers (--container-binary podman for podman)"

    def shell(
        self,
        paths: Paths,
        spec: ContainerSpec,
        nodes: Sequence[NodeRecord],
        node: int,
        command: str,
    ) -> ShellCommand:
        """``exec`` into the node's container (named as its host), in its working
        directory."""
        from ..._providers.container.provider import Engine

        engine = Engine(self.settings_of(spec))
        remote = f"cd {shlex.quote(nodes[node].workdir)} && " + (
            command or "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"
        )
        tty = ["-t"] if not command and sys.stdin.isatty() else []
        name = nodes[node].host
        argv = [*engine.base(), "exec", "-i", *tty, name, "sh", "-c", remote]
        return ShellCommand(tuple(argv), note="" if command else f"container {name}")


BACKEND = ContainerBackend()
