"""The ``flotilla`` command: run task files (SkyPilot format) on named multi-node clusters.

    flotilla launch task.yaml -c dev --nodes 3     start cluster dev, sync, setup, run
    flotilla exec dev task.yaml | 'CMD'            sync the workdir and run (no setup)
    flotilla status                                clusters: provider, nodes, state, age, idle
    flotilla queue dev                             the cluster's jobs
    flotilla logs dev [JOB] [--follow] [--node K]  a job's output, kept per node
    flotilla cancel dev JOB                        stop a job on every node
    flotilla ssh dev [--node K] [CMD]              a shell in a node's working directory
    flotilla down dev                              stop everything, remove the cluster

Commands that only talk to a running cluster import nothing heavy (no asyncio, no pool
machinery): the cluster daemon (``_cluster``) does the work and streams the output back.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NoReturn

from .._errors import ConfigurationError, FlotillaError
from .ipc import Event, prefix
from .jobspec import JobSpec
from .state import (
    ClusterRecord,
    ClusterState,
    JobStatus,
    Paths,
    all_names,
    load,
    locked,
    process_alive,
    process_start,
    save,
    wait_gone,
)

if TYPE_CHECKING:
    import socket

    from .backends.registry import ProviderSpec
    from .taskfile import Task

_START_TIMEOUT = 120.0  # seconds to wait for another command's daemon to listen


class CLIError(FlotillaError):
    """A command that cannot go on; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# -- output ----------------------------------------------------------------------------------
def _say(text: str) -> None:
    sys.stderr.write(f"flotilla: {text}\n")
    sys.stderr.flush()


def _show(events: Iterable[Event], raw: bool = False, quiet_end: bool = False) -> int | None:
    """Print a job's events as they come; the job's exit status (None: the daemon no
    longer has the job). Node lines carry their node unless ``raw`` (one node's log)."""
    out, err = sys.stdout, sys.stderr
    for ev in events:
        kind = ev["ev"]
        if kind == "out":
            line = ev["line"] if raw else prefix(ev["node"], ev["rank"]) + ev["line"]
            stream = out if ev["stream"] == 1 else err
            stream.write(line + "\n")
            stream.flush()
        elif kind == "log":
            out.write(ev["line"] + "\n")
            out.flush()
        elif kind == "phase":
            if not raw:
                _say(ev["text"])
        elif kind == "end":
            out.flush()
            _report(ev, quiet_end)
            code = ev.get("exit_code")
            return int(code) if code is not None else 1
        elif kind == "gone":
            return None
        elif kind == "error":
            raise CLIError(ev["message"])
    raise CLIError("the cluster daemon went away before the job ended (see `flotilla status`)")


def _report(ev: Event, quiet: bool) -> None:
    """The end of a job: root cause first for a failure."""
    report: list[str] = ev.get("report") or []
    if ev["status"] == JobStatus.SUCCEEDED.value:
        if not quiet:
            _say(f"job {ev['job']} succeeded ({ev.get('elapsed', 0):.2f} s)")
        return
    if report:
        sys.stderr.write(f"flotilla: {report[0]}\n")
        sys.stderr.write("".join(f"  {line}\n" for line in report[1:]))
    else:
        sys.stderr.write(f"flotilla: job {ev['job']} {ev['status']}\n")
    sys.stderr.flush()


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n" for r in rows
    )


def _duration(seconds: float) -> str:
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


# -- clusters --------------------------------------------------------------------------------
def _record(paths: Paths) -> ClusterRecord:
    rec = load(paths)
    if rec is None:
        raise CLIError(
            f"there is no cluster {paths.name!r} (see `flotilla status`; "
            f"`flotilla launch -c {paths.name} TASK` starts one)"
        )
    return rec


