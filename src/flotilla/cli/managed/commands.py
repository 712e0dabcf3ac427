"""``flotilla jobs ...``: managed jobs (SkyPilot's ``sky jobs``)::

    flotilla jobs launch task.yaml [-n NAME] [--nodes N] [--env K=V] [--secret K=V]
                         [--provider ... and its options] [-d]
    flotilla jobs queue                      every managed job: state, recoveries, durations
    flotilla jobs logs NAME|ID [--follow]    a job's output, every attempt's
    flotilla jobs cancel NAME|ID... | -a     stop jobs (their clusters are torn down)

A task file of several documents is a pipeline (serial) or a job group (parallel): see
``pipeline``; ``queue``, ``logs`` and a following ``launch`` restart the controller of an
unfinished pipeline found gone (:func:`revive`), which resumes it.

``jobs launch`` starts the job's controller (see ``controller``), which runs the task on a
cluster of its own and recovers it when a node is lost or the program fails with
restarts left (the task file's ``resources.job_recovery``). Without ``-d`` the command
follows the job's log until it ends; Ctrl-C stops following, not the job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError, FlotillaError
from ..._system import procs
from ..console import json_flag, print_json, say
from .cleanup import reap_leftovers
from .recovery import JobRecovery
from .state import JobsHome, ManagedJobRecord, ManagedJobState

if TYPE_CHECKING:
    from ..._volume import Volume
    from ..backends.base import ProviderSpec
    from ..jobspec import JobSpec
    from ..taskfile import Pipeline

_FOLLOW_POLL = 0.1  # seconds between looks at a followed job's log
_CANCEL_WAIT = 60.0  # seconds a controller gets to cancel its job and tear down


# -- launch ----------------------------------------------------------------------------------
def cmd_jobs_launch(args: argparse.Namespace) -> int:
    """Check the task, record the job, start its controller; follow it unless ``-d``."""
    from ..._volume import check_volumes, node_spec
    from ..backends import registry
    from ..cmd_run import _job_spec, _node_volumes, _task_from

    if os.path.isfile(args.task):
        from ..taskfile import Pipeline, load_tasks

        loaded = load_tasks(args.task)
        if isinstance(loaded, Pipeline):
            return _launch_pipeline(args, loaded)
    task = _task_from(args.task, None, args)
    if not task.run:
        raise ConfigurationError("a managed job needs `run:` (setup alone never ends a job)")
    if args.nodes is not None and args.nodes < 1:
        raise ConfigurationError(f"--nodes must be at least 1, got {args.nodes}")
    spec = registry.spec_from_args(args, task) or registry.DEFAULT.spec_type()
    nodes = args.nodes or task.num_nodes or 1
    job_nodes = task.job_nodes(nodes)
    for warning in registry.backend_for(spec).check_task(task, spec, nodes):
        say(f"warning: {warning}")
    recovery = task.resources.job_recovery or JobRecovery()
    if args.retries:  # --retries N, as for `launch`: N restarts when the program fails
        if args.retries < 0:
            raise ConfigurationError(f"--retries must be 0 or more, got {args.retries}")
        recovery = replace(recovery, max_restarts_on_errors=args.retries)
    volumes = _node_volumes(task, spec)
    if volumes:  # the buckets can be read: before anything is provisioned
        shared = registry.backend_for(spec).shares_filesystem
        check_volumes(volumes, this_machine=shared)
        node_spec(volumes)
    job = _job_spec(task, job_nodes, True, True, False, 0)
    if args.name:
        from ..state import check_name

        check_name(args.name)
        job = _renamed(job, args.name)
    rec = start(JobsHome(), job, spec, recovery, volumes)
    say(
        f"managed job {rec.id} ({rec.name}): {job_nodes} {spec.kind} node(s), task id {rec.task_id}"
    )
    if args.detach:
        say(
            f"follow it with `flotilla jobs logs {rec.id} --follow`; "
            f"`flotilla jobs cancel {rec.id}` stops it"
        )
        return 0
    return follow(JobsHome(), rec.id, interrupt_hint=True)


def _renamed(job: JobSpec, name: str) -> JobSpec:
    return replace(job, name=name)


def _launch_pipeline(args: argparse.Namespace, pipeline: Pipeline) -> int:
    """Check every task of the pipeline (provider, variables, buckets) before anything
    starts, record the pipeline and its tasks, start its controller; follow it unless
    ``-d``."""
    from ..._volume import check_volumes, node_spec
    from ..backends import registry
    from ..cmd_run import _job_spec, _node_volumes, _variables
    from ..jobspec import task_id
    from ..state import write_json
    from .group import env_name

    if args.nodes is not None:
        raise ConfigurationError(
            "--nodes sets one task's nodes: in a pipeline, give each task its `num_nodes`"
        )
    name = pipeline.name
    if args.name:
        name = args.name
    from ..state import check_name

    check_name(name)
    envs, secrets = _variables(args)
    planned: list[tuple[JobSpec, ProviderSpec, JobRecovery, tuple[Volume, ...]]] = []
    variables: dict[str, str] = {}
    for task in pipeline.tasks:
        task = task.with_overrides(envs, secrets)
        task_name = task.name or "task"
        check_name(task_name)
        if not task.run:
            raise ConfigurationError(
                f"{pipeline.path}:{task.lines.get('setup', 0)}: task {task.name!r} needs "
                "`run:` (setup alone never ends a job)"
            )
        if pipeline.execution == "parallel":
            var = env_name(task_name)
            if var in variables:
                raise ConfigurationError(
                    f"{pipeline.path}: tasks {variables[var]!r} and {task_name!r} give the same "
                    f"variable names (FLOTILLA_JOBGROUP_{var}_HEAD_IP): rename one"
                )
            variables[var] = task_name
        spec = registry.spec_from_args(args, task) or registry.DEFAULT.spec_type()
        nodes = task.num_nodes or 1
        for warning in registry.backend_for(spec).check_task(task, spec, nodes):
            say(f"warning: task {task.name}: {warning}")
        recovery = task.resources.job_recovery or JobRecovery()
        if args.retries:
            if args.retries < 0:
                raise ConfigurationError(f"--retries must be 0 or more, got {args.retries}")
            recovery = replace(recovery, max_restarts_on_errors=args.retries)
        volumes = _node_volumes(task, spec)
        if volumes:
            check_volumes(volumes, this_machine=registry.backend_for(spec).shares_filesystem)
            node_spec(volumes)
        job = _job_spec(task, task.job_nodes(nodes), True, True, False, 0)
        planned.append((job, spec, recovery, volumes))
    home = JobsHome()
    now = time.time()
    head = ManagedJobRecord(
        id=0,
        name=name,
        num_nodes=sum(job.num_nodes or 1 for job, *_ in planned),
        submitted=now,
        execution=pipeline.execution,
    )
    children = [
        _record(job, spec, recovery, volumes, now, index=i)
        for i, (job, spec, recovery, volumes) in enumerate(planned)
    ]
    home.create_many([head, *children])
    with home.locked():
        for child in children:
            child.pipeline = head.id
            child.task_id = task_id(f"{name}-{head.id}-{child.name}", child.id, now)
            home.save(child)
        head.tasks = [c.id for c in children]
        home.save(head)
    write_json(home.request(head.id), {"tasks": [{"job": job.to_dict()} for job, *_ in planned]})
    _start_pipeline(home, head.id)
    say(
        f"managed pipeline {head.id} ({name}, {pipeline.execution}): "
        + ", ".join(f"{c.name} (job {c.id})" for c in children)
    )
    if args.detach:
        say(
            f"follow it with `flotilla jobs logs {head.id} --follow`; "
            f"`flotilla jobs cancel {head.id}` stops it"
        )
        return 0
    return follow(home, head.id, interrupt_hint=True)


def _record(
    job: JobSpec,
    spec: ProviderSpec,
    recovery: JobRecovery,
    volumes: Sequence[Volume],
    now: float,
    index: int = 0,
) -> ManagedJobRecord:
    """A managed job's record, to create (``index``: its place in a pipeline)."""
    return ManagedJobRecord(
        id=0,
        name=job.name,
        num_nodes=job.num_nodes or 1,
        provider=spec.to_dict(),
        recovery=recovery.to_dict(),
        submitted=now,
        volumes=[v.to_node() for v in volumes],
        index=index,
    )


