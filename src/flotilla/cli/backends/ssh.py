"""``--provider ssh``: nodes on existing hosts reached with OpenSSH (``--hosts``, head first).

Jobs run in ``WORKDIR/clusters/NAME/node-K`` on the hosts (several clusters, or nodes, may
share a host). When the cluster is up, an ssh_config for its hosts is written as SkyPilot
writes one (``NAME`` is the head, ``NAME-workerK`` the others): ``flotilla ssh`` uses it, and
so can the user's own ``ssh`` once the file is included from ``~/.ssh/config``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError
from ..._providers.settings import SSHSettings
from ..._system.private import private_dir
from .base import Backend, Flag, ProviderSpec, ShellCommand, settings_flags, ssh_shell

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths


@dataclass(frozen=True)
class SSHSpec(ProviderSpec):
    """SSH nodes.

    Attributes:
        hosts: ``user@host:port`` per node, head first.
        user: default login user.
        key: private key file (an absolute path).
        known_hosts: known_hosts file the host keys are checked against (absolute).
        accept_new_host_keys: trust hosts seen for the first time.
        python: the interpreter on the hosts.
        workdir: flotilla's folder on the hosts (jobs run in
            ``workdir/clusters/NAME/node-K``).
    """

    kind = "ssh"

    hosts: tuple[str, ...] = ()
    user: str | None = None
    key: str | None = None
    known_hosts: str | None = None
    accept_new_host_keys: bool = False
    python: str | None = None
    workdir: str | None = None

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ConfigurationError(
                "the ssh provider needs hosts: --hosts user@host1,user@host2 (head first)"
            )

    def describe(self) -> str:
        return f"ssh {', '.join(self.hosts)}"

    def max_nodes(self) -> int:
        return len(self.hosts)


class SSHBackend(Backend[SSHSpec]):
    spec_type = SSHSpec
    settings_type = SSHSettings
    summary = "existing hosts reached with OpenSSH (--hosts)"
    stop_note = ""  # the hosts keep their folders and environments; only agents stop
    flags = (
        Flag("--hosts", "user@host[:port],... one per node, head first", setting="hosts"),
        *settings_flags(
            SSHSettings,
            {
                "user": "--ssh-user",
                "key": "--ssh-key",
                "known_hosts": "--known-hosts",
                "accept_new_host_keys": "--accept-new-host-keys",
                "python": "--ssh-python",
                "workdir": "--ssh-workdir",
            },
        ),
    )
    pass_through = settings_flags(
        SSHSettings, {"port": "--ssh-port", "connect_timeout": "--ssh-connect-timeout"}
    )

    def spec_from_args(self, args: argparse.Namespace) -> SSHSpec:
        return SSHSpec(
            hosts=tuple(h.strip() for h in (args.hosts or "").split(",") if h.strip()),
            user=args.ssh_user,
            key=os.path.abspath(args.ssh_key) if args.ssh_key else None,
            known_hosts=os.path.abspath(args.known_hosts) if args.known_hosts else None,
            accept_new_host_keys=args.accept_new_host_keys,
            python=args.ssh_python,
            workdir=args.ssh_workdir,
        )

    def check_nodes(self, spec: SSHSpec, cluster_nodes: int) -> None:
        if cluster_nodes > len(spec.hosts):
            raise ConfigurationError(
                f"{cluster_nodes} nodes wanted but --hosts lists {len(spec.hosts)}: "
                f"add hosts or use --nodes {len(spec.hosts)}"
            )

    def make_provider(self, spec: SSHSpec, nodes_dir: Path) -> Provider:
        from ..._providers.ssh import SSH

        options: dict[str, Any] = {"accept_new_host_keys": spec.accept_new_host_keys}
        for name in ("user", "key", "known_hosts", "python", "workdir"):
            value = getattr(spec, name)
            if value is not None:
                options[name] = value
        return SSH(list(spec.hosts), **options, **dict(spec.settings))

    def on_up(self, paths: Paths, spec: SSHSpec, nodes: Sequence[NodeRecord]) -> None:
        private_dir(paths.ssh_config.parent)
        paths.ssh_config.write_text(ssh_config(paths.name, spec, nodes))

    def shell(
        self, paths: Paths, spec: SSHSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        alias = _alias(paths.name, node)
        tty, remote = ssh_shell(nodes[node].workdir, command)
        return ShellCommand(
            ("ssh", "-F", str(paths.ssh_config), *tty, alias, remote),
            note=f"ssh config: {paths.ssh_config} "
            f"(add `Include {paths.ssh_config}` to ~/.ssh/config)",
        )


def ssh_config(cluster: str, spec: SSHSpec, nodes: Sequence[NodeRecord]) -> str:
    """ssh_config entries for an SSH cluster: ``NAME`` (the head) and ``NAME-workerK``, as
    SkyPilot writes them; include the file from ``~/.ssh/config`` to ``ssh NAME-worker1``."""
    from ..._providers.settings import parse_host

    out = [f"# flotilla cluster {cluster}: generated, removed by `flotilla down {cluster}`\n"]
    for node in nodes:
        host = parse_host(spec.hosts[node.node])
        out.append(f"Host {_alias(cluster, node.node)}\n  HostName {host.host}\n")
        user = host.user or spec.user
        if user:
            out.append(f"  User {user}\n")
        port = host.port or dict(spec.settings).get("port")
        if port:
            out.append(f"  Port {port}\n")
        if spec.key:
            out.append(f"  IdentityFile {spec.key}\n  IdentitiesOnly yes\n")
        if spec.known_hosts:
            out.append(f"  UserKnownHostsFile {spec.known_hosts}\n")
        out.append("  StrictHostKeyChecking yes\n")
        out.append(f"  # working directory: {node.workdir}\n")
    return "".join(out)


def _alias(cluster: str, node: int) -> str:
    return cluster if node == 0 else f"{cluster}-worker{node}"


BACKEND = SSHBackend()