def _running(paths: Paths) -> ClusterRecord:
    """The record of a cluster whose daemon runs, or a CLIError saying what it is instead."""
    rec = _record(paths)
    state = rec.observed_state()
    if state is ClusterState.STALE:
        raise CLIError(
            f"cluster {paths.name}: its daemon (pid {rec.pid}) is gone, so the cluster is "
            f"stale; `flotilla down {paths.name}` cleans it up"
        )
    if state in (ClusterState.STOPPED, ClusterState.FAILED):
        why = f" ({rec.error})" if rec.error else ""
        raise CLIError(
            f"cluster {paths.name} is {state.value}{why}: "
            f"`flotilla launch -c {paths.name} TASK` starts it again"
        )
    return rec


def _connect(paths: Paths, rec: ClusterRecord, timeout: float = _START_TIMEOUT) -> socket.socket:
    """A connection to the cluster's daemon, waiting while it starts."""
    from .ipc import connect

    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            return connect(paths.socket)
        except OSError as e:
            if not process_alive(rec.pid, rec.pid_start):
                raise CLIError(
                    f"cluster {paths.name}: its daemon (pid {rec.pid}) is gone; "
                    f"`flotilla down {paths.name}` cleans it up"
                ) from None
            if time.monotonic() >= deadline:
                raise CLIError(f"cluster {paths.name}: its daemon does not answer ({e})") from None
            time.sleep(delay)  # it is starting: it listens within moments
            delay = min(delay * 2, 0.1)


def _submit(paths: Paths, rec: ClusterRecord, spec: JobSpec, detach: bool) -> int:
    """Send a job to the cluster's daemon; follow it unless ``detach``."""
    from .ipc import encode, events

    sock = _connect(paths, rec)
    with sock:
        sock.sendall(encode({"op": "submit", "job": spec.to_dict(), "attach": not detach}))
        stream = events(sock)
        first = next(stream, None)
        if first is None or first["ev"] != "accepted":
            message = first["message"] if first else "the cluster daemon closed the connection"
            raise CLIError(f"cluster {paths.name}: {message}")
        job = first["job"]
        if first.get("ahead"):
            _say(f"job {job} queued behind {first['ahead']} job(s) on {paths.name}")
        if detach:
            _say(
                f"job {job} submitted to {paths.name} (task id {first['task_id']}); "
                f"follow it with `flotilla logs {paths.name} {job} --follow`"
            )
            return 0
        try:
            code = _show(stream)
        except KeyboardInterrupt:
            _say(
                f"stopped following job {job}; it keeps running: "
                f"`flotilla logs {paths.name} {job} --follow`, `flotilla cancel {paths.name} {job}`"
            )
            return 130
    return 0 if code is None else code


# -- launch ----------------------------------------------------------------------------------
def _task_from(arg: str, nodes: int | None, envs: list[str], secrets: list[str]) -> Task:
    from .taskfile import command_task, load_task

    if os.path.isfile(arg) or arg.endswith((".yaml", ".yml")):
        task = load_task(arg)
    else:
        task = command_task(arg, nodes)
    return task.with_overrides(_pairs(envs, "--env"), _pairs(secrets, "--secret"))