def _start_pipeline(home: JobsHome, pipeline_id: int) -> None:
    """Start the pipeline's controller (it resumes from the records); returns once it
    owns the pipeline."""
    from ..background import Background

    controller = Background(
        "flotilla.cli.managed.pipeline",
        [str(pipeline_id)],
        log=home.controller_log(pipeline_id),
        cwd=home.dir(pipeline_id),
    )
    proc = controller.proc
    if not controller.wait_ready():
        from ..console import tail

        ends = tail(home.controller_log(pipeline_id), 15)
        raise FlotillaError(
            f"managed pipeline {pipeline_id}: its controller exited with status "
            f"{proc.returncode} before it started; its log ends with:\n{ends}"
        )


def revive(home: JobsHome, only: int | None = None) -> None:
    """Start a new controller for each unfinished pipeline whose controller is gone
    (killed, the machine rebooted): it resumes at the task that was running. ``only``:
    that pipeline alone. One process revives a pipeline at a time (a lock per pipeline)."""
    from ..._system import locks

    for rec in home.all():
        if not rec.is_pipeline or (only is not None and rec.id != only):
            continue
        if not rec.controller_gone() or not home.request(rec.id).exists():
            continue
        with locks.exclusive(home.dir(rec.id) / "revive.lock"):
            current = home.load(rec.id)
            if current is None or not current.controller_gone():
                continue  # another command revived it meanwhile
            say(
                f"managed pipeline {rec.id}: its controller (pid {rec.pid}) is gone; "
                "starting a new one, which resumes it"
            )
            try:
                _start_pipeline(home, rec.id)
            except FlotillaError as e:
                say(f"warning: {e}")


