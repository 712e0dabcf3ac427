"""The clusters themselves: ``flotilla status``, ``flotilla down``, ``flotilla ssh``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time

from .._errors import ConfigurationError, FlotillaError
from .._system import procs
from .console import CLIError, duration, print_json, say, table
from .conventions import EXIT_FLOTILLA, confirm
from .state import (
    ClusterRecord,
    ClusterState,
    CorruptStateError,
    JobStatus,
    Paths,
    all_names,
    load,
)


def cmd_status(args: argparse.Namespace) -> int:
    if args.json:
        from ..server.api import clusters

        return print_json({"clusters": clusters(args.clusters)})
    from .adopt import adoptable

    names = args.clusters or all_names()
    rows = [["NAME", "PROVIDER", "NODES", "STATE", "AGE", "IDLE"]]
    notes: list[str] = []
    now = time.time()
    for name in names:
        try:
            rec = load(Paths(name))
        except CorruptStateError as e:  # this cluster only: the others are still listed
            rows.append([name, "?", "?", "CORRUPT", "-", "-"])
            notes.append(str(e))
            continue
        if rec is None:
            notes.append(f"{name}: no such cluster")
            continue
        state = rec.observed_state()
        busy = any(not JobStatus(j.status).finished for j in rec.jobs)
        idle = "-" if busy or state is not ClusterState.UP else duration(now - rec.last_activity)
        rows.append(
            [
                name,
                str(rec.provider.get("kind", "?")),
                str(rec.num_nodes),
                state.value,
                duration(now - rec.created),
                idle,
            ]
        )
        if state is ClusterState.STALE:
            again = f"`flotilla start {name}` re-attaches to its nodes, " if adoptable(rec) else ""
            notes.append(
                f"{name}: its daemon (pid {rec.pid}) is gone; {again}`flotilla down {name}` "
                "cleans up"
            )
        elif rec.error:
            notes.append(f"{name}: {rec.error}")
    if len(rows) == 1 and not notes:
        print("no clusters (`flotilla launch TASK -c NAME` starts one)")
        return 0
    sys.stdout.write(table(rows))
    for note in notes:
        print(note)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from .adopt import adoptable
    from .backends import registry
    from .clusters import reattach
    from .ipc import request
    from .state import delete

    if args.orphans:
        if args.provider is None:
            raise CLIError(
                f"--orphans needs --provider: one of {', '.join(registry.kinds())}", code=2
            )
        spec = registry.spec_from_args(args)  # its flags say where to look
        assert spec is not None
        for line in registry.backend_for(spec).remove_orphans(spec, args.dry_run):
            say(line)
        if not args.clusters and not args.all:
            return 0
    code = 0
    names: list[str] = args.clusters
    if args.all:
        if names:
            raise ConfigurationError("give cluster names or -a/--all, not both")
        names = all_names()
        if not names:
            say("there are no clusters")
            return 0
        if not confirm(f"stop and remove cluster(s) {', '.join(names)}?", args.yes):
            raise CLIError("nothing was stopped")
    elif not names:
        raise ConfigurationError(
            "which clusters? `flotilla down NAME...`, -a for every one, "
            "or --orphans --provider P for what killed clients left"
        )
    for name in names:
        paths = Paths(name)
        try:
            rec = load(paths)
        except CorruptStateError:
            _down_corrupt(paths)
            continue
        if rec is None:
            say(f"there is no cluster {name!r}")
            code = EXIT_FLOTILLA
            continue
        state = rec.observed_state()
        if state is ClusterState.STALE and adoptable(rec):  # reach its nodes to stop them
            try:
                rec = reattach(paths, rec)
            except CLIError as e:
                say(str(e))
                rec = load(paths) or rec
            state = rec.observed_state()
        if state.needs_daemon:
            try:
                answers = list(request(paths.socket, {"op": "down"}))
            except OSError:
                answers = []
            if not any(a["ev"] == "down" for a in answers) and procs.alive(rec.pid, rec.pid_start):
                os.kill(rec.pid, signal.SIGTERM)
            if not procs.wait_gone(rec.pid, rec.pid_start, 60.0):
                raise CLIError(f"cluster {name}: its daemon (pid {rec.pid}) does not stop")
        elif state is ClusterState.STALE:
            say(f"cluster {name}: its daemon (pid {rec.pid}) was gone; cleaning up")
        try:
            backend = registry.backend(str(rec.provider.get("kind", registry.DEFAULT.kind)))
        except ConfigurationError as e:
            say(f"cluster {name}: {e}; nothing it left behind is looked for")
        else:
            backend.on_down(paths, rec)
        if delete(paths, rec.generation):
            say(f"cluster {name}: down")
        else:
            say(f"cluster {name}: down (a new cluster of that name was launched meanwhile)")
    return code


def _down_corrupt(paths: Paths) -> None:
    """``down`` of a cluster whose state file is unreadable: ask a daemon that may still
    listen to stop, clean up what local nodes may have left, remove the rest."""
    from .backends import registry
    from .ipc import request
    from .state import delete

    with contextlib.suppress(OSError, ValueError, FlotillaError):
        list(request(paths.socket, {"op": "down"}))
    registry.DEFAULT.on_down(paths, ClusterRecord(name=paths.name, provider={}, num_nodes=0))
    delete(paths)
    say(f"cluster {paths.name}: its unreadable state was removed; down")


def cmd_ssh(args: argparse.Namespace) -> int:
    from .cmd_files import Remote, exec_shell, node_shell

    shell = node_shell(Remote(args.cluster, args.node, ""), " ".join(args.remote))
    if shell.note:
        say(shell.note)
    exec_shell(shell)


def cmd_stop(args: argparse.Namespace) -> int:
    """Stop clusters: their agents end, their nodes' folders and built environments stay,
    the record says STOPPED; ``flotilla start`` brings them back. Providers whose nodes
    cannot be stopped are refused, with ``down`` offered."""
    from .adopt import stop_refusal
    from .backends import registry
    from .ipc import request

    code = 0
    for name in args.clusters:
        paths = Paths(name)
        rec = load(paths)
        if rec is None:
            say(f"there is no cluster {name!r}")
            code = EXIT_FLOTILLA
            continue
        kind = str(rec.provider.get("kind", registry.DEFAULT.kind))
        backend = registry.backend(kind)
        note = backend.stop_refusal(paths, backend.spec_from_dict(rec.provider))
        note = note or stop_refusal(rec)
        if note:
            raise CLIError(
                f"cluster {name} runs on {kind}: {note}; `flotilla down {name}` releases "
                "its nodes instead",
                code=2,
            )
        state = rec.observed_state()
        if state is ClusterState.STOPPED:
            say(f"cluster {name}: already stopped")
            continue
        if not state.needs_daemon:
            raise CLIError(f"cluster {name} is {state.value}: `flotilla down {name}` removes it")
        try:
            answers = list(request(paths.socket, {"op": "stop"}))
        except OSError:
            answers = []
        if not any(a["ev"] == "stopped" for a in answers) and procs.alive(rec.pid, rec.pid_start):
            os.kill(rec.pid, signal.SIGTERM)  # an older daemon: it stops the same way
        if not procs.wait_gone(rec.pid, rec.pid_start, 60.0):
            raise CLIError(f"cluster {name}: its daemon (pid {rec.pid}) does not stop")
        say(f"cluster {name}: stopped (`flotilla start {name}` starts it again)")
    return code


def cmd_start(args: argparse.Namespace) -> int:
    """Start stopped clusters with their record's provider, nodes, buckets and autostop;
    returns once they are UP (or failed, saying why)."""
    from .._volume import Volume
    from .adopt import adoptable
    from .backends import registry
    from .clusters import reattach, start_daemon, wait_up

    for name in args.clusters:
        paths = Paths(name)
        rec = load(paths)
        if rec is None:
            raise CLIError(f"there is no cluster {name!r}", code=EXIT_FLOTILLA)
        state = rec.observed_state()
        if state in (ClusterState.UP, ClusterState.STARTING):
            say(f"cluster {name}: already {state.value}")
            continue
        if state is ClusterState.STALE and adoptable(rec):  # its nodes may still run
            rec = reattach(paths, rec)
            say(f"cluster {name}: re-attached to its {len(rec.nodes)} node(s)")
            continue
        spec = registry.spec_from_dict(rec.provider)
        kept = state is ClusterState.FAILED and registry.backend_for(spec).restartable(paths)
        if state is not ClusterState.STOPPED and not kept:  # (a failed start keeps them)
            raise CLIError(
                f"cluster {name} is {state.value}, not STOPPED: `flotilla down {name}` removes it"
            )
        volumes = [Volume(**v) for v in rec.volumes]
        if volumes:  # the buckets can still be read: before anything is provisioned
            from .._volume import node_spec

            node_spec(volumes)
        started = start_daemon(
            paths, rec, spec, rec.num_nodes, rec.idle_minutes, volumes, rec.autodown, rec.engines
        )
        wait_up(paths)
        say(f"cluster {name}: {started.num_nodes} {spec.kind} node(s) up")
    return 0