def _pairs(items: list[str], flag: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not key:
            raise ConfigurationError(f"{flag} {item!r}: expected NAME=VALUE")
        out[key] = value if eq else None
    return out


def _provider_spec(args: argparse.Namespace) -> ProviderSpec | None:
    """The provider the flags ask for; None when they ask for nothing in particular."""
    from .backends.registry import ProviderSpec

    given = args.provider is not None or args.hosts
    if not given:
        return None
    hosts = tuple(h.strip() for h in (args.hosts or "").split(",") if h.strip())
    return ProviderSpec(
        kind=args.provider or ("ssh" if hosts else "local"),
        hosts=hosts,
        user=args.ssh_user,
        key=os.path.abspath(args.ssh_key) if args.ssh_key else None,
        known_hosts=os.path.abspath(args.known_hosts) if args.known_hosts else None,
        accept_new_host_keys=args.accept_new_host_keys,
        python=args.ssh_python,
        workdir=args.ssh_workdir,
    )


def _job_spec(
    task: Task, nodes: int, do_setup: bool, mounts: bool, down: bool, retries: int
) -> JobSpec:
    if retries < 0:
        raise ConfigurationError(f"--retries must be 0 or more, got {retries}")
    return JobSpec(
        name=task.name or "job",
        run=task.run,
        setup=task.setup,
        num_nodes=nodes,
        envs={k: v for k, v in task.envs.items() if v is not None},
        secrets={k: v for k, v in task.secrets.items() if v is not None},
        workdir=task.workdir,
        file_mounts=dict(task.file_mounts) if mounts else {},
        gpus_per_node=task.resources.gpus_per_node,
        do_setup=do_setup,
        down_after=down,
        retries=retries,
    )


def cmd_launch(args: argparse.Namespace) -> int:
    from .backends.registry import ProviderSpec, check_task

    task = _task_from(args.task, None, args.env, args.secret)
    if args.nodes is not None and args.nodes < 1:
        raise ConfigurationError(f"--nodes must be at least 1, got {args.nodes}")
    if args.idle_minutes is not None and args.idle_minutes <= 0:
        raise ConfigurationError(f"--idle-minutes must be positive, got {args.idle_minutes}")
    name = args.cluster or f"flotilla-{os.urandom(2).hex()}"
    paths = Paths(name)
    wanted = _provider_spec(args)
    existing = load(paths)
    state = existing.observed_state() if existing else None
    if existing is not None and state is ClusterState.STALE:
        _running(paths)  # raises, saying so
    reuse = existing is not None and state in (ClusterState.UP, ClusterState.STARTING)
    if existing is not None and reuse:
        spec = ProviderSpec.from_dict(existing.provider)
        if wanted is not None and wanted != spec:
            raise CLIError(
                f"cluster {name} runs on {spec.kind} {', '.join(spec.hosts)}; "
                f"`flotilla down {name}` first to change its provider"
            )
        if args.nodes is not None and args.nodes != existing.num_nodes:
            raise CLIError(
                f"cluster {name} has {existing.num_nodes} node(s), not {args.nodes}: "
                f"`flotilla down {name}` first, or launch on another cluster name"
            )
        cluster_nodes = existing.num_nodes
    else:
        spec = wanted or ProviderSpec()
        cluster_nodes = args.nodes or task.num_nodes or 1
    job_nodes = task.job_nodes(cluster_nodes)
    for warning in check_task(task, spec, cluster_nodes):
        _say(f"warning: {warning}")
    job = _job_spec(task, job_nodes, not args.no_setup, True, args.down, args.retries)
    if not reuse:
        if args.down and not args.detach:
            return _launch_here(paths, existing, spec, cluster_nodes, args, job)
        existing = _start_daemon(paths, existing, spec, cluster_nodes, args.idle_minutes)
        _say(f"cluster {name}: {cluster_nodes} {spec.kind} node(s) starting")
    assert existing is not None
    return _submit(paths, existing, job, args.detach)


def _new_record(
    paths: Paths,
    old: ClusterRecord | None,
    spec: ProviderSpec,
    nodes: int,
    idle: float | None,
    pid: int,
) -> ClusterRecord:
    now = time.time()
    rec = ClusterRecord(
        name=paths.name,
        provider=spec.to_dict(),
        num_nodes=nodes,
        created=now,
        last_activity=now,
        pid=pid,
        pid_start=process_start(pid) if pid else 0,
        idle_minutes=idle,
    )
    if old is not None:  # a stopped cluster started again keeps its job history
        rec.jobs, rec.next_job = old.jobs, old.next_job
    return rec


def _start_daemon(
    paths: Paths, old: ClusterRecord | None, spec: ProviderSpec, nodes: int, idle: float | None
) -> ClusterRecord:
    """Create the record and start the cluster's daemon; returns once it listens. When
    another command is starting the same cluster, use its daemon."""
    import subprocess

    with locked(paths):
        current = load(paths)
        if current is not None and current.observed_state() in (
            ClusterState.UP,
            ClusterState.STARTING,
        ):
            return current  # another command won the race
        paths.ensure()
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        env.pop("COMPUTE_POOL", None)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        )
        with open(paths.daemon_log, "ab") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "flotilla.cli.daemon",
                    paths.name,
                    "--ready-fd",
                    str(write_fd),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(write_fd,),
                start_new_session=True,
                cwd=paths.dir,
                env=env,
            )
        os.close(write_fd)
        rec = _new_record(paths, current, spec, nodes, idle, proc.pid)
        save(paths, rec)
    try:
        ready = os.read(read_fd, 1)
    finally:
        os.close(read_fd)
    if not ready:
        proc.wait()
        tail = _tail(paths.daemon_log, 15)
        with contextlib.suppress(FlotillaError), locked(paths):
            failed = load(paths)
            if failed is not None and failed.pid == proc.pid:
                failed.state = ClusterState.FAILED.value
                failed.error = f"its daemon exited with status {proc.returncode}"
                save(paths, failed)
        raise CLIError(
            f"cluster {paths.name}: the daemon exited with status {proc.returncode} before "
            f"it was ready; its log ({paths.daemon_log}) ends with:\n{tail}"
        )
    proc.returncode = 0  # it lives on in its own session: no ResourceWarning about it
    return rec


