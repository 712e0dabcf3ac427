"""Managed jobs on disk: their lifecycle and records, under ``$FLOTILLA_HOME/managed``::

    managed/             mode 0700
      jobs.lock          flock()ed while a record is read-modified-written or an id taken
      ID.json            the job's record (ManagedJobRecord), replaced atomically
      ID/controller.log  the controller's own output
      ID/job.log         every attempt's output (node lines prefixed) and the
                         controller's messages (``flotilla: ...``); node-K.log per node
      ID/nodes/          local provider: the nodes' working directories

A record never holds secrets nor environment values: the controller gets the job's
variables through a pipe from ``flotilla jobs launch`` and keeps them in memory.
This module imports nothing heavy: ``jobs queue`` reads the records on every call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..._errors import ConfigurationError
from ..._system import locks, procs
from ..state import ClusterRecord, Paths, flotilla_home, read_json, write_json


class ManagedJobState(Enum):
    """A managed job's lifecycle. Written transitions (who writes them)::

    (none) --jobs launch--------------------> PENDING     the CLI; it starts the controller
    PENDING --controller took the job-------> STARTING    controller: provision, sync, setup
    STARTING --run started on every node----> RUNNING     controller
    RUNNING --run succeeded everywhere------> SUCCEEDED   controller; cluster torn down
    STARTING | RUNNING --a node was lost, or the program failed
                         with restarts left--> RECOVERING  controller
    RECOVERING --cluster back, setup done,
                 run started again-----------> RUNNING     controller
    PENDING | STARTING | RUNNING | RECOVERING
              --cannot provision, or failed
                with no restarts left--------> FAILED      controller; cluster torn down
              --jobs cancel------------------> CANCELLED   controller; cluster torn down
              --its controller is gone-------> FAILED      the CLI, when it finds it so
    """

    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def finished(self) -> bool:
        """Whether the job has ended (its cluster is down)."""
        return self in (
            ManagedJobState.SUCCEEDED,
            ManagedJobState.FAILED,
            ManagedJobState.CANCELLED,
        )


_FINISHED = {s.value for s in ManagedJobState if s.finished}


@dataclass
class ManagedJobRecord:
    """A managed job's record (``ID.json``).

    Attributes:
        id: the job's number (1, 2, ...), unique under this FLOTILLA_HOME.
        name: the task's name (``-n`` overrides it).
        state: a ManagedJobState value.
        num_nodes: the nodes ``run`` runs on (the job's cluster has as many).
        provider: where its cluster runs (``ProviderSpec`` as a dict).
        recovery: its ``job_recovery`` (``JobRecovery`` as a dict).
        task_id: FLOTILLA_TASK_ID / SKYPILOT_TASK_ID, the same in every attempt.
        submitted: UNIX time of ``jobs launch``.
        started: UNIX time ``run`` first started (0: not yet).
        run_started: UNIX time the latest attempt's ``run`` started (0: not yet).
        ended: UNIX time the job ended (0: not yet).
        recoveries: how many times the job was recovered (node losses and restarts).
        restarts_on_errors: restarts counted against ``max_restarts_on_errors``.
        exit_code: the job's exit status once ended (0: succeeded).
        error: why it failed or was cancelled, root cause first ('' otherwise).
        pid: the controller's process id (0 before it started).
        pid_start: the controller's start time in clock ticks (guards against pid reuse).
        token: the prefix of FLOTILLA_RUN_TOKEN in the job's processes (finds them).
        volumes: the buckets its nodes see (``Volume`` fields as dicts, from the task's
            ``file_mounts``): where a job keeps the checkpoints it resumes from.
        execution: for a pipeline's record, "serial" or "parallel" ('' for a task or a
            single job). A pipeline runs no cluster itself: its tasks do.
        tasks: a pipeline's tasks' ids, in order (each a record of its own).
        pipeline: for a pipeline's task, the pipeline's id (0 otherwise).
        index: a pipeline task's position in it (0-based).
    """

    id: int
    name: str
    state: str = ManagedJobState.PENDING.value
    num_nodes: int = 1
    provider: dict[str, Any] = field(default_factory=dict)
    recovery: dict[str, Any] = field(default_factory=dict)
    task_id: str = ""
    submitted: float = 0.0
    started: float = 0.0
    run_started: float = 0.0
    ended: float = 0.0
    recoveries: int = 0
    restarts_on_errors: int = 0
    exit_code: int | None = None
    error: str = ""
    pid: int = 0
    pid_start: int = 0
    token: str = ""
    volumes: list[dict[str, Any]] = field(default_factory=list)
    execution: str = ""
    tasks: list[int] = field(default_factory=list)
    pipeline: int = 0
    index: int = 0

    @property
    def is_pipeline(self) -> bool:
        return bool(self.execution)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ManagedJobRecord:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def controller_gone(self) -> bool:
        """Whether the job is unfinished but its controller process no longer runs."""
        if self.state in _FINISHED or not self.pid:
            return False
        return not procs.alive(self.pid, self.pid_start)

    def observed_state(self) -> ManagedJobState:
        """The recorded state, or FAILED when the job is unfinished and its controller is
        gone (killed, machine rebooted)."""
        if self.controller_gone():
            return ManagedJobState.FAILED
        return ManagedJobState(self.state)


class JobsHome:
    """Where managed jobs keep their files (``$FLOTILLA_HOME/managed``)."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = home or flotilla_home()
        self.root = self.home / "managed"
        self.lock = self.root / "jobs.lock"

    def record(self, job_id: int) -> Path:
        return self.root / f"{job_id}.json"

    def dir(self, job_id: int) -> Path:
        return self.root / str(job_id)

    def log(self, job_id: int) -> Path:
        return self.dir(job_id) / "job.log"

    def controller_log(self, job_id: int) -> Path:
        return self.dir(job_id) / "controller.log"

    def nodes(self, job_id: int) -> Path:
        return self.dir(job_id) / "nodes"

    def request(self, job_id: int) -> Path:
        """A pipeline's tasks (JobSpecs, with their variables and secrets), mode 0600 in
        the private folder, so that a restarted controller can resume it; removed when
        the pipeline ends."""
        return self.dir(job_id) / "request.json"

    def ensure(self) -> None:
        """Create the folders, private to this user."""
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)

    def ids(self) -> list[int]:
        """Every job's id, oldest first."""
        try:
            entries = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(e[:-5]) for e in entries if e.endswith(".json") and e[:-5].isdigit())

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the jobs' lock (an flock on jobs.lock) for a read-modify-write."""
        self.ensure()
        with locks.exclusive(self.lock):
            yield

    def cluster(self, rec: ManagedJobRecord) -> tuple[Paths, ClusterRecord]:
        """The job's cluster as the backends know clusters (their ``on_up``/``on_down``
        hooks): files in the job's own folder, its provider, its run token. It has no
        state file: ``flotilla status`` does not list it, ``jobs queue`` does."""
        paths = Paths(f"managed-{rec.id}", self.home)
        paths.dir = self.dir(rec.id)
        paths.nodes = self.nodes(rec.id)
        paths.jobs = paths.dir
        paths.daemon_log = self.controller_log(rec.id)
        paths.ssh_config = paths.dir / "ssh.config"
        record = ClusterRecord(
            name=paths.name,
            provider=dict(rec.provider),
            num_nodes=rec.num_nodes,
            pid=rec.pid,
            pid_start=rec.pid_start,
            token=rec.token,
        )
        return paths, record

    def load(self, job_id: int) -> ManagedJobRecord | None:
        """A job's record, or None. Reads need no lock: writes are atomic renames."""
        path = self.record(job_id)
        data = read_json(
            path,
            lambda why: ConfigurationError(f"the managed job record {path} is unreadable: {why}"),
        )
        return None if data is None else ManagedJobRecord.from_dict(data)

    def all(self) -> list[ManagedJobRecord]:
        """Every job's record, oldest first."""
        out = []
        for job_id in self.ids():
            with contextlib.suppress(ConfigurationError):
                rec = self.load(job_id)
                if rec is not None:
                    out.append(rec)
        return out

    def save(self, record: ManagedJobRecord) -> None:
        """Write a record atomically (temporary file, fsync, rename). Call under ``locked``."""
        write_json(self.record(record.id), asdict(record))

    def create(self, record: ManagedJobRecord) -> ManagedJobRecord:
        """Give ``record`` the next free id, make its folder and save it."""
        return self.create_many([record])[0]

    def create_many(self, records: list[ManagedJobRecord]) -> list[ManagedJobRecord]:
        """Give each record the next free id (consecutive), make their folders, save them."""
        with self.locked():
            ids = self.ids()
            first = (ids[-1] + 1) if ids else 1
            for i, record in enumerate(records):
                record.id = first + i
                self.dir(record.id).mkdir(mode=0o700)
                self.save(record)
        return records

    @contextlib.contextmanager
    def update(self, job_id: int) -> Iterator[ManagedJobRecord]:
        """Lock, load, let the caller change the record, save. The record must exist."""
        with self.locked():
            record = self.load(job_id)
            if record is None:
                raise ConfigurationError(f"there is no managed job {job_id}")
            yield record
            self.save(record)

    def resolve(self, ref: str) -> ManagedJobRecord:
        """The job ``ref`` names: an id, or a name that only one job has (the newest
        unfinished one when several jobs share it)."""
        if ref.isdigit():
            rec = self.load(int(ref))
            if rec is None:
                raise ConfigurationError(
                    f"there is no managed job {ref} (see `flotilla jobs queue`)"
                )
            return rec
        named = [r for r in self.all() if r.name == ref]
        if not named:
            raise ConfigurationError(
                f"there is no managed job named {ref!r} (see `flotilla jobs queue`)"
            )
        live = [r for r in named if not r.observed_state().finished]
        if len(live) > 1:
            ids = ", ".join(str(r.id) for r in live)
            raise ConfigurationError(
                f"{len(live)} unfinished managed jobs are named {ref!r} (ids {ids}): "
                "give the id instead"
            )
        return (live or named)[-1]
