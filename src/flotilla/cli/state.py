"""Named clusters on disk: where their files live, their lifecycle, their state files.

Everything lives under ``$FLOTILLA_HOME`` (default ``~/.flotilla``), in folders created or
verified private (owned by this user, mode 0700, never through a symlink: ``_node/private``)::

    clusters/              mode 0700
      NAME.json            the cluster's state (ClusterRecord), replaced atomically
      NAME.lock            flock()ed while the state is read-modified-written; it also holds
                           the name's last generation number (see ClusterRecord.generation)
      NAME.sock            the cluster daemon's Unix socket (reached through the folder's
                           descriptor, so a long FLOTILLA_HOME needs no other folder)
      NAME/daemon.log      the daemon's own output
      NAME/nodes/          local provider: the nodes' working directories
      NAME/jobs/ID/        a job's logs: job.log (every node, prefixed), node-K.log

The state file never holds secrets: no environment values, only variable names.
A state file that cannot be read affects only its own cluster (CorruptStateError).
This module imports nothing heavy: the CLI reads state on every command.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from .._errors import ConfigurationError, FlotillaError
from .._system import locks, procs
from .._system.private import flotilla_home as flotilla_home
from .._system.private import private_dirs

NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,62}")


class CorruptStateError(ConfigurationError):
    """A cluster's state file is unreadable or malformed (truncated, edited by hand).

    Only that cluster is affected: ``status`` lists it as CORRUPT, ``down NAME`` removes it.
    """


class StaleGenerationError(FlotillaError):
    """The cluster's record belongs to a later launch of the same name than the process
    that wanted to change it (an old daemon finishing after ``down``, while a new
    ``launch`` already runs): that process must leave the record and files alone."""


class ClusterState(Enum):
    """A named cluster's lifecycle. Written transitions (who makes them)::

        (none) ---launch--------------> STARTING     the CLI creates the record, starts the daemon
        STARTING --pool running-------> UP           daemon
        STARTING --provisioning failed-> FAILED      daemon (the error is kept in the record)
        UP --down / idle / SIGTERM----> STOPPING     daemon
        STOPPING --pool closed--------> STOPPED      daemon; `down` then deletes the record
        STOPPED, FAILED --launch------> STARTING     the CLI, with a new daemon

    STALE is never written: it is what a record in STARTING, UP or STOPPING is when its
    daemon process is gone (killed, machine rebooted). ``flotilla down`` cleans it up.
    """

    STARTING = "STARTING"
    UP = "UP"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"
    STALE = "STALE"

    @property
    def needs_daemon(self) -> bool:
        """Whether a daemon process must exist in this state."""
        return self in (ClusterState.STARTING, ClusterState.UP, ClusterState.STOPPING)


class JobStatus(Enum):
    """A job's lifecycle::

    PENDING --> SETTING_UP --> RUNNING --> SUCCEEDED | FAILED | CANCELLED
    PENDING --> CANCELLED | FAILED (the cluster failed to start)
    SETTING_UP --> FAILED_SETUP | CANCELLED

    LOST is never written: it is what an unfinished job is when its cluster's daemon is
    gone (``queue`` on a STALE cluster). A new daemon that re-attaches follows the RUNNING
    ones and queues the PENDING and SETTING_UP ones again (see ``cli/adopt.py``); it
    records the others (and every one, when it cannot re-attach) as FAILED.
    """

    PENDING = "PENDING"
    SETTING_UP = "SETTING_UP"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    FAILED_SETUP = "FAILED_SETUP"
    CANCELLED = "CANCELLED"
    LOST = "LOST"

    @property
    def finished(self) -> bool:
        return self not in (JobStatus.PENDING, JobStatus.SETTING_UP, JobStatus.RUNNING)


@dataclass
class NodeRecord:
    """One node of a running cluster.

    Attributes:
        node: index in the cluster (0 is the head).
        ip: the address other nodes reach it at.
        host: its host name.
        workdir: its working directory (where jobs run).
        agent_pid: pid of its agent, on its host.
        gpus: accelerators the node has.
        scheduler_job: the batch scheduler's job the node's agent runs in
            (``SLURM_JOB_ID``; '' when none).
        scheduler_node: the scheduler's name for the node (``SLURMD_NODENAME``; '').
        cpus: its vCPUs (0: unknown); with ``memory_gb`` (GB, 0: unknown) and ``gpus``,
            the room the cluster's job queue shares out.
        reattach: the command, run on the node, that bridges to its agent again
            (``_node/reattach.py``; [] when the agent cannot be re-attached).
    """

    node: int
    ip: str
    host: str
    workdir: str
    agent_pid: int
    gpus: int = 0
    scheduler_job: str = ""
    scheduler_node: str = ""
    cpus: int = 0
    memory_gb: float = 0.0
    reattach: list[str] = field(default_factory=list)


@dataclass
class JobRecord:
    """One job as ``flotilla queue`` shows it.

    Attributes:
        id: job number in the cluster (1, 2, ...).
        name: the task's name.
        task_id: FLOTILLA_TASK_ID / SKYPILOT_TASK_ID of the job.
        status: a JobStatus value.
        num_nodes: nodes ``run`` runs on.
        submitted, started, ended: UNIX times (0 when not yet).
        exit_code: the job's exit status (None while it runs; the failing node's status).
        failed_node: the node that failed first, or None.
        error: the first line of the failure report ('' when it succeeded).
        resources: what it holds on each of its nodes (``A100:0.5 cpus=2``; ``whole``:
            its nodes, alone).
        nodes: the nodes its ``run`` runs on (a daemon that re-attaches follows it there).
    """

    id: int
    name: str
    task_id: str
    status: str = JobStatus.PENDING.value
    num_nodes: int = 0
    submitted: float = 0.0
    started: float = 0.0
    ended: float = 0.0
    exit_code: int | None = None
    failed_node: int | None = None
    error: str = ""
    resources: str = ""
    nodes: list[int] = field(default_factory=list)


@dataclass
class ClusterRecord:
    """A named cluster's state file.

    Attributes:
        name: the cluster's name.
        provider: how its nodes are provisioned (``ProviderSpec`` as a dict).
        num_nodes: number of nodes.
        state: a ClusterState value (never STALE).
        created: UNIX time the cluster was launched.
        last_activity: UNIX time of the last job end or command.
        pid: the daemon's process id (0 before it started).
        pid_start: the daemon's start time in clock ticks (guards against pid reuse).
        idle_minutes: the daemon stops the cluster after this long without jobs (None: never).
        nodes: the running nodes.
        jobs: every job, oldest first.
        next_job: the next job's number.
        error: why the cluster failed, for FAILED.
        token: the prefix of FLOTILLA_RUN_TOKEN in its jobs' processes (not a secret: it
            finds them, after a daemon died).
        volumes: the buckets every node sees (``Volume`` fields as dicts; no credentials:
            the daemon resolves them), from the launching task's ``file_mounts``.
        engines: the engines its pool runs (``ray``, ``dask``), from the launching task's
            ``engines``.
        autodown: the idle limit (``idle_minutes``) tears the cluster down instead of
            stopping it (``launch --autostop M --down``).
        reattach_secret: the key a new daemon proves to the nodes' agents to re-attach to
            them after the daemon died (hex, a secret: the record is private).
        clients: a cloud cluster's: the client identities (``cloud.identity``) of its
            daemons, the first one's on its instances; each daemon holds leases on them
            (``adopt.Leases``). More than one: a daemon re-attached to the instances.
        generation: which launch of this name the record belongs to (1, 2, ... per name,
            counted in NAME.lock). A daemon changes or deletes the record and the
            cluster's files only while the generation is its own, so a daemon of an
            earlier launch, still finishing, cannot touch a newer cluster of the same name.
    """

    name: str
    provider: dict[str, Any]
    num_nodes: int
    state: str = ClusterState.STARTING.value
    created: float = 0.0
    last_activity: float = 0.0
    pid: int = 0
    pid_start: int = 0
    idle_minutes: float | None = None
    nodes: list[NodeRecord] = field(default_factory=list)
    jobs: list[JobRecord] = field(default_factory=list)
    next_job: int = 1
    error: str = ""
    token: str = ""
    generation: int = 0
    volumes: list[dict[str, Any]] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    autodown: bool = False
    reattach_secret: str = ""
    clients: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterRecord:
        data = dict(data)
        data["nodes"] = [NodeRecord(**n) for n in data.get("nodes", [])]
        data["jobs"] = [JobRecord(**j) for j in data.get("jobs", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def job(self, job_id: int) -> JobRecord | None:
        return next((j for j in self.jobs if j.id == job_id), None)

    def observed_state(self) -> ClusterState:
        """The recorded state, or STALE when its daemon is gone."""
        state = ClusterState(self.state)
        if state.needs_daemon and self.pid and not procs.alive(self.pid, self.pid_start):
            return ClusterState.STALE
        return state

    def observed_jobs(self) -> list[JobRecord]:
        """The jobs as they are: unfinished ones are LOST when the daemon is gone."""
        if self.observed_state() is not ClusterState.STALE:
            return list(self.jobs)
        return [
            j if JobStatus(j.status).finished else replace(j, status=JobStatus.LOST.value)
            for j in self.jobs
        ]


# -- where things live ---------------------------------------------------------------------


def check_name(name: str) -> str:
    """``name`` if it is a valid cluster name, else a ConfigurationError."""
    if not NAME_RE.fullmatch(name):
        raise ConfigurationError(
            f"{name!r} is not a valid cluster name: use a letter, then letters, digits, "
            "'-' or '_' (at most 63 characters)"
        )
    return name


class Paths:
    """The files of one named cluster."""

    def __init__(self, name: str, home: Path | None = None) -> None:
        self.name = check_name(name)
        self.home = home or flotilla_home()
        self.clusters = self.home / "clusters"
        self.state = self.clusters / f"{name}.json"
        self.lock = self.clusters / f"{name}.lock"
        self.dir = self.clusters / name
        self.daemon_log = self.dir / "daemon.log"
        self.nodes = self.dir / "nodes"
        self.jobs = self.dir / "jobs"
        self.ssh_config = self.home / "ssh" / f"{name}.config"
        self.socket = self.clusters / f"{name}.sock"

    def job_dir(self, job_id: int) -> Path:
        return self.jobs / str(job_id)

    def ensure(self) -> None:
        """Create (or verify) the cluster's folders, private to this user."""
        private_dirs(self.home, self.clusters, self.dir)