def _tail(path: Any, lines: int) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _launch_here(
    paths: Paths,
    old: ClusterRecord | None,
    spec: ProviderSpec,
    nodes: int,
    args: argparse.Namespace,
    job: JobSpec,
) -> int:
    """``launch --down`` of a new cluster: the daemon runs inside this process, for the
    job's duration (other commands see and reach it as usual)."""
    from .daemon import ClusterDaemon, follow_local

    with locked(paths):
        current = load(paths)
        if current is not None and current.observed_state() in (
            ClusterState.UP,
            ClusterState.STARTING,
        ):
            return _submit(paths, current, job, detach=False)
        save(paths, _new_record(paths, current, spec, nodes, args.idle_minutes, os.getpid()))
    daemon = ClusterDaemon(paths)

    def interrupt(*_: object) -> NoReturn:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    serving = threading.Thread(target=daemon.serve_forever, name="flotilla-serve", daemon=True)
    try:
        daemon.start()
        serving.start()  # stop requests (`flotilla down`, the job's end) are handled there
        submitted = daemon.submit(job)
        return _show(follow_local(submitted)) or 0
    except KeyboardInterrupt:
        _say(f"interrupted: stopping cluster {paths.name}")
        return 130
    finally:
        daemon.request_stop(delete_record=True)
        if serving.is_alive():
            serving.join()
        daemon.shutdown()  # when it never started serving; otherwise a no-op
        signal.signal(signal.SIGTERM, previous)


# -- the other commands ----------------------------------------------------------------------
def cmd_exec(args: argparse.Namespace) -> int:
    paths = Paths(args.cluster)
    rec = _running(paths)
    task = _task_from(args.task, args.nodes, args.env, args.secret)
    nodes = args.nodes or task.num_nodes or rec.num_nodes
    if nodes > rec.num_nodes:
        raise CLIError(
            f"the job needs {nodes} node(s) but cluster {paths.name} has {rec.num_nodes}",
            code=2,
        )
    if task.resources.gpus_per_node:
        from .backends.registry import ProviderSpec, check_task

        for warning in check_task(task, ProviderSpec.from_dict(rec.provider), rec.num_nodes):
            _say(f"warning: {warning}")
    job = _job_spec(task, nodes, False, False, False, args.retries)
    return _submit(paths, rec, job, args.detach)


