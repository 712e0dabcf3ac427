"""``--provider slurm``: the cluster is one SLURM job, each node one job step (see
``flotilla._providers.slurm``), run from a login node (or inside a job).

A task file chooses it with ``resources: infra: slurm`` or ``slurm/<partition>`` (SkyPilot's
form); ``accelerators: A100:8`` becomes the job's ``--gres=gpu:a100:8``, ``cpus`` and
``memory`` its ``--cpus-per-task`` and ``--mem``. The job lives as long as the cluster's
daemon holds the pool: ``flotilla down`` ends it. ``flotilla ssh NAME --node K`` is an
``srun --jobid=J -w NODE --overlap [--pty]`` into the job, in the node's working directory.

The cluster's files live under ``~/.flotilla/clusters/NAME`` on this machine, which on a
SLURM cluster the compute nodes see too (a shared home): jobs run in
``.../nodes/clusters/NAME/node-K``, one folder per node.
"""

from __future__ import annotations

import argparse
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
    infra_detail,
    infra_name,
    settings_flags,
)

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths
    from ..taskfile import Task


@dataclass(frozen=True)
class SlurmSpec(ResourceSpec):
    """A SLURM job; the task's resources (see :class:`ResourceSpec`) become ``--gres``,
    ``--cpus-per-task`` and ``--mem``.

    Attributes:
        partition: the partition (None: the cluster's default one).
        time: the job's time limit (``--time``: minutes, HH:MM:SS, D-HH:MM:SS; None: the
            partition's default).
        account: ``--account`` (None: the user's default).
    """

    kind = "slurm"

    partition: str | None = None
    time: str | None = None
    account: str | None = None

    def __post_init__(self) -> None:
        if self.time is not None:
            from ..._providers.slurm.settings import parse_time

            parse_time(self.time)  # a ConfigurationError saying the forms it takes

    def describe(self) -> str:
        return f"slurm partition {self.partition}" if self.partition else "slurm"


class SlurmBackend(Backend[SlurmSpec]):
    spec_type = SlurmSpec
    settings_type = SlurmSettings
    summary = "one SLURM job, a step per node (run on a login node)"
    stop_note = "a SLURM allocation cannot be stopped and started again: it ends or runs"
    flags = settings_flags(
        SlurmSettings, {"partition": "--partition", "time": "--time", "account": "--account"}
    )
    pass_through = settings_flags(
        SlurmSettings,
        {
            "qos": "--qos",
            "constraint": "--constraint",
            "reservation": "--reservation",
            "gres": "--gres",
            "sbatch_args": "--sbatch-args",
            "python": "--slurm-python",
            "queue_timeout": "--queue-timeout",
            "shared_filesystem": "--no-shared-filesystem",
        },
    )
    fixed = {"workdir": "the cluster's folder"}
    honours = frozenset({"cpus", "memory"})
    hint_reason = "a SLURM job gets the partition's nodes as they are"
    infra = ("slurm",)

    def spec_from_args(self, args: argparse.Namespace) -> SlurmSpec:
        return SlurmSpec(partition=args.partition, time=args.time, account=args.account)

    def with_task(self, spec: SlurmSpec, task: Task) -> SlurmSpec:
        res = task.resources
        partition = spec.partition
        if infra_name(res.infra) in self.infra:
            partition = partition or infra_detail(res.infra)
        return spec.with_task_resources(task, partition=partition)

    def make_provider(self, spec: SlurmSpec, nodes_dir: Path) -> Provider:
        from ..._providers.slurm import Slurm

        nodes_dir.mkdir(parents=True, exist_ok=True)
        return Slurm(
            partition=spec.partition,
            time=spec.time,
            account=spec.account,
            workdir=str(nodes_dir),
            **dict(spec.settings),
        )

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