def all_names(home: Path | None = None) -> list[str]:
    """Names of every cluster with a state file."""
    folder = (home or flotilla_home()) / "clusters"
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(e[:-5] for e in entries if e.endswith(".json") and NAME_RE.fullmatch(e[:-5]))


# -- reading and writing -------------------------------------------------------------------
def read_json(path: Path, unreadable: Callable[[str], Exception]) -> Any:
    """The JSON document in ``path`` (a record :func:`write_json` wrote), or None when there
    is none; ``unreadable(why)`` is raised when it cannot be read or parsed. Reads need no
    lock: writes are atomic renames."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise unreadable(str(e)) from None


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (a temporary file beside it, fsync,
    rename): a reader sees the old record or the new one, never part of one."""
    text = json.dumps(data, indent=1, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        os.write(fd, text)
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load(paths: Paths) -> ClusterRecord | None:
    """The cluster's record, or None when it has none. Reads need no lock: writes are
    atomic renames."""
    data = read_json(paths.state, lambda why: _corrupt(paths, why))
    if data is None:
        return None
    try:
        if not isinstance(data, dict):
            raise TypeError(f"expected an object, got {type(data).__name__}")
        record = ClusterRecord.from_dict(data)
        ClusterState(record.state)
        for job in record.jobs:
            JobStatus(job.status)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise _corrupt(paths, f"malformed: {e}") from None
    return record


def _corrupt(paths: Paths, why: str) -> CorruptStateError:
    return CorruptStateError(
        f"cluster {paths.name}: its state file {paths.state} is unreadable ({why}); "
        f"`flotilla down {paths.name}` removes it (other clusters are not affected)"
    )


@contextlib.contextmanager
def locked(paths: Paths) -> Iterator[None]:
    """Hold the cluster's lock (an flock on NAME.lock) for a read-modify-write."""
    paths.ensure()
    with locks.exclusive(paths.lock):
        yield


@contextlib.contextmanager
def locked_generation(paths: Paths) -> Iterator[int]:
    """Hold the cluster's lock and take the name's next generation number (kept in
    NAME.lock, which outlives the record): for a launch that writes a new record."""
    paths.ensure()
    with locks.exclusive(paths.lock) as fd:
        raw = os.pread(fd, 32, 0).strip()
        generation = (int(raw) if raw.isdigit() else 0) + 1
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(generation).encode(), 0)
        yield generation