def cmd_status(args: argparse.Namespace) -> int:
    names = args.clusters or all_names()
    rows = [["NAME", "PROVIDER", "NODES", "STATE", "AGE", "IDLE"]]
    notes: list[str] = []
    now = time.time()
    for name in names:
        rec = load(Paths(name))
        if rec is None:
            notes.append(f"{name}: no such cluster")
            continue
        state = rec.observed_state()
        busy = any(not JobStatus(j.status).finished for j in rec.jobs)
        idle = "-" if busy or state is not ClusterState.UP else _duration(now - rec.last_activity)
        rows.append(
            [
                name,
                str(rec.provider.get("kind", "?")),
                str(rec.num_nodes),
                state.value,
                _duration(now - rec.created),
                idle,
            ]
        )
        if state is ClusterState.STALE:
            notes.append(
                f"{name}: its daemon (pid {rec.pid}) is gone; `flotilla down {name}` cleans up"
            )
        elif rec.error:
            notes.append(f"{name}: {rec.error}")
    if len(rows) == 1 and not notes:
        print("no clusters (`flotilla launch TASK -c NAME` starts one)")
        return 0
    sys.stdout.write(_table(rows))
    for note in notes:
        print(note)
    return 0


def cmd_queue(args: argparse.Namespace) -> int:
    rec = _record(Paths(args.cluster))
    rows = [["ID", "NAME", "STATUS", "NODES", "SUBMITTED", "DURATION", "EXIT"]]
    now = time.time()
    for j in rec.jobs:
        end = j.ended or now
        rows.append(
            [
                str(j.id),
                j.name,
                j.status,
                str(j.num_nodes or rec.num_nodes),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.submitted)),
                _duration(end - j.started) if j.started else "-",
                "" if j.exit_code is None else str(j.exit_code),
            ]
        )
    sys.stdout.write(_table(rows))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    paths = Paths(args.cluster)
    rec = _record(paths)
    if not rec.jobs:
        raise CLIError(f"cluster {paths.name} has no jobs yet")
    job_id = args.job if args.job is not None else rec.jobs[-1].id
    job = rec.job(job_id)
    if job is None:
        raise CLIError(f"cluster {paths.name} has no job {job_id} (see `flotilla queue`)")
    if args.node is not None and not 0 <= args.node < rec.num_nodes:
        raise CLIError(f"cluster {paths.name} has nodes 0 to {rec.num_nodes - 1}", code=2)
    live = not JobStatus(job.status).finished and rec.observed_state() in (
        ClusterState.UP,
        ClusterState.STARTING,
    )
    if args.follow and live:
        from .ipc import encode, events

        with _connect(paths, rec) as sock:
            sock.sendall(encode({"op": "follow", "job": job_id, "node": args.node}))
            try:
                code = _show(events(sock), raw=args.node is not None, quiet_end=True)
            except KeyboardInterrupt:
                return 130
        if code is not None:
            return code
        rec = _record(paths)  # it ended meanwhile: show the file
    name = "job.log" if args.node is None else f"node-{args.node}.log"
    path = paths.job_dir(job_id) / name
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for chunk in iter(lambda: f.read(1 << 16), ""):
                sys.stdout.write(chunk)
    except FileNotFoundError:
        if args.node is None:
            _say(f"job {job_id} has no output yet")
    sys.stdout.flush()
    final = rec.job(job_id)
    if final is not None and JobStatus(final.status).finished:
        return 0 if final.status == JobStatus.SUCCEEDED.value else (final.exit_code or 1)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from .ipc import encode, events

    paths = Paths(args.cluster)
    rec = _running(paths)
    code = 0
    for job_id in args.jobs:
        job = rec.job(job_id)
        if job is None:
            _say(f"cluster {paths.name} has no job {job_id}")
            code = 1
            continue
        with _connect(paths, rec) as sock:
            sock.sendall(encode({"op": "cancel", "job": job_id}))
            answer = next(events(sock), {"ev": "error", "message": "no answer"})
        if answer["ev"] == "error":
            raise CLIError(answer["message"])
        if answer["ev"] == "gone" or JobStatus(answer.get("was", "PENDING")).finished:
            status = answer.get("status") or job.status
            _say(f"job {job_id} had already ended ({status})")
        else:
            _say(f"job {job_id}: {answer['status']}")
    return code


