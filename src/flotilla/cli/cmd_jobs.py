"""A cluster's jobs: ``flotilla queue``, ``flotilla logs``, ``flotilla cancel``."""

from __future__ import annotations

import argparse
import sys
import time

from .._errors import ConfigurationError
from .clusters import connect, record, running
from .console import CLIError, duration, print_json, say, show, table
from .conventions import EXIT_FLOTILLA, confirm
from .state import ClusterState, JobStatus, Paths


def cmd_queue(args: argparse.Namespace) -> int:
    rec = record(Paths(args.cluster))
    if args.json:
        from ..server.api import job_data

        jobs = [job_data(j) for j in rec.observed_jobs()]
        return print_json({"cluster": args.cluster, "jobs": jobs})
    rows = [["ID", "NAME", "STATUS", "NODES", "SUBMITTED", "DURATION", "EXIT", "RESOURCES"]]
    now = time.time()
    for j in rec.observed_jobs():  # LOST when the daemon is gone
        end = j.ended or now
        rows.append(
            [
                str(j.id),
                j.name,
                j.status,
                str(j.num_nodes or rec.num_nodes),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.submitted)),
                duration(end - j.started) if j.started else "-",
                "" if j.exit_code is None else str(j.exit_code),
                j.resources or "-",
            ]
        )
    sys.stdout.write(table(rows))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    paths = Paths(args.cluster)
    rec = record(paths)
    if not rec.jobs:
        raise CLIError(f"cluster {paths.name} has no jobs yet")
    job_id = args.job if args.job is not None else rec.jobs[-1].id
    job = rec.job(job_id)
    if job is None:
        raise CLIError(f"cluster {paths.name} has no job {job_id} (see `flotilla queue`)")
    if args.node is not None and not 0 <= args.node < rec.num_nodes:
        raise CLIError(f"cluster {paths.name} has nodes 0 to {rec.num_nodes - 1}", code=2)
    if getattr(args, "export", None):  # --export jsonl|md FILE
        fmt, target = args.export
        if fmt not in ("jsonl", "md"):
            raise CLIError(f"--export {fmt}: the formats are jsonl and md (--export md FILE)", 2)
        from .observe import export

        return export(paths, job_id, fmt, target)
    live = not JobStatus(job.status).finished and rec.observed_state() in (
        ClusterState.UP,
        ClusterState.STARTING,
    )
    if args.follow and live:
        from .ipc import encode, events

        with connect(paths, rec) as sock:
            sock.sendall(encode({"op": "follow", "job": job_id, "node": args.node}))
            try:
                code = show(events(sock), raw=args.node is not None, quiet_end=True)
            except KeyboardInterrupt:
                return 130
        if code is not None:
            return code
        rec = record(paths)  # it ended meanwhile: show the file
    name = "job.log" if args.node is None else f"node-{args.node}.log"
    path = paths.job_dir(job_id) / name
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for chunk in iter(lambda: f.read(1 << 16), ""):
                sys.stdout.write(chunk)
    except FileNotFoundError:
        if args.node is None:
            say(f"job {job_id} has no output yet")
    sys.stdout.flush()
    final = rec.job(job_id)
    if final is not None and JobStatus(final.status).finished:
        return 0 if final.status == JobStatus.SUCCEEDED.value else (final.exit_code or 1)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from .ipc import encode, events

    paths = Paths(args.cluster)
    rec = running(paths)
    code = 0
    ids: list[int] = args.jobs
    if args.all:
        if ids:
            raise ConfigurationError("give job ids or -a/--all, not both")
        ids = [j.id for j in rec.jobs if not JobStatus(j.status).finished]
        if not ids:
            say(f"cluster {paths.name} has no job to cancel")
            return 0
        if not confirm(f"cancel job(s) {', '.join(map(str, ids))} on {paths.name}?", args.yes):
            raise CLIError("nothing was cancelled")
    elif not ids:
        raise ConfigurationError(
            f"which jobs? `flotilla cancel {paths.name} JOB...`, or -a for every unfinished job"
        )
    for job_id in ids:
        job = rec.job(job_id)
        if job is None:
            say(f"cluster {paths.name} has no job {job_id}")
            code = EXIT_FLOTILLA
            continue
        with connect(paths, rec) as sock:
            sock.sendall(encode({"op": "cancel", "job": job_id}))
            answer = next(events(sock), {"ev": "error", "message": "no answer"})
        if answer["ev"] == "error":
            raise CLIError(answer["message"])
        if answer["ev"] == "gone" or JobStatus(answer.get("was", "PENDING")).finished:
            status = answer.get("status") or job.status
            say(f"job {job_id} had already ended ({status})")
        else:
            say(f"job {job_id}: {answer['status']}")
    return code
