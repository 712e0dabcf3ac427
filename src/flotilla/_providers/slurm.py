"""The SLURM provider: a pool is one SLURM job; each node's agent is one job step.

**Allocation.** ``salloc`` with a *holder* command, run on the client's machine (the login
node): ``salloc --nodes=N ... sh -c 'echo FLOTILLA_SLURM_JOB $SLURM_JOB_ID ...; exec cat'``.
The holder prints the job id and node list once the nodes are ready and then waits for end
of stdin, which is a pipe from the client: when the client closes it (release) or dies
(even by kill -9) the holder exits and salloc relinquishes the job at once. salloc was
measured against ``sbatch`` of a holder script on the test cluster: ~10 ms to a running
job against ~2.9 s (an sbatch job waits for the scheduler's next pass, salloc's request is
scheduled when it arrives), and salloc needs no polling to learn the job runs. While the
job is pending, salloc is sent SIGTERM if the client dies (``PR_SET_PDEATHSIG``): salloc
then revokes the pending request. ``--time`` is only the last backstop.

**Agents.** ``srun --jobid=J --nodes=1 --ntasks=1 -w NODE --overlap python -m
flotilla.agent`` per node: srun relays the step's stdin/stdout, which are the protocol
channel (a :class:`PipeAgent`). Without ``--exact`` a step gets every CPU and the memory the
job holds on its node, and the GPUs the job asked for.

**Files.** On a SLURM cluster the login and compute nodes normally share the users' home and
project directories, so by default (``shared_filesystem=True``) the nodes run the client's
own interpreter (``sys.executable``) with the client's import path, as the local provider
does, and user modules are imported rather than shipped. With ``shared_filesystem=False``
the nodes get the client's flotilla through the bootstrap (see ``bootstrap``) over the
step's stdio, into ``workdir`` on each node.

**Inside an existing allocation** (the program runs under ``sbatch``/``salloc``:
``SLURM_JOB_ID`` is set and no ``partition`` is given) the pool uses that job's nodes with
steps and never cancels the job.

**Replacing a node.** The pool's job is submitted with ``--no-kill`` so that it survives the
failure of one of its nodes; a replacement is a new one-node job (excluding the lost node),
released with the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .._errors import ConfigurationError, ProvisionError
from .base import (
    AgentProcess,
    Allocation,
    AllocationState,
    LostCallback,
    Machine,
    MachineState,
    PoolSpec,
    Provider,
)
from .bootstrap import NoAnswer, client_bundle, start_agent, start_command
from .local import _client_path
from .pipe import PipeAgent, spawn

COMMANDS = ("salloc", "srun", "scancel", "squeue", "scontrol", "sinfo")
READY_MARKER = "FLOTILLA_SLURM_JOB"
_HOLDER = f'echo "{READY_MARKER} $SLURM_JOB_ID $SLURM_JOB_NODELIST"; exec cat >/dev/null'
"""salloc's command: says the job runs, then holds it until the client closes stdin."""
FALLBACK_TIME = "1-00:00:00"
"""--time when neither time= nor the partition gives a limit (never UNLIMITED)."""
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
_PENDING_REPORT_EVERY = 30.0
WATCH_INTERVAL = 5.0
"""Seconds between two looks at SLURM's view of a pool's nodes and jobs (see watch())."""
_LOST_STATES = {"DOWN", "FAIL", "FAILING", "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN"}
_GONE_TIMEOUT = 10.0


def _slurm_env() -> dict[str, str]:
    """This process's environment without the variables of a job it may run in (they
    would redirect srun/salloc into that job); SLURM_CONF is kept."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


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


def _fields(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value2`` (scontrol -o) as a dict."""
    return {m[1]: m[2] for m in re.finditer(r"(\w+)=(\S*)", line)}


