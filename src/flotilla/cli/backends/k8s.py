"""``--provider k8s``: one Pod per node on a Kubernetes cluster, reached through ``kubectl
exec`` (see ``flotilla._providers.k8s``).

A task file chooses it with ``resources: infra: k8s`` or ``k8s/<context>`` (SkyPilot's
form; ``kubernetes`` is accepted too); ``accelerators: A100:8`` requests ``nvidia.com/gpu:
8`` on nodes labelled for A100s, ``cpus`` and ``memory`` the pods' CPU and memory requests.
The pods live as long as the cluster's daemon holds the pool: ``flotilla down`` deletes
them; ``flotilla down --orphans --provider k8s`` deletes those of killed clients.
``flotilla ssh NAME --node K`` is a ``kubectl exec -it`` shell in the node's pod.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._errors import ConfigurationError, FlotillaError
from ..._providers.k8s.settings import KubernetesSettings
from .base import (
    Backend,
    ResourceSpec,
    ShellCommand,
)

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import ClusterRecord, NodeRecord, Paths


@dataclass(frozen=True)
class K8sSpec(ResourceSpec):
    """Pods on a Kubernetes cluster (settings: ``KubernetesSettings``); the task's
    resources (see :class:`ResourceSpec`) become the pods' requests."""

    kind = "k8s"

    def describe(self) -> str:
        context = self.value("context")
        where = f" {context}" if context else ""
        return f"k8s{where} namespace {self.value('namespace', KubernetesSettings.namespace)}"


class K8sBackend(Backend[K8sSpec]):
    spec_type = K8sSpec
    settings_type = KubernetesSettings
    summary = "one Kubernetes pod per node (kubectl's kubeconfig and context)"
    fixed = {"workdir": "flotilla's folder in the pods"}
    honours = frozenset({"cpus", "memory"})
    hint_reason = "a pod gets what it requests"
    infra = ("k8s", "kubernetes")

    def make_provider(self, spec: K8sSpec, nodes_dir: Path) -> Provider:
        from ..._providers.k8s import Kubernetes

        return Kubernetes.from_settings(self.settings_of(spec))

    def on_down(self, paths: Paths, record: ClusterRecord) -> None:
        """Delete the pods (Services, Secrets) the cluster's daemon made (they are found by
        the daemon's ``host:pid:start``): nothing is left when the daemon was killed before
        it could delete them itself."""
        import asyncio
        import socket

        from ..._providers.k8s.orphans import remove_client_pools

        if not record.pid or not record.provider:
            return
        settings = self.settings_of(self.spec_from_dict(record.provider))
        client = f"{socket.gethostname()}:{record.pid}:{record.pid_start or ''}"
        try:
            asyncio.run(remove_client_pools(settings, client))
        except FlotillaError as e:
            print(f"cluster {paths.name}: could not look for its pods: {e}", file=sys.stderr)

    def remove_orphans(self, spec: K8sSpec, dry_run: bool) -> list[str]:
        """Pods, Services and Secrets of pools whose client (a killed program, or a cluster
        daemon) is gone, in every namespace the user can list (the current context's own
        when listing all is forbidden), or in ``--namespace`` only; pools of other
        machines' clients are listed, not touched."""
        from ..._providers.k8s.orphans import remove_orphans

        every = spec.value("namespace") is None
        found = remove_orphans(self.settings_of(spec), dry_run, every_namespace=every)
        verb = "would delete" if dry_run else "deleted"
        lines = [
            f"{len(found.pools)} orphan pool(s){': ' if found.pools else ''}"
            + ", ".join(found.pools)
        ]
        if found.pods:
            lines.append(f"{verb} {len(found.pods)} pod(s): {', '.join(found.pods)}")
        if found.others:
            lines.append(f"{verb} {', '.join(found.others)}")
        if found.skipped:
            lines.append(f"not checked (clients on other machines): {', '.join(found.skipped)}")
        if found.note:
            lines.append(found.note)
        return lines

    def shell(
        self, paths: Paths, spec: K8sSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        """``kubectl exec`` into the node's pod (found by its IP), in its working
        directory."""
        settings = self.settings_of(spec)
        from ..._providers.k8s.kubectl import Kubectl
        from ..._providers.k8s.provider import CONTAINER, MANAGED

        kubectl = Kubectl(settings)
        base = [*kubectl.base(), "-n", settings.namespace]
        proc = subprocess.run(
            [*base, "get", "pods", "-l", MANAGED, "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise ConfigurationError(f"kubectl get pods failed: {proc.stderr.strip()}")
        ip = nodes[node].ip
        pods = [
            p["metadata"]["name"]
            for p in json.loads(proc.stdout).get("items", [])
            if p.get("status", {}).get("podIP") == ip and p["status"].get("phase") == "Running"
        ]
        if not pods:
            raise ConfigurationError(
                f"cluster {paths.name}'s node {node} ({ip}) has no running pod: "
                f"`flotilla down {paths.name}` and launch it again"
            )
        remote = f"cd {shlex.quote(nodes[node].workdir)} && " + (
            command or "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"
        )
        tty = ["-t"] if not command and sys.stdin.isatty() else []
        argv = [*base, "exec", "-i", *tty, pods[0], "-c", CONTAINER, "--", "sh", "-c", remote]
        return ShellCommand(tuple(argv), note="" if command else f"pod {pods[0]}")


BACKEND = K8sBackend()
