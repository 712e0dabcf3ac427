"""Reaching a named cluster's daemon from a command: its record and state, starting the
daemon (``launch``), connecting to it, submitting a job and following it.

Nothing heavy is imported here: the daemon itself (``daemon``) is imported only by
``launch --down``, which runs it in this process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from .._errors import FlotillaError
from .._system import procs
from .._volume import Volume
from .console import CLIError, say, show, tail
from .conventions import EXIT_LOST, EXIT_PROVISION
from .jobspec import JobSpec
from .state import ClusterRecord, ClusterState, Paths, load, locked_generation, save, update

if TYPE_CHECKING:
    import socket

    from .backends.base import ProviderSpec

DAEMON_MODULE = "flotilla.cli.daemon"
"""What ``python -m`` runs as a cluster's daemon (see ``daemon.main``)."""
START_TIMEOUT = 120.0  # seconds to wait for another command's daemon to listen


def record(paths: Paths) -> ClusterRecord:
    rec = load(paths)
    if rec is None:
        raise CLIError(
            f"there is no cluster {paths.name!r} (see `flotilla status`; "
            f"`flotilla launch -c {paths.name} TASK` starts one)"
        )
    return rec


def running(paths: Paths) -> ClusterRecord:
    """The record of a cluster whose daemon runs, or a CLIError saying what it is instead.
    A stale cluster whose nodes may still run is re-attached to first (:func:`reattach`)."""
    rec = record(paths)
    state = rec.observed_state()
    if state is ClusterState.STALE:
        from .adopt import adoptable

        if adoptable(rec):
            return reattach(paths, rec)
        raise CLIError(
            f"cluster {paths.name}: its daemon (pid {rec.pid}) is gone, so the cluster is "
            f"stale; `flotilla down {paths.name}` cleans it up"
        )
    if state in (ClusterState.STOPPED, ClusterState.FAILED):
        why = f" ({rec.error})" if rec.error else ""
        raise CLIError(
            f"cluster {paths.name} is {state.value}{why}: "
            f"`flotilla start {paths.name}` or `flotilla launch -c {paths.name} TASK` starts "
            "it again"
        )
    return rec


def reattach(paths: Paths, rec: ClusterRecord) -> ClusterRecord:
    """Start a new daemon for a stale cluster, which re-attaches to its running nodes and
    jobs (see ``adopt``); its record once UP, or a CLIError saying why not (the nodes that
    are gone)."""
    from .._volume import Volume
    from .backends import registry

    say(f"cluster {paths.name}: its daemon (pid {rec.pid}) is gone; re-attaching to its nodes")
    spec = registry.spec_from_dict(rec.provider)
    volumes = [Volume(**v) for v in rec.volumes]
    start_daemon(
        paths, rec, spec, rec.num_nodes, rec.idle_minutes, volumes, rec.autodown, rec.engines
    )
    try:
        return wait_up(paths)
    except CLIError as e:
        raise CLIError(f"{e}; `flotilla down {paths.name}` removes it", code=e.code) from None


def reattach_stale() -> list[str]:
    """Re-attach to every stale cluster whose nodes may still run (``flotilla server`` as
    it starts); the names of those it re-attached to (why not, for the others: said)."""
    from .adopt import adoptable
    from .state import all_names

    done = []
    for name in all_names():
        paths = Paths(name)
        try:
            rec = load(paths)
            if rec is None or rec.observed_state() is not ClusterState.STALE or not adoptable(rec):
                continue
            reattach(paths, rec)
        except FlotillaError as e:  # (CLIError too) the others are still tried
            say(f"cluster {name}: {e}")
            continue
        done.append(name)
    return done


def wait_up(paths: Paths) -> ClusterRecord:
    """The record once the cluster's (new) daemon has it UP; a CLIError when it did not
    start."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        now = load(paths)
        current = now.observed_state() if now is not None else ClusterState.FAILED
        if current is ClusterState.UP and now is not None:
            return now
        if current is not ClusterState.STARTING or time.monotonic() > deadline:
            why = f": {now.error}" if now is not None and now.error else ""
            raise CLIError(f"cluster {paths.name} did not start ({current.value}){why}")
        time.sleep(0.1)


def connect(paths: Paths, rec: ClusterRecord, timeout: float = START_TIMEOUT) -> socket.socket:
    """A connection to the cluster's daemon, waiting while it starts."""
    from .ipc import connect as ipc_connect

    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            return ipc_connect(paths.socket)
        except OSError as e:
            if not procs.alive(rec.pid, rec.pid_start):
                raise CLIError(
                    f"cluster {paths.name}: its daemon (pid {rec.pid}) is gone; "
                    f"`flotilla down {paths.name}` cleans it up",
                    code=EXIT_LOST,
                ) from None
            if time.monotonic() >= deadline:
                raise CLIError(
                    f"cluster {paths.name}: its daemon does not answer ({e})", code=EXIT_LOST
                ) from None
            time.sleep(delay)  # it is starting: it listens within moments
            delay = min(delay * 2, 0.1)


