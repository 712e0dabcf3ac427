"""Which provider a named cluster uses, and what of a task's ``resources`` it can honour.

A cluster's provider is a :class:`ProviderSpec` (plain data, kept in the state file);
:func:`make_provider` turns it into a ``flotilla`` provider inside the cluster daemon.
Adding a provider means adding a kind here: the CLI flags, the checks and the factory.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord
    from ..taskfile import Task

KINDS = ("local", "ssh")


@dataclass(frozen=True)
class ProviderSpec:
    """Where a cluster's nodes run.

    Attributes:
        kind: "local" (processes on this machine) or "ssh" (existing hosts).
        hosts: ssh: ``user@host:port`` per node, head first.
        user: ssh: default login user.
        key: ssh: private key file.
        known_hosts: ssh: known_hosts file the host keys are checked against.
        accept_new_host_keys: ssh: trust hosts seen for the first time.
        python: ssh: the interpreter on the hosts.
        workdir: ssh: flotilla's folder on the hosts (jobs run in
            ``workdir/clusters/NAME/node-K``).
    """

    kind: str = "local"
    hosts: tuple[str, ...] = ()
    user: str | None = None
    key: str | None = None
    known_hosts: str | None = None
    accept_new_host_keys: bool = False
    python: str | None = None
    workdir: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigurationError(
                f"unknown provider {self.kind!r}: flotilla has {', '.join(KINDS)}"
            )
        if self.kind == "ssh" and not self.hosts:
            raise ConfigurationError(
                "the ssh provider needs hosts: --hosts user@host1,user@host2 (head first)"
            )
        if self.kind != "ssh" and self.hosts:
            raise ConfigurationError("--hosts is for --provider ssh")

    @property
    def shares_filesystem(self) -> bool:
        """Whether every node runs on this machine."""
        return self.kind == "local"

    def max_nodes(self) -> int | None:
        """How many nodes this provider can start (None: no limit)."""
        return len(self.hosts) if self.kind == "ssh" else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hosts"] = list(self.hosts)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProviderSpec:
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in data.items() if k in known}
        values["hosts"] = tuple(values.get("hosts", ()))
        return cls(**values)


def make_provider(spec: ProviderSpec, nodes_dir: Path) -> Provider:
    """The flotilla provider for ``spec``; local nodes' working directories go under
    ``nodes_dir``."""
    if spec.kind == "local":
        from ..._providers.local import Local

        nodes_dir.mkdir(parents=True, exist_ok=True)
        return Local(workdir=str(nodes_dir))
    try:
        from ..._providers.ssh import SSH
    except ImportError as e:
        raise ConfigurationError(f"the ssh provider is not available yet ({e})") from None
    options: dict[str, Any] = {"accept_new_host_keys": spec.accept_new_host_keys}
    for name in ("user", "key", "known_hosts", "python", "workdir"):
        value = getattr(spec, name)
        if value is not None:
            options[name] = value
    return SSH(list(spec.hosts), **options)


def check_task(task: Task, spec: ProviderSpec, cluster_nodes: int) -> list[str]:
    """What the provider cannot honour in ``task.resources``: a ConfigurationError for a
    requirement (GPUs this machine lacks), a warning (returned) for an unmet hint."""
    res = task.resources
    where = task.path

    def at(name: str) -> str:
        line = task.lines.get(f"resources.{name}", 0)
        if not line and name == "infra":
            line = task.lines.get("resources.cloud", 0)
        return f"{where}:{line}: " if where and line else (f"{where}: " if where else "")

    max_nodes = spec.max_nodes()
    if max_nodes is not None and cluster_nodes > max_nodes:
        raise ConfigurationError(
            f"{cluster_nodes} nodes wanted but --hosts lists {max_nodes}: "
            f"add hosts or use --nodes {max_nodes}"
        )
    warnings: list[str] = []
    gpus = res.gpus_per_node
    if spec.kind == "local":
        from ..._providers.local import local_gpu_count

        have = local_gpu_count()
        if gpus > have:
            raise ConfigurationError(
                f"{at('accelerators')}resources.accelerators: {res.accelerators} needs {gpus} "
                f"GPU(s) per node but this machine has {have}, and the local provider runs "
                "every node on this machine: remove `accelerators`, or use --provider ssh "
                "with GPU hosts"
            )
        if gpus and gpus * cluster_nodes > have:
            warnings.append(
                f"{at('accelerators')}resources.accelerators: {cluster_nodes} local nodes "
                f"share this machine's {have} GPU(s)"
            )
        cpus = os.cpu_count() or 1
        if res.cpus and float(res.cpus.rstrip("+")) > cpus:
            warnings.append(
                f"{at('cpus')}resources.cpus: {res.cpus} per node asked, this machine has "
                f"{cpus} (shared by {cluster_nodes} local node(s)); running anyway"
            )
        mem = _memory_gb()
        if res.memory and mem and float(res.memory.rstrip("+")) > mem:
            warnings.append(
                f"{at('memory')}resources.memory: {res.memory} GB per node asked, this machine "
                f"has {mem:.0f} GB; running anyway"
            )
    ignored = {
        "infra": res.infra,
        "region": res.region,
        "zone": res.zone,
        "instance_type": res.instance_type,
        "image_id": res.image_id,
        "use_spot": res.use_spot or None,
        "network_tier": res.network_tier if res.network_tier == "best" else None,
        "disk_size": res.disk_size,
        "disk_tier": res.disk_tier,
        "labels": dict(res.labels) or None,
    }
    if spec.kind != "local":
        ignored["cpus"] = res.cpus
        ignored["memory"] = res.memory
        ignored["ports"] = ",".join(res.ports) or None
    for name, value in ignored.items():
        if value is not None:
            warnings.append(
                f"{at(name)}resources.{name}: {value!r} is a hint the {spec.kind} provider "
                "cannot act on (its nodes already exist); ignored"
            )
    return warnings


def check_gpus(want: int, gpus_by_node: list[int]) -> None:
    """After provisioning (remote hosts' GPUs are known only then): every node must have
    ``want`` accelerators."""
    short = [i for i, have in enumerate(gpus_by_node) if have < want]
    if want and short:
        raise ConfigurationError(
            f"resources.accelerators: the task needs {want} GPU(s) per node but node(s) "
            f"{', '.join(map(str, short))} have "
            f"{', '.join(str(gpus_by_node[i]) for i in short)}"
        )


def _memory_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return 0.0


def ssh_config(cluster: str, spec: ProviderSpec, nodes: list[NodeRecord]) -> str:
    """ssh_config entries for an SSH cluster: ``NAME`` (the head) and ``NAME-workerK``, as
    SkyPilot writes them; include the file from ``~/.ssh/config`` to ``ssh NAME-worker1``."""
    from ..._providers.ssh import parse_host

    out = [f"# flotilla cluster {cluster}: generated, removed by `flotilla down {cluster}`\n"]
    for node in nodes:
        host = parse_host(spec.hosts[node.node])
        alias = cluster if node.node == 0 else f"{cluster}-worker{node.node}"
        out.append(f"Host {alias}\n  HostName {host.host}\n")
        user = host.user or spec.user
        if user:
            out.append(f"  User {user}\n")
        if host.port:
            out.append(f"  Port {host.port}\n")
        if spec.key:
            out.append(f"  IdentityFile {spec.key}\n  IdentitiesOnly yes\n")
        if spec.known_hosts:
            out.append(f"  UserKnownHostsFile {spec.known_hosts}\n")
        out.append("  StrictHostKeyChecking yes\n")
        out.append(f"  # working directory: {node.workdir}\n")
    return "".join(out)