def cmd_down(args: argparse.Namespace) -> int:
    from .ipc import request
    from .state import delete

    code = 0
    for name in args.clusters:
        paths = Paths(name)
        rec = load(paths)
        if rec is None:
            _say(f"there is no cluster {name!r}")
            code = 1
            continue
        state = rec.observed_state()
        if state.needs_daemon:
            try:
                answers = list(request(paths.socket, {"op": "down"}))
            except OSError:
                answers = []
            if not any(a["ev"] == "down" for a in answers) and process_alive(
                rec.pid, rec.pid_start
            ):
                os.kill(rec.pid, signal.SIGTERM)
            if not wait_gone(rec.pid, rec.pid_start, 60.0):
                raise CLIError(f"cluster {name}: its daemon (pid {rec.pid}) does not stop")
        elif state is ClusterState.STALE:
            _say(f"cluster {name}: its daemon (pid {rec.pid}) was gone; cleaning up")
        if rec.provider.get("kind") == "local":
            _kill_leftovers(paths, rec.token)
        delete(paths)
        _say(f"cluster {name}: down")
    return code


def _kill_leftovers(paths: Paths, token: str) -> None:
    """Kill what a local cluster may have left running: its jobs' processes (found by
    their FLOTILLA_RUN_TOKEN) and anything in its nodes' working directories."""
    if token:
        from .node_ops import reap

        reap.local(f"{token}.")
    root = str(paths.nodes.resolve())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd").removesuffix(" (deleted)")
        except OSError:
            continue
        if cwd == root or cwd.startswith(root + os.sep):
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)


def cmd_ssh(args: argparse.Namespace) -> int:
    import shlex

    from .jobspec import phase_env

    paths = Paths(args.cluster)
    rec = _running(paths)
    if not rec.nodes:
        raise CLIError(f"cluster {paths.name} is still starting")
    if not 0 <= args.node < len(rec.nodes):
        raise CLIError(f"cluster {paths.name} has nodes 0 to {len(rec.nodes) - 1}", code=2)
    node = rec.nodes[args.node]
    command = " ".join(args.remote)
    kind = str(rec.provider.get("kind"))
    if kind == "local":
        common, per_node = phase_env(
            cluster=paths.name,
            provider=kind,
            cluster_ips=[n.ip for n in rec.nodes],
            job_nodes=len(rec.nodes),
            job_id=0,
            task="",
            gpus_per_node=node.gpus,
            master_port=0,
            setup=False,
        )
        env = dict(os.environ)
        env.pop("COMPUTE_POOL", None)
        skip = {"MASTER_PORT", "FLOTILLA_JOB_ID", "FLOTILLA_TASK_ID", "SKYPILOT_TASK_ID"}
        env.update({k: v for k, v in {**common, **per_node[args.node]}.items() if k not in skip})
        os.chdir(node.workdir)
        argv = ["bash", "-c", command] if command else ["bash", "-i"]
        sys.stdout.flush()
        os.execvpe("bash", argv, env)
    alias = paths.name if args.node == 0 else f"{paths.name}-worker{args.node}"
    remote = f"cd {shlex.quote(node.workdir)} && " + (command or "exec ${SHELL:-bash} -l")
    tty = ["-t"] if not command and sys.stdin.isatty() else []
    _say(f"ssh config: {paths.ssh_config} (add `Include {paths.ssh_config}` to ~/.ssh/config)")
    os.execvp("ssh", ["ssh", "-F", str(paths.ssh_config), *tty, alias, remote])