def submit(paths: Paths, rec: ClusterRecord, spec: JobSpec, detach: bool) -> int:
    """Send a job to the cluster's daemon; follow it unless ``detach``."""
    from .ipc import encode, events

    sock = connect(paths, rec)
    with sock:
        sock.sendall(encode({"op": "submit", "job": spec.to_dict(), "attach": not detach}))
        stream = events(sock)
        first = next(stream, None)
        if first is None or first["ev"] != "accepted":
            message = first["message"] if first else "the cluster daemon closed the connection"
            raise CLIError(f"cluster {paths.name}: {message}")
        job = first["job"]
        if first.get("ahead"):
            say(f"job {job} queued behind {first['ahead']} job(s) on {paths.name}")
        if detach:
            say(
                f"job {job} submitted to {paths.name} (task id {first['task_id']}); "
                f"follow it with `flotilla logs {paths.name} {job}`"
            )
            return 0
        try:
            code = show(stream)
        except KeyboardInterrupt:
            say(
                f"stopped following job {job}; it keeps running: "
                f"`flotilla logs {paths.name} {job}`, `flotilla cancel {paths.name} {job}`"
            )
            return 130
    return 0 if code is None else code


def new_record(
    paths: Paths,
    old: ClusterRecord | None,
    spec: ProviderSpec,
    nodes: int,
    idle: float | None,
    pid: int,
    generation: int,
    volumes: Sequence[Volume] = (),
    autodown: bool = False,
    engines: Sequence[str] = (),
) -> ClusterRecord:
    now = time.time()
    rec = ClusterRecord(
        generation=generation,
        name=paths.name,
        provider=spec.to_dict(),
        num_nodes=nodes,
        created=now,
        last_activity=now,
        pid=pid,
        pid_start=procs.start_time(pid) if pid else 0,
        idle_minutes=idle,
        volumes=[v.to_node() for v in volumes],
        engines=list(engines),
        autodown=autodown,
    )
    if old is not None:  # a stopped cluster started again keeps its job history
        rec.jobs, rec.next_job = old.jobs, old.next_job
    if old is not None and old.observed_state() is ClusterState.STALE:
        from .adopt import adoptable

        if adoptable(old):  # its nodes may run: the new daemon re-attaches to them
            rec.nodes, rec.token, rec.reattach_secret = old.nodes, old.token, old.reattach_secret
            rec.clients = list(old.clients)  # (a cloud's instances are labelled with them)
            rec.created = old.created
    return rec


def start_daemon(
    paths: Paths,
    old: ClusterRecord | None,
    spec: ProviderSpec,
    nodes: int,
    idle: float | None,
    volumes: Sequence[Volume] = (),
    autodown: bool = False,
    engines: Sequence[str] = (),
) -> ClusterRecord:
    """Create the record and start the cluster's daemon; returns once it listens. When
    another command is starting the same cluster, use its daemon."""
    from .background import Background

    with locked_generation(paths) as generation:
        current = load(paths)
        if current is not None and current.observed_state() in (
            ClusterState.UP,
            ClusterState.STARTING,
        ):
            return current  # another command won the race
        paths.ensure()
        daemon = Background(
            DAEMON_MODULE,
            [paths.name, "--generation", str(generation)],
            log=paths.daemon_log,
            cwd=paths.dir,
        )
        proc = daemon.proc
        rec = new_record(
            paths, current, spec, nodes, idle, proc.pid, generation, volumes, autodown, engines
        )
        save(paths, rec)
    if not daemon.wait_ready():
        last = tail(paths.daemon_log, 15)
        with contextlib.suppress(FlotillaError), update(paths, generation) as failed:
            failed.state = ClusterState.FAILED.value
            failed.error = f"its daemon exited with status {proc.returncode}"
        raise CLIError(
            f"cluster {paths.name}: the daemon exited with status {proc.returncode} before "
            f"it was ready; its log ({paths.daemon_log}) ends with:\n{last}",
            code=EXIT_PROVISION,
        )
    return rec


def launch_here(
    paths: Paths,
    old: ClusterRecord | None,
    spec: ProviderSpec,
    nodes: int,
    idle: float | None,
    job: JobSpec,
    volumes: Sequence[Volume] = (),
    engines: Sequence[str] = (),
) -> int:
    """``launch --down`` of a new cluster: the daemon runs inside this process, for the
    job's duration (other commands see and reach it as usual)."""
    from .daemon import ClusterDaemon, follow_local

    with locked_generation(paths) as generation:
        current = load(paths)
        if current is not None and current.observed_state() in (
            ClusterState.UP,
            ClusterState.STARTING,
        ):
            return submit(paths, current, job, detach=False)
        rec = new_record(
            paths, current, spec, nodes, idle, os.getpid(), generation, volumes, False, engines
        )
        save(paths, rec)
    daemon = ClusterDaemon(paths, generation)

    def interrupt(*_: object) -> NoReturn:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    serving = threading.Thread(target=daemon.serve_forever, name="flotilla-serve", daemon=True)
    try:
        daemon.start()
        serving.start()  # stop requests (`flotilla down`, the job's end) are handled there
        submitted, sub = daemon.submit(job, follow=True)
        assert sub is not None
        return show(follow_local(submitted, sub)) or 0
    except KeyboardInterrupt:
        say(f"interrupted: stopping cluster {paths.name}")
        return 130
    finally:
        daemon.request_stop(delete_record=True)
        if serving.is_alive():
            serving.join()
        daemon.shutdown()  # when it never started serving; otherwise a no-op
        signal.signal(signal.SIGTERM, previous)
