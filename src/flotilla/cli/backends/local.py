"""``--provider local`` (the default): every node is a process tree on this machine, in its
own working directory under the cluster's folder (``NAME/nodes/``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._errors import ConfigurationError
from ..._providers.settings import LocalSettings
from ..._system import procs
from .base import Backend, ProviderSpec, ShellCommand, task_location

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import ClusterRecord, NodeRecord, Paths
    from ..taskfile import Task


@dataclass(frozen=True)
class LocalSpec(ProviderSpec):
    """Local nodes: no options (their folders follow from the cluster's name)."""

    kind = "local"


class LocalBackend(Backend[LocalSpec]):
    spec_type = LocalSpec
    settings_type = LocalSettings
    summary = "processes on this machine"
    shares_filesystem = True
    stop_note = ""  # node folders NAME/nodes/nodeN are kept (Local(keep_folders=True))
    honours = frozenset({"cpus", "memory", "ports"})  # checked against this machine, or free
    fixed = {
        "workdir": "the cluster's folder",
        "keep_folders": "kept: `flotilla stop` / `start` find them",
    }

    def check_nodes(self, spec: LocalSpec, cluster_nodes: int) -> None:
        """Refuse more nodes than this machine holds (open files, processes, memory)
        before a daemon starts."""
        from ..._providers.limits import check_local_capacity

        check_local_capacity(cluster_nodes)

    def check_resources(self, task: Task, spec: LocalSpec, cluster_nodes: int) -> list[str]:
        """GPUs are a requirement (this machine has them or the task cannot run); CPUs and
        memory beyond this machine's are warned about (the nodes share it anyway)."""
        from ..._providers.local import local_gpu_count, memory_gb

        res = task.resources
        warnings: list[str] = []
        gpus = res.gpus_per_node
        have = local_gpu_count()
        if gpus > have:
            raise ConfigurationError(
                f"{task_location(task, 'accelerators')}resources.accelerators: "
                f"{res.accelerators} needs {gpus} GPU(s) per node but this machine has {have}, "
                "and the local provider runs every node on this machine: remove "
                "`accelerators`, or use --provider ssh with GPU hosts"
            )
        if gpus and gpus * cluster_nodes > have:
            warnings.append(
                f"{task_location(task, 'accelerators')}resources.accelerators: {cluster_nodes} "
                f"local nodes share this machine's {have} GPU(s)"
            )
        cpus = os.cpu_count() or 1
        if res.cpus and float(res.cpus.rstrip("+")) > cpus:
            warnings.append(
                f"{task_location(task, 'cpus')}resources.cpus: {res.cpus} per node asked, this "
                f"machine has {cpus} (shared by {cluster_nodes} local node(s)); running anyway"
            )
        mem = memory_gb()
        if res.memory and mem and float(res.memory.rstrip("+")) > mem:
            warnings.append(
                f"{task_location(task, 'memory')}resources.memory: {res.memory} GB per node "
                f"asked, this machine has {mem:.0f} GB; running anyway"
            )
        return warnings

    def make_provider(self, spec: LocalSpec, nodes_dir: Path) -> Provider:
        from ..._providers.local import Local

        nodes_dir.mkdir(parents=True, exist_ok=True)
        return Local.from_settings(
            self.settings_of(spec, workdir=str(nodes_dir), keep_folders=True)
        )

    def on_down(self, paths: Paths, record: ClusterRecord) -> None:
        """Kill what the cluster may have left running: its jobs' processes (found by their
        FLOTILLA_RUN_TOKEN) and anything in its nodes' working directories."""
        if record.token:
            from ..node_ops import reap

            reap.local(f"{record.token}.")
        root = str(paths.nodes.resolve())

        def inside(pid: int) -> bool:
            where = procs.cwd(pid)
            return where is not None and (where == root or where.startswith(root + os.sep))

        procs.kill_all(inside)

    def shell(
        self,
        paths: Paths,
        spec: LocalSpec,
        nodes: Sequence[NodeRecord],
        node: int,
        command: str,
    ) -> ShellCommand:
        """bash in the node's folder, with the variables a job's ``run`` gets (those of one
        job only left out), in the node's mount namespace when it has one (volumes at
        absolute paths: the node's own mounts)."""
        from ..._volume import namespace_entry
        from ..jobspec import phase_env, shared_machine_home

        common, per_node = phase_env(
            cluster=paths.name,
            provider=self.kind,
            cluster_ips=[n.ip for n in nodes],
            job_nodes=len(nodes),
            job_id=0,
            task="",
            gpus_per_node=nodes[node].gpus,
            master_port=0,
            setup=False,
        )
        env = dict(os.environ)
        env.pop("COMPUTE_POOL", None)
        skip = {"MASTER_PORT", "FLOTILLA_JOB_ID", "FLOTILLA_TASK_ID", "SKYPILOT_TASK_ID"}
        env.update({k: v for k, v in {**common, **per_node[node]}.items() if k not in skip})
        env.update(shared_machine_home(nodes[node].workdir))  # ~ as in the jobs' run
        argv = ("bash", "-c", command) if command else ("bash", "-i")
        argv = (*namespace_entry(nodes[node].agent_pid), *argv)
        return ShellCommand(argv, env=env, cwd=nodes[node].workdir)


BACKEND = LocalBackend()
