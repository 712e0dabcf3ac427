"""``--provider ssh``: nodes on existing hosts reached with OpenSSH (``--hosts``, head first).

Jobs run in ``WORKDIR/clusters/NAME`` on the hosts, the same path on each, as launchers that
``cd`` into the head's folder on every node expect (DeepSpeed's pdsh runner, mpirun); in
``.../node-K`` on hosts whose nodes share a file system (several nodes on one host, a shared
home), which the nodes find out when the cluster starts (``node_ops.describe_nodes``).
When the cluster is up, an ssh_config for its hosts is written as SkyPilot writes one
(``NAME`` is the head, ``NAME-workerK`` the others): ``flotilla ssh`` uses it, and so can
the user's own ``ssh`` once the file is included from ``~/.ssh/config``.
``flotilla down`` removes ``WORKDIR/clusters/NAME`` on every host (:meth:`SSHBackend.on_down`):
that folder only, never another cluster's or flotilla's own files.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._errors import ConfigurationError
from ..._providers.settings import SSHSettings
from ..._system.private import private_dir
from ..._system.procs import last_words
from .base import Backend, ProviderSpec, ShellCommand, ssh_alias, ssh_shell

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import ClusterRecord, NodeRecord, Paths

REMOVE_TIMEOUT = 60.0
"""Seconds ``down`` waits for a host to remove the cluster's folder (beyond the connect
timeout)."""


@dataclass(frozen=True)
class SSHSpec(ProviderSpec):
    """SSH nodes (settings: ``SSHSettings``; ``hosts`` head first)."""

    kind = "ssh"

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(self.value("hosts", ()))

    def describe(self) -> str:
        return f"ssh {', '.join(self.hosts)}"

    def max_nodes(self) -> int:
        return len(self.hosts)


class SSHBackend(Backend[SSHSpec]):
    spec_type = SSHSpec
    settings_type = SSHSettings
    summary = "existing hosts reached with OpenSSH (--hosts)"
    stop_note = ""  # the hosts keep their folders and environments; only agents stop

    def check_spec(self, spec: SSHSpec) -> None:
        if not spec.hosts:
            raise ConfigurationError(
                "the ssh provider needs hosts: --hosts user@host1,user@host2 (head first), or "
                "a task file's config: {ssh: {hosts: [...]}}"
            )
        super().check_spec(spec)

    def check_nodes(self, spec: SSHSpec, cluster_nodes: int) -> None:
        if cluster_nodes > len(spec.hosts):
            raise ConfigurationError(
                f"{cluster_nodes} nodes wanted but --hosts lists {len(spec.hosts)}: "
                f"add hosts or use --nodes {len(spec.hosts)}"
            )

    def make_provider(self, spec: SSHSpec, nodes_dir: Path) -> Provider:
        from ..._providers.ssh import SSH

        return SSH.from_settings(self.settings_of(spec))

    def on_up(self, paths: Paths, spec: SSHSpec, nodes: Sequence[NodeRecord]) -> None:
        private_dir(paths.ssh_config.parent)
        paths.ssh_config.write_text(ssh_config(paths.name, spec, nodes))

    def on_down(self, paths: Paths, record: ClusterRecord) -> None:
        """Remove the cluster's folder, ``WORKDIR/clusters/NAME``, on each of its hosts
        (:meth:`remove_folder`)."""
        try:
            spec = self.spec_from_dict(record.provider)
        except ConfigurationError as e:
            print(f"cluster {paths.name}: its hosts' folders are left: {e}", file=sys.stderr)
            return
        self.remove_folder(spec, f"clusters/{paths.name}")

    def remove_folder(self, spec: SSHSpec, folder: str) -> None:
        """Remove ``WORKDIR/folder`` (and the probe files a crash may have left beside it)
        on each host, once the agents are gone: what a cluster created there and nothing
        else (the bundles under ``WORKDIR/lib`` are shared by every pool). A host that
        cannot be reached is named, not waited for past its connect timeout."""
        from ..._providers.bootstrap import shell_path
        from ..._providers.ssh import SSH

        provider = SSH.from_settings(self.settings_of(spec))
        quoted = shlex.quote(folder)
        command = (
            f"cd {shell_path(provider.settings.workdir)} 2>/dev/null || exit 0; "
            f"rm -rf -- {quoted} {quoted}.probe-*"
        )
        ssh = provider.shell(lambda machine: provider.target(provider.hosts[0]))
        running = [
            (
                host,
                subprocess.Popen(
                    ssh.ssh_argv(provider.target(host), command),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                ),
            )
            for host in dict.fromkeys(provider.hosts)
        ]
        timeout = provider.settings.connect_timeout + REMOVE_TIMEOUT
        for host, proc in running:
            why = last_words(proc, timeout) or "no answer"
            if proc.returncode != 0:
                print(f"{host.host}: {folder} could not be removed: {why}", file=sys.stderr)

    def shell(
        self, paths: Paths, spec: SSHSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        alias = ssh_alias(paths.name, node)
        tty, remote = ssh_shell(nodes[node].workdir, command)
        return ShellCommand(
            ("ssh", "-F", str(paths.ssh_config), *tty, alias, remote),
            note=f"ssh config: {paths.ssh_config} (`flotilla ssh-config` includes it from "
            "~/.ssh/config)",
        )


def ssh_config(cluster: str, spec: SSHSpec, nodes: Sequence[NodeRecord]) -> str:
    """ssh_config entries for an SSH cluster: ``NAME`` (the head) and ``NAME-workerK``, as
    SkyPilot writes them; include the file from ``~/.ssh/config`` to ``ssh NAME-worker1``."""
    from ..._providers.settings import parse_host

    out = [f"# flotilla cluster {cluster}: generated, removed by `flotilla down {cluster}`\n"]
    for node in nodes:
        host = parse_host(spec.hosts[node.node])
        out.append(f"Host {ssh_alias(cluster, node.node)}\n  HostName {host.host}\n")
        user = host.user or spec.value("user")
        if user:
            out.append(f"  User {user}\n")
        port = host.port or spec.value("port")
        if port:
            out.append(f"  Port {port}\n")
        if spec.value("key"):
            out.append(f"  IdentityFile {spec.value('key')}\n  IdentitiesOnly yes\n")
        if spec.value("known_hosts"):
            out.append(f"  UserKnownHostsFile {spec.value('known_hosts')}\n")
        out.append("  StrictHostKeyChecking yes\n")
        out.append(f"  # working directory: {node.workdir}\n")
    return "".join(out)


BACKEND = SSHBackend()