def _run(argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a SLURM query; ProvisionError when it cannot run or times out."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, env=_slurm_env(), timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ProvisionError(f"`{' '.join(argv)}` failed: {e}") from e


def _err(proc: subprocess.CompletedProcess[str]) -> str:
    text = (proc.stderr or proc.stdout).strip()
    return text.splitlines()[-1] if text else f"exit status {proc.returncode}"


def _hostnames(nodelist: str) -> list[str]:
    """The node names of a SLURM host list (``n[1-3]``), in order."""
    proc = _run(["scontrol", "show", "hostnames", nodelist])
    if proc.returncode != 0:
        raise ProvisionError(f"cannot expand the node list {nodelist!r}: {_err(proc)}")
    return proc.stdout.split()


def _node_addresses(names: Sequence[str]) -> dict[str, str]:
    """Node name -> NodeAddr (as SLURM knows it)."""
    proc = _run(["scontrol", "-o", "show", "node", ",".join(names)])
    if proc.returncode != 0:
        raise ProvisionError(f"cannot look up the nodes {','.join(names)}: {_err(proc)}")
    out = {}
    for line in proc.stdout.splitlines():
        f = _fields(line)
        if "NodeName" in f:
            out[f["NodeName"]] = f.get("NodeAddr") or f["NodeName"]
    return out


def _node_states(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Node name -> (State, first word of Reason); empty when SLURM cannot be asked."""
    try:
        proc = _run(["scontrol", "-o", "show", "node", ",".join(names)], timeout=10.0)
    except ProvisionError:
        return {}
    out = {}
    for line in proc.stdout.splitlines():
        f = _fields(line)
        if "NodeName" in f:
            out[f["NodeName"]] = (f.get("State", ""), f.get("Reason", ""))
    return out


def _gres_offer(gres: str) -> list[tuple[str, int]]:
    """GPU (type, count) pairs of a node's Gres string (``gpu:a100:8(S:0-1),gpu:v100:2``)."""
    out = []
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = entry.strip().split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        kind = parts[1] if len(parts) > 2 else ""
        with contextlib.suppress(ValueError):
            out.append((kind.lower(), int(parts[-1])))
    return out


@dataclass(frozen=True)
class Partition:
    """What validation needs of a partition.

    Attributes:
        name: partition name.
        nodes: number of nodes in it.
        max_time: its MaxTime in seconds (None: unlimited).
        default_time: its DefaultTime in seconds (None: none).
        gpus: the GPU (type, count) offers of its nodes.
    """

    name: str
    nodes: int
    max_time: int | None
    default_time: int | None
    gpus: tuple[tuple[str, int], ...]


def _limit(text: str | None) -> int | None:
    if not text or text.upper() in ("UNLIMITED", "NONE", "INFINITE"):
        return None
    try:
        return parse_time(text)
    except ConfigurationError:
        return None


class Slurm(Provider):
    """Run the pool as one SLURM job, one job step per node.

    Used on a login node of a SLURM cluster (the SLURM commands must be on PATH), or inside
    a job: ``Compute(provider=Slurm(partition="gpu", time="2:00:00"), nodes=4,
    accelerator="A100:8")``.

    Args:
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

    name = "slurm"

    def __init__(
        self,
        partition: str | None = None,
        account: str | None = None,
        qos: str | None = None,
        time: str | int | None = None,
        constraint: str | None = None,
        reservation: str | None = None,
        gres: str | None = None,
        sbatch_args: Sequence[str] = (),
        python: str | None = None,
        workdir: str | None = None,
        queue_timeout: float | None = None,
        shared_filesystem: bool = True,
    ) -> None:
        for key, value in (
            ("partition", partition),
            ("account", account),
            ("qos", qos),
            ("constraint", constraint),
            ("reservation", reservation),
            ("gres", gres),
            ("python", python),
            ("workdir", workdir),
        ):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigurationError(
                    f"Slurm({key}=...) must be a non-empty string, got {value!r}"
                )
        self.time_limit = parse_time(time) if time is not None else None
        if isinstance(sbatch_args, str) or not all(isinstance(a, str) for a in sbatch_args):
            raise ConfigurationError(
                f"Slurm(sbatch_args=...) must be a list of strings such as ['--exclusive'], "
                f"got {sbatch_args!r}"
            )
        for arg in sbatch_args:
            option = arg.split("=", 1)[0]
            if option in _RESERVED:
                raise ConfigurationError(
                    f"Slurm(sbatch_args=...): {option} is set by flotilla (from "
                    f"{_RESERVED[option]}); remove it"
                )
        if queue_timeout is not None and (
            isinstance(queue_timeout, bool)
            or not isinstance(queue_timeout, int | float)
            or queue_timeout <= 0
        ):
            raise ConfigurationError(
                f"Slurm(queue_timeout=...) must be a positive number of seconds or None, "
                f"got {queue_timeout!r}"
            )
        self.partition = partition
        self.account = account
        self.qos = qos
        self.time = time
        self.constraint = constraint
        self.reservation = reservation
        self.gres = gres
        self.sbatch_args = tuple(sbatch_args)
        self.shares_filesystem = bool(shared_filesystem)
        self.python = python or (sys.executable if self.shares_filesystem else "python3")
        self.workdir = workdir or (None if self.shares_filesystem else "~/.flotilla")
        self.queue_timeout = queue_timeout
        self.home = os.environ.get("FLOTILLA_HOME", "~/.flotilla")

    def __repr__(self) -> str:
        where = f"partition={self.partition!r}" if self.partition else ""
        return f"Slurm({where})"

    def agent_command(self) -> list[str]:
        return [self.python, "-m", "flotilla.agent"]

    def existing_job(self) -> str | None:
        """The job this program runs in, when the pool should use its nodes."""
        job = os.environ.get("SLURM_JOB_ID")
        return job if job and self.partition is None else None

    # -- validation ------------------------------------------------------------------
    def validate(self, spec: PoolSpec) -> None:
        missing = [c for c in COMMANDS if _which(c) is None]
        if missing:
            raise ConfigurationError(
                f"the SLURM commands {', '.join(missing)} are not on PATH: run on a login node "
                "of the cluster (or inside a job), or install the SLURM client "
                "(apt-get install slurm-client) configured for your cluster"
            )
        job = self.existing_job()
        if job is not None:
            nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
            have = len(_hostnames(nodelist)) if nodelist else 0
            if spec.nodes > have:
                raise ConfigurationError(
                    f"the pool asks for {spec.nodes} nodes but runs inside SLURM job {job}, "
                    f"which has {have}: lower nodes= to at most {have}, submit the job with "
                    f"--nodes={spec.nodes}, or pass Slurm(partition=...) for a new allocation"
                )
            return
        part = self.partition_info()
        if spec.nodes > part.nodes:
            raise ConfigurationError(
                f"the pool asks for {spec.nodes} nodes but partition {part.name!r} has "
                f"{part.nodes}: lower nodes= or pick a larger partition (`sinfo -s` lists them)"
            )
        limit = part.max_time
        if self.time_limit is not None and limit is not None and self.time_limit > limit:
            raise ConfigurationError(
                f"Slurm(time={self.time!r}) exceeds partition {part.name!r}'s limit "
                f"({_format_time(limit)}): ask for at most that"
            )
        acc = spec.accelerator
        if acc is not None and self.gres is None:
            fits = [c for kind, c in part.gpus if kind == acc.name.lower() and c >= acc.count]
            if not fits:
                offered = ", ".join(f"gpu:{k}:{c}" if k else f"gpu:{c}" for k, c in part.gpus)
                raise ConfigurationError(
                    f"partition {part.name!r} has no nodes with {acc.count} {acc.name} GPU(s) "
                    f"(its nodes offer: {offered or 'no GPUs'}): pick another partition or "
                    "accelerator, or give the site's GRES name with Slurm(gres=...)"
                )

    def partition_info(self) -> Partition:
        """The partition the pool would run in; ConfigurationError if there is none."""
        proc = _run(["scontrol", "-o", "show", "partition"])
        if proc.returncode != 0:
            raise ProvisionError(f"cannot query SLURM's partitions: {_err(proc)}")
        parts = [_fields(line) for line in proc.stdout.splitlines() if "PartitionName=" in line]
        names = [p["PartitionName"] for p in parts]
        if self.partition is None:
            found = [p for p in parts if p.get("Default") == "YES"]
            if not found:
                raise ConfigurationError(
                    "this SLURM cluster has no default partition: pass Slurm(partition=...), "
                    f"one of {', '.join(names)}"
                )
        else:
            found = [p for p in parts if p["PartitionName"] == self.partition]
            if not found:
                raise ConfigurationError(
                    f"SLURM has no partition {self.partition!r}: pass Slurm(partition=...) "
                    f"with one of {', '.join(names) or '(none)'}"
                )
        p = found[0]
        gpus: list[tuple[str, int]] = []
        gres = _run(["sinfo", "-h", "-p", p["PartitionName"], "-o", "%G"])
        for line in gres.stdout.splitlines():
            gpus += _gres_offer(line)
        return Partition(
            name=p["PartitionName"],
            nodes=int(p.get("TotalNodes", "0") or 0),
            max_time=_limit(p.get("MaxTime")),
            default_time=_limit(p.get("DefaultTime")),
            gpus=tuple(sorted(set(gpus))),
        )

    # -- allocation ------------------------------------------------------------------
    def salloc_argv(self, spec: PoolSpec, nodes: int, exclude: Sequence[str] = ()) -> list[str]:
        """The salloc command line of a job of ``nodes`` nodes for ``spec``."""
        argv = [
            "salloc",
            f"--nodes={nodes}",
            "--ntasks-per-node=1",
            f"--job-name=flotilla-{spec.pool_id}",
            "--no-kill",
        ]
        for option, value in (
            ("partition", self.partition),
            ("account", self.account),
            ("qos", self.qos),
            ("constraint", self.constraint),
            ("reservation", self.reservation),
        ):
            if value is not None:
                argv.append(f"--{option}={value}")
        argv += self._time_args()
        gres = self.gres
        if gres is None and spec.accelerator is not None:
            gres = f"gpu:{spec.accelerator.name.lower()}:{spec.accelerator.count}"
        if gres is not None:
            argv.append(f"--gres={gres}")
        if spec.vcpus is not None:
            argv.append(f"--cpus-per-task={max(1, math.ceil(spec.vcpus))}")
        else:
            argv.append("--exclusive")  # a node is a whole machine, as on other providers
        if spec.memory_gb is not None:
            argv.append(f"--mem={max(1, math.ceil(spec.memory_gb * 1024))}M")
        if exclude:
            argv.append(f"--exclude={','.join(exclude)}")
        return [*argv, *self.sbatch_args, "sh", "-c", _HOLDER]

    def _time_args(self) -> list[str]:
        if self.time_limit is not None:
            return [f"--time={_format_time(self.time_limit)}"]
        try:
            part = self.partition_info()
        except (ConfigurationError, ProvisionError):
            return []
        if part.default_time is not None:
            return []  # SLURM applies the partition's default
        if part.max_time is not None:
            return [f"--time={_format_time(part.max_time)}"]
        _say(
            f"partition {part.name!r} has no time limit: the pool's job asks for "
            f"{FALLBACK_TIME} (pass Slurm(time=...) to choose)"
        )
        return [f"--time={FALLBACK_TIME}"]

    async def acquire(self, spec: PoolSpec) -> SlurmAllocation:
        loop = asyncio.get_running_loop()
        job = self.existing_job()
        if job is not None:
            names = await loop.run_in_executor(None, _hostnames, os.environ["SLURM_JOB_NODELIST"])
            allocation = SlurmAllocation(self, spec, job=_Job(job, None, names))
        else:
            argv = await loop.run_in_executor(None, self.salloc_argv, spec, spec.nodes)
            held = await _Job.submit(argv, self.queue_timeout)
            allocation = SlurmAllocation(self, spec, job=held)
        try:
            names = allocation.job.nodes[: spec.nodes]
            addrs = await loop.run_in_executor(None, _node_addresses, names)
            allocation.machines = [
                allocation.new_machine(rank, name, addrs.get(name, name), allocation.job)
                for rank, name in enumerate(names)
            ]
        except BaseException:
            await allocation.release()
            raise
        return allocation


def _which(command: str) -> str | None:
    import shutil

    return shutil.which(command)


def _format_time(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def _say(message: str) -> None:
    """A console line about the job (queue state, choices made for the user)."""
    with contextlib.suppress(Exception):
        sys.stderr.write(f"flotilla: {message}\n")
        sys.stderr.flush()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the client (its creating thread) dies, so a
    pending salloc revokes its request even when the client is killed -9."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# -- the job -------------------------------------------------------------------------------
class _Job:
    """A SLURM job a pool uses: its id, nodes, and (when the pool made it) the salloc
    holding it."""

    def __init__(self, job_id: str, salloc: subprocess.Popen[bytes] | None, nodes: list[str]):
        self.id = job_id
        self.salloc = salloc
        self.nodes = nodes

    @property
    def owned(self) -> bool:
        return self.salloc is not None

    @classmethod
    async def submit(cls, argv: list[str], queue_timeout: float | None) -> _Job:
        """Run salloc with the holder; return once the job runs. While it is pending, say
        so with SLURM's reason; on timeout, failure or cancellation, cancel it."""
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=_slurm_env(),
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        except OSError as e:
            raise ProvisionError(f"cannot run salloc: {e}") from e
        job = cls("", proc, [])
        try:
            await job._wait_granted(argv, queue_timeout)
        except BaseException:
            await job.release()
            raise
        return job

    async def _wait_granted(self, argv: list[str], queue_timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        proc = self.salloc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        stderr = bytearray()
        err_done = loop.create_future()
        out_line = loop.create_future()
        _read_lines(loop, proc.stderr.fileno(), stderr, err_done, self._on_salloc_line)
        _read_first_line(loop, proc.stdout.fileno(), READY_MARKER.encode(), out_line)
        started = time.monotonic()
        last: tuple[str, str] | None = None
        reported = 0.0
        name = next(a.split("=", 1)[1] for a in argv if a.startswith("--job-name="))
        while not out_line.done():
            await asyncio.wait(
                [out_line, err_done], timeout=1.0, return_when=asyncio.FIRST_COMPLETED
            )
            if out_line.done():
                break
            waited = time.monotonic() - started
            if err_done.done() or proc.poll() is not None:
                await asyncio.wait([err_done], timeout=1.0)
                raise ProvisionError(_salloc_error(self.id, stderr.decode(errors="replace")))
            if queue_timeout is not None and waited > queue_timeout:
                why = f" ({last[0]}, reason: {last[1]})" if last else ""
                raise ProvisionError(
                    f"SLURM job {self.id or '(not yet numbered)'} ({name}) did not start within "
                    f"queue_timeout={queue_timeout:g} s{why}; it was cancelled"
                )
            if self.id:
                state = await loop.run_in_executor(None, _job_state, self.id)
                if state is not None and state[0] == "PENDING":
                    now = time.monotonic()
                    if state != last or now - reported >= _PENDING_REPORT_EVERY:
                        _say(
                            f"SLURM job {self.id} ({name}) is {state[0]} (reason: {state[1]}), "
                            f"waited {waited:.0f} s"
                        )
                        last, reported = state, now
        result = out_line.result()
        if result is None:
            await asyncio.wait([err_done], timeout=1.0)
            raise ProvisionError(_salloc_error(self.id, stderr.decode(errors="replace")))
        words = result.split()
        self.id = words[0] if words else self.id
        if len(words) < 2:
            raise ProvisionError(f"SLURM job {self.id} started without nodes")
        self.nodes = await loop.run_in_executor(None, _hostnames, words[1])

    def _on_salloc_line(self, line: str) -> None:
        found = re.search(r"[Jj]ob allocation (\d+)", line)
        if found and not self.id:
            self.id = found[1]

    async def release(self) -> None:
        """End the job (only if the pool made it) and wait until SLURM no longer lists it."""
        proc = self.salloc
        if proc is None:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()  # the holder exits, salloc relinquishes the job
        if self.id:
            state = await loop.run_in_executor(None, _job_state, self.id)
            if state is not None and state[0] == "PENDING":
                await loop.run_in_executor(None, _run, ["scancel", self.id])
        elif proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)  # not numbered yet: salloc revokes it
        if await _wait_exit(proc, 2.0) is None:
            if self.id:
                await loop.run_in_executor(None, _run, ["scancel", self.id])
            if await _wait_exit(proc, 3.0) is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await _wait_exit(proc, 1.0)
        for stream in (proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        if self.id:
            deadline = time.monotonic() + _GONE_TIMEOUT
            while await loop.run_in_executor(None, _job_state, self.id) is not None:
                if time.monotonic() > deadline:
                    await loop.run_in_executor(None, _run, ["scancel", self.id])
                    _say(f"SLURM job {self.id} is still listed after release; cancelled it")
                    break
                await asyncio.sleep(0.02)


def _job_state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) of a job while SLURM lists it as pending/running/completing; None
    once it is gone."""
    try:
        proc = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], timeout=10.0)
    except ProvisionError:
        return None
    line = proc.stdout.strip().splitlines()[:1]
    if proc.returncode != 0 or not line:
        return None
    state, _, reason = line[0].partition("|")
    return state, reason


def _salloc_error(job_id: str, stderr: str) -> str:
    """salloc's failure, root cause first."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines[-1:]
    cause = errors[0].removeprefix("salloc: error: ") if errors else "salloc exited"
    job = f" (job {job_id})" if job_id else ""
    msg = f"SLURM refused the pool's allocation{job}: {cause}"
    if lines:
        msg += "\n--- salloc's output ---\n" + "\n".join(lines[-10:])
    return msg


def _read_lines(
    loop: asyncio.AbstractEventLoop,
    fd: int,
    buf: bytearray,
    done: asyncio.Future[None],
    on_line: object,
) -> None:
    """Collect ``fd`` into ``buf`` on ``loop``, calling ``on_line`` per line; ``done`` at EOF."""
    assert callable(on_line)
    os.set_blocking(fd, False)
    partial = bytearray()

    def readable() -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            if not done.done():
                done.set_result(None)
            return
        buf.extend(data)
        del buf[:-8192]
        partial.extend(data)
        *lines, rest = partial.split(b"\n")
        partial[:] = rest
        for line in lines:
            on_line(line.decode(errors="replace"))

    loop.add_reader(fd, readable)


def _read_first_line(
    loop: asyncio.AbstractEventLoop, fd: int, marker: bytes, done: asyncio.Future[str | None]
) -> None:
    """Set ``done`` to the rest of the first line of ``fd`` starting with ``marker`` (None at
    EOF), then stop reading."""
    os.set_blocking(fd, False)
    buf = bytearray()

    def readable() -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            if not done.done():
                done.set_result(None)
            return
        buf.extend(data)
        for line in bytes(buf).split(b"\n")[:-1]:
            if line.startswith(marker):
                loop.remove_reader(fd)
                if not done.done():
                    done.set_result(line[len(marker) :].decode(errors="replace").strip())
                return

    loop.add_reader(fd, readable)


async def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.01)
    return proc.returncode


# -- the allocation ------------------------------------------------------------------------
class SlurmAllocation(Allocation):
    """The pool's SLURM job (and the one-node jobs of replacements); an agent is a step."""

    def __init__(self, provider: Slurm, spec: PoolSpec, job: _Job) -> None:
        super().__init__(spec, [])
        self.provider = provider
        self.job = job
        self.jobs: list[_Job] = [job]
        self.job_of: dict[str, _Job] = {}
        self.agents: list[PipeAgent] = []
        self.watch_interval = WATCH_INTERVAL
        self._watcher: asyncio.Task[None] | None = None
        self.env = _slurm_env()
        if provider.shares_filesystem:
            self.env["PYTHONPATH"] = os.pathsep.join(_client_path())
        self.env.pop("COMPUTE_POOL", None)

    def new_machine(self, rank: int, node: str, address: str, job: _Job) -> Machine:
        machine = Machine(rank, node, address, f"{job.id}:{node}")
        self.job_of[machine.ident] = job
        self.mark(machine, MachineState.PENDING)
        return machine

    def srun_argv(self, machine: Machine, command: list[str]) -> list[str]:
        job = self.job_of[machine.ident]
        argv = [
            "srun",
            f"--jobid={job.id}",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={machine.host}",
            "--overlap",
            f"--job-name=flotilla-{self.spec.pool_id}-node{machine.rank}",
            "--quiet",
            "--unbuffered",  # else slurmstepd forwards stdout line by line (frames are binary)
        ]
        if self.provider.shares_filesystem and self.provider.workdir is not None:
            argv.append(f"--chdir={self.provider.workdir}")
        return [*argv, *command]

    async def start_agent(self, machine: Machine, command: list[str]) -> AgentProcess:
        provider = self.provider
        if not provider.shares_filesystem:
            workdir = provider.workdir or "~/.flotilla"
            bundle = await asyncio.get_running_loop().run_in_executor(None, client_bundle)
            boot = start_command(workdir, provider.python, bundle.hash, len(bundle.data))
            command = ["sh", "-c", boot]
        argv = self.srun_argv(machine, command)
        try:
            agent = PipeAgent(spawn(argv, env=self.env), machine.address, machine.host)
        except OSError as e:
            raise ProvisionError(f"{machine.host}: cannot run srun: {e}") from e
        self.agents.append(agent)
        if not provider.shares_filesystem:
            try:
                await start_agent(agent, workdir, provider.python, bundle)
            except NoAnswer as e:
                await agent.terminate()
                raise ProvisionError(
                    f"{machine.host}: the SLURM step ended without starting the agent: "
                    f"{e.stderr.strip() or f'exit status {e.status}'}"
                ) from None
            except BaseException:
                await agent.terminate()
                raise
        return agent

    async def replace(self, rank: int, reason: str) -> Machine:
        """A new one-node job for ``rank`` (SLURM cannot add a node to a running job),
        avoiding the lost node."""
        old = self.machines[rank]
        self.mark(old, MachineState.LOST)
        if not self.job.owned:
            raise ProvisionError(
                f"{old.host}: {reason}; the pool runs inside SLURM job {self.job.id}, whose "
                "nodes it cannot replace"
            )
        loop = asyncio.get_running_loop()
        argv = await loop.run_in_executor(None, self.provider.salloc_argv, self.spec, 1, [old.host])
        job = await _Job.submit(argv, self.provider.queue_timeout)
        self.jobs.append(job)
        addrs = await loop.run_in_executor(None, _node_addresses, job.nodes)
        machine = self.new_machine(rank, job.nodes[0], addrs.get(job.nodes[0], job.nodes[0]), job)
        self.machines[rank] = machine
        return machine

    def watch(self, on_lost: LostCallback) -> None:
        """Also look at SLURM's view every ``watch_interval`` s: a node SLURM marks DOWN,
        FAIL or NOT_RESPONDING, or a job that ended under the pool (cancelled by an admin,
        out of time), is reported lost. A dead step is noticed by the client anyway."""
        super().watch(on_lost)
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to poll from
            if self._watcher is None:
                self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        reported: set[str] = set()
        while self.state is AllocationState.READY:
            await asyncio.sleep(self.watch_interval)
            machines = [m for m in self.machines if m.ident not in reported]
            if not machines or self.state is not AllocationState.READY:
                continue
            nodes = await loop.run_in_executor(None, _node_states, [m.host for m in machines])
            ended = {}
            for job in {self.job_of[m.ident] for m in machines}:
                if await loop.run_in_executor(None, _job_state, job.id) is None:
                    ended[job.id] = job
            if self.state is not AllocationState.READY:
                break
            for m in machines:
                state, why = nodes.get(m.host, ("", ""))
                job = self.job_of[m.ident]
                if _LOST_STATES & set(state.split("+")):
                    reason = f"SLURM marks node {m.host} {state}" + (f" ({why})" if why else "")
                elif job.id in ended:
                    reason = f"SLURM job {job.id} ended (cancelled, or out of time)"
                else:
                    continue
                reported.add(m.ident)
                self.report_lost(m.rank, reason)

    async def release(self) -> None:
        """Stop the steps still running, then end every job the pool made (never one it
        runs inside) and wait until SLURM no longer lists them."""
        if self.state is AllocationState.RELEASED:
            return
        self.state = AllocationState.RELEASING
        if self._watcher is not None:
            self._watcher.cancel()
        await asyncio.gather(
            *(a.terminate() for a in self.agents if a.proc.poll() is None),
            return_exceptions=True,
        )
        await asyncio.gather(*(job.release() for job in self.jobs), return_exceptions=True)
        self.state = AllocationState.RELEASED
        for machine in self.machines:
            self.mark(machine, MachineState.RELEASED)
