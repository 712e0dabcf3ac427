"""The SLURM provider's settings: one frozen object, checked when made (before anything
starts). Light to import: the command line derives its flags from it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..._errors import ConfigurationError
from ..options import option

_RESERVED = {
    "--nodes": "nodes=",
    "-N": "nodes=",
    "--ntasks": "nodes=",
    "-n": "nodes=",
    "--ntasks-per-node": "nodes=",
    "--job-name": "the pool id",
    "-J": "the pool id",
    "--no-shell": "flotilla's holder",
    "--jobid": "flotilla",
}


@dataclass(frozen=True)
class SlurmSettings:
    """How the SLURM provider asks for a pool's job; checked when made.

    Attributes:
        partition: partition to submit to (default: the cluster's default partition; inside
            a job, None means "use this job's nodes").
        account: ``--account``.
        qos: ``--qos``.
        time: time limit (``--time``: minutes, HH:MM:SS, D-HH:MM:SS). Default: the
            partition's DefaultTime, else its MaxTime, else one day; never unlimited.
        constraint: ``--constraint`` (node features).
        reservation: ``--reservation``.
        gres: ``--gres`` per node, e.g. ``"gpu:a100:8"``; default: from the pool's
            ``accelerator`` (``gpu:TYPE:COUNT``). GRES names are site-defined: this wins.
        sbatch_args: more salloc/sbatch options, e.g. ``("--exclusive=user",)``.
        python: interpreter on the nodes (default: this interpreter when the filesystem is
            shared, else ``python3``).
        workdir: working directory of the agents (default: the current directory when the
            filesystem is shared, else ``~/.flotilla``, where the bootstrap keeps flotilla).
        queue_timeout: seconds the job may wait in the queue before the pool gives up
            (default: wait as long as it takes; Ctrl-C cancels the job).
        shared_filesystem: whether the nodes see the client's files (the usual SLURM setup).
    """

    partition: str | None = option(None, flag="--partition", task="infra")
    account: str | None = option(None, flag="--account")
    qos: str | None = option(None, flag="--qos")
    time: str | int | None = option(None, flag="--time", parse=str)
    constraint: str | None = option(None, flag="--constraint")
    reservation: str | None = option(None, flag="--reservation")
    gres: str | None = option(None, flag="--gres")
    sbatch_args: Sequence[str] = option((), flag="--sbatch-args")
    python: str | None = None
    workdir: str | None = None
    queue_timeout: float | None = option(None, flag="--queue-timeout")
    shared_filesystem: bool = option(True, flag="--no-shared-filesystem")

    def __post_init__(self) -> None:
        for key in ("partition", "account", "qos", "constraint", "reservation", "gres"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigurationError(
                    f"Slurm({key}=...) must be a non-empty string, got {value!r}"
                )
        for key in ("python", "workdir"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigurationError(
                    f"Slurm({key}=...) must be a non-empty string, got {value!r}"
                )
        if self.time is not None:
            parse_time(self.time)
        args = self.sbatch_args
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise ConfigurationError(
                f"Slurm(sbatch_args=...) must be a list of strings such as ['--exclusive'], "
                f"got {args!r}"
            )
        for arg in args:
            option = arg.split("=", 1)[0]
            if option in _RESERVED:
                raise ConfigurationError(
                    f"Slurm(sbatch_args=...): {option} is set by flotilla (from "
                    f"{_RESERVED[option]}); remove it"
                )
        wait = self.queue_timeout
        if wait is not None and (
            isinstance(wait, bool) or not isinstance(wait, int | float) or wait <= 0
        ):
            raise ConfigurationError(
                f"Slurm(queue_timeout=...) must be a positive number of seconds or None, "
                f"got {wait!r}"
            )
        object.__setattr__(self, "sbatch_args", tuple(args))
        object.__setattr__(self, "shared_filesystem", bool(self.shared_filesystem))


def parse_time(value: str | int) -> int:
    """Seconds of a SLURM time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.

    ConfigurationError for anything else, including UNLIMITED (backfill skips such jobs).
    """
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ConfigurationError(f"Slurm(time=...) must be a string like '2:00:00', got {value!r}")
    text = str(value).strip()
    fix = "use minutes, MM:SS, HH:MM:SS or D-HH:MM:SS, e.g. Slurm(time='2:00:00')"
    if text.upper() in ("UNLIMITED", "INFINITE", "-1"):
        raise ConfigurationError(
            f"Slurm(time={value!r}): an unlimited time makes the backfill scheduler skip the "
            f"job; give a limit: {fix}"
        )
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m or not text:
        raise ConfigurationError(f"Slurm(time={value!r}) is not a SLURM time limit: {fix}")
    days, a, b, c = m.groups()
    n = [int(a), int(b or 0), int(c or 0)]
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = int(days) * 86400 + n[0] * 3600 + n[1] * 60 + n[2]
    elif c is not None:  # HH:MM:SS
        seconds = n[0] * 3600 + n[1] * 60 + n[2]
    else:  # MM or MM:SS
        seconds = n[0] * 60 + n[1]
    if seconds <= 0:
        raise ConfigurationError(f"Slurm(time={value!r}) must be longer than zero: {fix}")
    return seconds
