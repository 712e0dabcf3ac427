"""``--provider slurm``: the cluster is one SLURM job, each node one job step (see
``flotilla._providers.slurm``), run from a login node (or inside a job).

A task file chooses it with ``resources: infra: slurm`` or ``slurm/<partition>`` (SkyPilot's
form); ``accelerators: A100:8`` becomes the job's ``--gres=gpu:a100:8``, ``cpus`` and
``memory`` its ``--cpus-per-task`` and ``--mem``. The job lives as long as the cluster's
daemon holds the pool: ``flotilla down`` ends it. ``flotilla ssh NAME --node K`` is an
``srun --jobid=J -w NODE --overlap [--pty]`` into the job, in the node's working directory.

The cluster's files live under ``~/.flotilla/clusters/NAME`` on this machine, which on a
SLURM cluster the compute nodes see too (a shared home): jobs run in
``.../nodes/clusters/NAME/node-K``, one folder per node (``.../nodes/clusters/NAME`` on each
node where they do not share it: ``node_ops.describe_nodes``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._errors import ConfigurationError
from ..._providers.slurm.settings import SlurmSettings
from .base import (
    Backend,
    ResourceSpec,
    ShellCommand,
)

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths


@dataclass(frozen=True)
class SlurmSpec(ResourceSpec):
    """A SLURM job (settings: ``SlurmSettings``); the task's resources (see
    :class:`ResourceSpec`) become ``--gres``, ``--cpus-per-task`` and ``--mem``."""

    kind = "slurm"
    where = "partition"
    shown = " partition {}"


class SlurmBackend(Backend[SlurmSpec]):
    spec_type = SlurmSpec
    settings_type = SlurmSettings
    summary = "one SLURM job, a step per node (run on a login node)"
    stop_note = "a SLURM allocation cannot be stopped and started again: it ends or runs"
    fixed = {"workdir": "the cluster's folder"}
    honours = frozenset({"cpus", "memory"})
    hint_reason = "a SLURM job gets the partition's nodes as they are"
    infra = ("slurm",)

    def make_provider(self, spec: SlurmSpec, nodes_dir: Path) -> Provider:
        from ..._providers.slurm import Slurm

        nodes_dir.mkdir(parents=True, exist_ok=True)
        return Slurm.from_settings(self.settings_of(spec, workdir=str(nodes_dir)))

    def check(self) -> str:
        import shutil

        if shutil.which("sbatch") is None:
            raise ConfigurationError("sbatch is not on PATH (no SLURM client here)")
        return "sbatch found"

    def shell(
        self, paths: Paths, spec: SlurmSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        record = nodes[node]
        if not record.scheduler_job:
            raise ConfigurationError(
                f"cluster {paths.name}'s node {node} has no SLURM job recorded: "
                f"`flotilla down {paths.name}` and launch it again"
            )
        where = record.scheduler_node or record.host
        argv = [
            "srun",
            f"--jobid={record.scheduler_job}",
            f"--nodelist={where}",
            "--nodes=1",
            "--ntasks=1",
            "--overlap",
            f"--chdir={record.workdir}",
            "--quiet",
        ]
        if command:
            argv += ["bash", "-c", command]
        else:
            argv += (["--pty"] if sys.stdin.isatty() else []) + ["bash", "-l"]
        note = "" if command else f"SLURM job {record.scheduler_job}, node {where}"
        return ShellCommand(tuple(argv), note=note)


BACKEND = SlurmBackend()