def start(
    home: JobsHome,
    job: JobSpec,
    spec: ProviderSpec,
    recovery: JobRecovery,
    volumes: Sequence[Volume] = (),
) -> ManagedJobRecord:
    """Record a managed job and start its controller; returns once the controller owns
    the job. The job's variables and secrets go through the controller's stdin only."""
    from ..background import Background
    from ..jobspec import task_id

    now = time.time()
    rec = home.create(_record(job, spec, recovery, volumes, now))
    with home.update(rec.id) as current:
        current.task_id = task_id(f"{rec.name}-{rec.id}", rec.id, now)
        rec = current
    controller = Background(
        "flotilla.cli.managed.controller",
        [str(rec.id)],
        log=home.controller_log(rec.id),
        cwd=home.dir(rec.id),
        stdin=json.dumps({"job": job.to_dict()}).encode(),
    )
    proc = controller.proc
    if not controller.wait_ready():
        with contextlib.suppress(FlotillaError, OSError), home.update(rec.id) as failed:
            failed.state = ManagedJobState.FAILED.value
            failed.error = f"its controller exited with status {proc.returncode} at start"
            failed.ended = time.time()
        from ..console import tail

        ends = tail(home.controller_log(rec.id), 15)
        raise FlotillaError(
            f"managed job {rec.id}: its controller exited with status {proc.returncode} "
            f"before it started; its log ends with:\n{ends}"
        )
    return home.load(rec.id) or rec


# -- following a job -------------------------------------------------------------------------
def follow(home: JobsHome, job_id: int, interrupt_hint: bool = False) -> int:
    """Print the job's log as it grows until the job ends; its exit status. Controller
    lines (``flotilla: ...``) go to stderr, the nodes' lines to stdout."""
    first = home.load(job_id)
    logs = [_Tail(home.log(job_id), b"")]
    if first is not None and first.is_pipeline:  # the pipeline's log and its tasks'
        parallel = first.execution == "parallel"
        for tid in first.tasks:
            task = home.load(tid)
            label = f"({task.name}) ".encode() if parallel and task is not None else b""
            logs.append(_Tail(home.log(tid), label))
    try:
        while True:
            rec = home.load(job_id)
            if rec is not None and rec.is_pipeline and rec.controller_gone():
                revive(home, rec.id)
                rec = home.load(job_id)
            ended = rec is None or rec.observed_state().finished
            for log in logs:
                log.read(ended)
            if ended:
                break
            time.sleep(_FOLLOW_POLL)
    except KeyboardInterrupt:
        if interrupt_hint:
            say(
                f"stopped following managed job {job_id}; it keeps running: "
                f"`flotilla jobs logs {job_id} --follow`, `flotilla jobs cancel {job_id}`"
            )
        return 130
    return _exit_status(home.load(job_id))