def save(paths: Paths, record: ClusterRecord) -> None:
    """Write the record atomically (temporary file, fsync, rename). Call under ``locked``."""
    paths.ensure()
    write_json(paths.state, asdict(record))


@contextlib.contextmanager
def update(paths: Paths, generation: int | None = None) -> Iterator[ClusterRecord]:
    """Lock, load, let the caller change the record, save. The record must exist, and be
    of ``generation`` when one is given (else StaleGenerationError)."""
    with locked(paths):
        record = load_own(paths, generation)
        yield record
        save(paths, record)


def load_own(paths: Paths, generation: int | None) -> ClusterRecord:
    """The cluster's record, which must exist (else ConfigurationError) and be of
    ``generation`` when one is given (else StaleGenerationError). Call under ``locked``."""
    record = load(paths)
    if record is None:
        raise ConfigurationError(f"cluster {paths.name!r} does not exist")
    if generation is not None and record.generation != generation:
        raise StaleGenerationError(
            f"cluster {paths.name} was launched again (generation {record.generation}, "
            f"not {generation})"
        )
    return record


def delete(paths: Paths, generation: int | None = None) -> bool:
    """Remove the cluster's state, socket, ssh config and files (logs included); with
    ``generation``, only while the record is of that generation (else nothing is removed
    and False is returned). A corrupt record is removed too."""
    import shutil

    with locked(paths):
        if generation is not None:
            try:
                current = load(paths)
            except CorruptStateError:
                current = None
            if current is not None and current.generation != generation:
                return False
        for path in (paths.state, paths.socket, paths.ssh_config):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if paths.nodes.is_dir():  # never into a bucket a node left mounted
            from .._system.mounts import unmount_under

            unmount_under(str(paths.nodes))
        shutil.rmtree(paths.dir, ignore_errors=True)
    # NAME.lock stays: removing it could let two commands lock different files at once
    return True