# -- the parser ------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flotilla",
        description="Run task files (SkyPilot format) on multi-node clusters.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def job_flags(q: argparse.ArgumentParser) -> None:
        q.add_argument(
            "--env", action="append", default=[], metavar="K=V", help="set or override a variable"
        )
        q.add_argument(
            "--secret",
            action="append",
            default=[],
            metavar="K=V",
            help="a secret variable: never logged or written to disk (K alone: from here)",
        )
        q.add_argument(
            "-d", "--detach", action="store_true", help="submit and return; do not follow"
        )
        q.add_argument(
            "--retries",
            type=int,
            default=0,
            help="run a failed `run` again up to this many times (same task id)",
        )

    def provider_flags(q: argparse.ArgumentParser) -> None:
        q.add_argument(
            "--provider", choices=("local", "ssh"), help="where nodes run (default: local)"
        )
        q.add_argument("--hosts", help="ssh: user@host[:port],... one per node, head first")
        q.add_argument("--ssh-user", help="ssh: default login user")
        q.add_argument("--ssh-key", help="ssh: private key file")
        q.add_argument("--known-hosts", help="ssh: known_hosts file to check host keys against")
        q.add_argument(
            "--accept-new-host-keys",
            action="store_true",
            help="ssh: trust hosts seen the first time",
        )
        q.add_argument("--ssh-python", help="ssh: the hosts' Python interpreter")
        q.add_argument("--ssh-workdir", help="ssh: flotilla's folder on the hosts (~/.flotilla)")

    q = sub.add_parser("launch", help="start a cluster (if needed), sync, set up and run a task")
    q.add_argument("task", help="a task file (SkyPilot YAML) or a shell command")
    q.add_argument("-c", "--cluster", help="cluster name (default: a new one)")
    q.add_argument("--nodes", type=int, help="cluster size (default: the task's num_nodes)")
    provider_flags(q)
    q.add_argument("--no-setup", action="store_true", help="skip the task's setup")
    q.add_argument("--down", action="store_true", help="remove the cluster when the job ends")
    q.add_argument(
        "--idle-minutes", type=float, help="stop the cluster after this long without jobs"
    )
    job_flags(q)
    q.set_defaults(func=cmd_launch)

    q = sub.add_parser("exec", help="sync the workdir and run a task or command (no setup)")
    q.add_argument("cluster")
    q.add_argument("task", help="a task file or a shell command")
    q.add_argument("--nodes", type=int, help="nodes to run on (default: the task's, or all)")
    job_flags(q)
    q.set_defaults(func=cmd_exec)

    q = sub.add_parser("status", help="the clusters: provider, nodes, state, age, idle time")
    q.add_argument("clusters", nargs="*")
    q.set_defaults(func=cmd_status)

    q = sub.add_parser("queue", help="a cluster's jobs")
    q.add_argument("cluster")
    q.set_defaults(func=cmd_queue)

    q = sub.add_parser("logs", help="a job's output (default: the latest job)")
    q.add_argument("cluster")
    q.add_argument("job", nargs="?", type=int)
    q.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    q.add_argument("--node", type=int, help="only this node's output")
    q.set_defaults(func=cmd_logs)

    q = sub.add_parser("cancel", help="stop jobs on every node")
    q.add_argument("cluster")
    q.add_argument("jobs", nargs="+", type=int)
    q.set_defaults(func=cmd_cancel)

    q = sub.add_parser("down", help="stop clusters and remove them (logs included)")
    q.add_argument("clusters", nargs="+")
    q.set_defaults(func=cmd_down)

    q = sub.add_parser("ssh", help="a shell (or a command) on a node, in its working directory")
    q.add_argument("cluster")
    q.add_argument("--node", type=int, default=0)
    q.add_argument("remote", nargs="*", metavar="CMD", help="a command instead of a shell")
    q.set_defaults(func=cmd_ssh)

    from .managed.commands import add_jobs_parser

    add_jobs_parser(sub, job_flags, provider_flags)
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``flotilla`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    after: list[str] = []
    if "--" in argv:  # `flotilla ssh NAME --node 1 -- CMD ARGS`: CMD is not parsed
        cut = argv.index("--")
        argv, after = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    if after:
        if args.command != "ssh":
            _parser().error("`--` is only for `flotilla ssh NAME -- CMD`")
        args.remote = [*args.remote, *after]
    try:
        return int(args.func(args))
    except CLIError as e:
        _say(f"error: {e}")
        return e.code
    except ConfigurationError as e:
        _say(f"error: {e}")
        return 2
    except FlotillaError as e:
        _say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