class _Tail:
    """A log file being followed: what was read of it, the unfinished last line."""

    def __init__(self, path: Path, label: bytes) -> None:
        self.path = path
        self.label = label
        self.offset = 0
        self.partial = b""

    def read(self, last: bool) -> None:
        """Print the lines added since the last read (``last``: the unfinished one too)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        if last and self.partial:
            lines.append(self.partial)
            self.partial = b""
        _print_lines(lines, self.label)


def _print_lines(lines: list[bytes], label: bytes = b"") -> None:
    for raw in lines:
        line = raw.decode("utf-8", errors="replace")
        if label and not line.startswith("flotilla: "):
            line = label.decode("utf-8", errors="replace") + line
        stream = sys.stderr if line.startswith("flotilla: ") else sys.stdout
        stream.write(line + "\n")
    sys.stdout.flush()
    sys.stderr.flush()


def _exit_status(rec: ManagedJobRecord | None) -> int:
    if rec is None:
        return 1
    state = rec.observed_state()
    if state is ManagedJobState.SUCCEEDED:
        return 0
    if state is ManagedJobState.CANCELLED:
        return 130
    if rec.controller_gone():
        say(f"managed job {rec.id}: its controller (pid {rec.pid}) exited unexpectedly")
    return rec.exit_code or 1


# -- queue, logs, cancel -----------------------------------------------------------------------
def cmd_jobs_queue(args: argparse.Namespace) -> int:
    from ..console import duration, table

    home = JobsHome()
    revive(home)
    if args.json:
        from ...server.api import managed_jobs

        return print_json({"jobs": managed_jobs()})
    records = home.all()
    if not records:
        print("no managed jobs (`flotilla jobs launch TASK` starts one)")
        return 0
    rows = [["ID", "NAME", "NODES", "SUBMITTED", "DURATION", "#RECOVERIES", "STATUS"]]
    notes: list[str] = []
    now = time.time()
    by_id = {r.id: r for r in records}
    ordered = [r for r in records if not r.pipeline or r.pipeline not in by_id]
    for r in list(ordered):  # each pipeline's tasks right under it
        if r.is_pipeline:
            at = ordered.index(r) + 1
            ordered[at:at] = [by_id[t] for t in r.tasks if t in by_id]
    for r in ordered:
        state = r.observed_state()
        end = r.ended or now
        if r.is_pipeline:
            name = f"{r.name} ({r.execution} pipeline, {len(r.tasks)} tasks)"
        elif r.pipeline:
            name = f"  {r.index + 1}/{r.name}"
        else:
            name = r.name
        rows.append(
            [
                str(r.id),
                name,
                str(r.num_nodes),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.submitted)),
                duration(end - r.started) if r.started else "-",
                str(r.recoveries),
                state.value,
            ]
        )
        if r.controller_gone():
            notes.append(f"{r.id}: its controller (pid {r.pid}) is gone")
        elif state is ManagedJobState.FAILED and r.error:
            notes.append(f"{r.id}: {r.error}")
    sys.stdout.write(table(rows))
    for note in notes:
        print(note)
    return 0


def cmd_jobs_logs(args: argparse.Namespace) -> int:
    home = JobsHome()
    rec = home.resolve(args.job)
    revive(home, rec.pipeline or rec.id)
    if args.follow:
        return follow(home, rec.id)
    paths = [home.log(rec.id)] + [home.log(t) for t in rec.tasks]
    if not any(p.exists() for p in paths):
        say(f"managed job {rec.id} has no output yet")
    for path in paths:
        with (
            contextlib.suppress(FileNotFoundError),
            open(path, encoding="utf-8", errors="replace") as f,
        ):
            for chunk in iter(lambda: f.read(1 << 16), ""):
                sys.stdout.write(chunk)
    sys.stdout.flush()
    return _exit_status(rec) if rec.observed_state().finished else 0


def cmd_jobs_cancel(args: argparse.Namespace) -> int:
    home = JobsHome()
    if args.all == bool(args.jobs):
        raise ConfigurationError("give the jobs to cancel (NAME or ID), or -a for every job")
    if args.all:  # a pipeline's tasks go with it
        targets = [r for r in home.all() if not r.observed_state().finished and not r.pipeline]
        if not targets:
            say("no managed job is running")
    else:
        targets = []
        for ref in args.jobs:
            rec = home.resolve(ref)
            if rec.pipeline:
                say(
                    f"job {rec.id} is task {rec.index + 1} of pipeline {rec.pipeline}: "
                    "cancelling the pipeline"
                )
                rec = home.load(rec.pipeline) or rec
            targets.append(rec)
    code = 0
    for rec in targets:
        code = max(code, cancel(home, rec))
    return code


def cancel(home: JobsHome, rec: ManagedJobRecord) -> int:
    """Cancel one job: its controller stops the job and tears its cluster down; a job
    whose controller is gone is cleaned up here."""
    state = rec.observed_state()
    if state.finished and not rec.controller_gone():
        say(f"managed job {rec.id} had already ended ({state.value})")
        return 0
    if rec.pid and procs.alive(rec.pid, rec.pid_start):
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec.pid, signal.SIGTERM)
        if not procs.wait_gone(rec.pid, rec.pid_start, _CANCEL_WAIT):
            say(f"managed job {rec.id}: its controller (pid {rec.pid}) does not stop")
            return 1
    final = home.load(rec.id) or rec
    if not ManagedJobState(final.state).finished:  # the controller was gone: clean up here
        for tid in final.tasks:  # a pipeline's tasks
            task = home.load(tid)
            if task is not None and not ManagedJobState(task.state).finished:
                if task.state != ManagedJobState.PENDING.value or task.pid:
                    reap_leftovers(home, task)
                with home.update(tid) as t:
                    t.state = ManagedJobState.CANCELLED.value
                    t.error = "cancelled (its pipeline's controller was gone)"
                    t.ended = time.time()
        if final.is_pipeline:
            with contextlib.suppress(OSError):
                os.unlink(home.request(final.id))
        else:
            reap_leftovers(home, final)
        with home.update(rec.id) as r:
            r.state = ManagedJobState.CANCELLED.value
            r.error = "cancelled (its controller was gone)"
            r.ended = time.time()
        final = home.load(rec.id) or final
    say(f"managed job {rec.id}: {final.state}")
    return 0


# -- the parser --------------------------------------------------------------------------------
def add_jobs_parser(sub: Any, job_flags: Any, provider_flags: Any) -> argparse.ArgumentParser:
    """Add ``jobs`` and its subcommands to the ``flotilla`` parser's ``sub``;
    ``job_flags(q)`` / ``provider_flags(q)`` add the flags ``launch`` has."""
    p: argparse.ArgumentParser = sub.add_parser(
        "jobs", help="managed jobs: run on their own cluster, recovered when nodes are lost"
    )
    jobs = p.add_subparsers(dest="jobs_command", required=True, metavar="SUBCOMMAND")

    q = jobs.add_parser("launch", help="run a task as a managed job")
    q.add_argument("task", help="a task file (SkyPilot YAML) or a shell command")
    q.add_argument("-n", "--name", help="the job's name (default: the task's)")
    q.add_argument("--nodes", type=int, help="nodes (default: the task's num_nodes, or 1)")
    job_flags(q)
    provider_flags(q)
    q.set_defaults(func=cmd_jobs_launch)

    q = jobs.add_parser("queue", help="every managed job: state, recoveries, durations")
    json_flag(q)
    q.set_defaults(func=cmd_jobs_queue)

    q = jobs.add_parser("logs", help="a managed job's output (every attempt's)")
    q.add_argument("job", metavar="NAME|ID")
    q.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    q.set_defaults(func=cmd_jobs_logs)

    q = jobs.add_parser("cancel", help="cancel managed jobs (their clusters are torn down)")
    q.add_argument("jobs", nargs="*", metavar="NAME|ID")
    q.add_argument("-a", "--all", action="store_true", help="every unfinished managed job")
    q.set_defaults(func=cmd_jobs_cancel)
    return p
