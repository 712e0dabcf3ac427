"""The ``flotilla`` argument parser: its commands, their arguments and flags (the backends
add theirs to ``launch``, see ``backends.registry``).

A run builds only the command it names (:func:`build_parser` with ``command``): the other
commands are names alone, so that a command imports its own modules and nothing else (a
``flotilla status`` does not load every backend, the server and the pool machinery).
``--help`` before any command builds them all.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeAlias

from .._version import __version__
from .console import json_flag
from .conventions import EXIT_CODES, count, index

_Sub: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``flotilla`` command line: one sub-command per ``cmd_*`` function. Given
    ``command`` (a run's first word), only that sub-command gets its arguments (and imports
    its modules); the others are there by name only, which is all argparse needs to pick
    one, print the usage or refuse an unknown name. None: every sub-command (``--help``)."""
    codes = "; ".join(f"{c}: {what}" for c, what in EXIT_CODES.items())
    p = argparse.ArgumentParser(
        prog="flotilla",
        description="Run task files (SkyPilot format) on multi-node clusters.",
        epilog=f"Exit status: the job's own, or {codes}.",
    )
    p.add_argument("--version", action="version", version=f"flotilla {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    made: dict[str, argparse.ArgumentParser] = {}
    for names, changes, add in _PARTS:
        if command is None or command in names or command in changes:
            add(sub, made)
        else:
            for name in names:
                sub.add_parser(name)
    return p


def command_of(argv: list[str]) -> str | None:
    """The sub-command ``argv`` names (its first word that is not an option), for
    :func:`build_parser`; None when ``-h``/``--help`` comes first (the whole parser)."""
    for word in argv:
        if word in ("-h", "--help"):
            return None
        if not word.startswith("-"):
            return word
    return ""


def job_flags(q: argparse.ArgumentParser) -> None:
    """The flags of a job's submission: ``launch``, ``exec`` and ``jobs launch``."""
    q.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="set or override a variable"
    )
    q.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="K",
        help="a secret variable, its value taken from this environment: never logged, "
        "shown or written to disk (K=V works but shows V to every user through ps)",
    )
    q.add_argument(
        "--secret-file",
        action="append",
        default=[],
        metavar="FILE",
        help="secret variables from a file of KEY=VALUE lines",
    )
    q.add_argument(
        "--env-file",
        action="append",
        default=[],
        metavar="FILE",
        help="variables from a dotenv file (KEY=VALUE lines; --env wins over it)",
    )
    q.add_argument(
        "--workdir",
        metavar="DIR",
        help="the local folder synced to the nodes, instead of the task's workdir",
    )
    q.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help="do not ask for confirmation; launch: add the Include line that lets `ssh "
        "NAME` reach the cluster to ~/.ssh/config (see `flotilla ssh-config`)",
    )
    q.add_argument("-d", "--detach", action="store_true", help="submit and return; do not follow")
    q.add_argument(
        "--retries",
        type=int,
        default=0,
        help="run a failed `run` again up to this many times (same task id)",
    )


def _launch(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    q = sub.add_parser("launch", help="start a cluster (if needed), sync, set up and run a task")
    q.add_argument("task", help="a task file (SkyPilot YAML) or a shell command")
    q.add_argument("-c", "--cluster", help="cluster name (default: a new one)")
    q.add_argument(
        "--nodes",
        "--num-nodes",
        dest="nodes",
        type=count("--nodes"),
        help="nodes to run on, overriding the task's num_nodes (SkyPilot's --num-nodes); "
        "a new cluster gets that many",
    )
    q.add_argument("--no-setup", action="store_true", help="skip the task's setup")
    q.add_argument(
        "--down",
        action="store_true",
        help="remove the cluster when the job ends (with --autostop: after that long idle)",
    )
    q.add_argument(
        "--autostop",
        "-i",
        "--idle-minutes",
        dest="idle_minutes",
        type=float,
        metavar="MINUTES",
        help="stop the cluster (keeping its disks: `flotilla start` resumes it) after this "
        "long without jobs; with --down, tear it down instead",
    )
    q.add_argument(
        "--dryrun",
        "--dry-run",
        dest="dryrun",
        action="store_true",
        help="check the task and print the provider, its settings and what every node "
        "would get; start and rent nothing",
    )
    q.add_argument("--json", action="store_true", help="with --dryrun: one JSON document")
    resource_flags(q)
    q.add_argument(
        "--infra",
        metavar="INFRA",
        help="where to run, as a task's resources.infra: aws/us-east-1, k8s, slurm...",
    )
    q.add_argument(
        "--use-spot",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="spot instances (or not: --no-use-spot), as a task's resources.use_spot",
    )
    job_flags(q)
    from .backends import registry
    from .cmd_run import cmd_launch

    registry.add_flags(q)
    q.set_defaults(func=cmd_launch)


def _exec(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    q = sub.add_parser("exec", help="sync the workdir and run a task or command (no setup)")
    q.add_argument("cluster")
    q.add_argument(
        "task",
        nargs="+",
        help="a task file or a shell command, quoted or not (`exec dev echo hi`; after `--` "
        "when the command has words that start with '-')",
    )
    q.add_argument(
        "--nodes",
        "--num-nodes",
        dest="nodes",
        type=count("--nodes"),
        help="nodes to run on (default: the task's, or all)",
    )
    resource_flags(
        q,
        "the job holds while it runs",
        "; jobs share the cluster's nodes while they have room, queue otherwise",
    )
    q.add_argument(
        "--dryrun",
        "--dry-run",
        dest="dryrun",
        action="store_true",
        help="check the task against the cluster and print what would run; submit nothing",
    )
    job_flags(q)
    from .cmd_run import cmd_exec

    q.set_defaults(func=cmd_exec)


def _status(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_clusters import cmd_status

    q = sub.add_parser("status", help="the clusters: provider, nodes, state, age, idle time")
    q.add_argument("clusters", nargs="*")
    json_flag(q)
    q.set_defaults(func=cmd_status)


def _queue(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_jobs import cmd_queue

    q = sub.add_parser("queue", help="a cluster's jobs")
    q.add_argument("cluster")
    json_flag(q)
    q.set_defaults(func=cmd_queue)


def _logs(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_jobs import cmd_logs

    q = sub.add_parser("logs", help="a job's output (default: the latest job)")
    q.add_argument("cluster")
    q.add_argument("job", nargs="?", type=int)
    q.add_argument(
        "-f", "--follow", action="store_true", default=True, help="print until it ends (default)"
    )
    q.add_argument(
        "--no-follow", dest="follow", action="store_false", help="print what there is, exit"
    )
    q.add_argument("--node", type=index("--node"), help="only this node's output")
    q.set_defaults(func=cmd_logs)
    made["logs"] = q  # `observe` adds --export


def _cancel(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_jobs import cmd_cancel

    q = sub.add_parser("cancel", help="stop jobs on every node")
    q.add_argument("cluster")
    q.add_argument("jobs", nargs="*", type=int, metavar="JOB")
    q.add_argument("-a", "--all", action="store_true", help="every job not finished yet")
    q.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    q.set_defaults(func=cmd_cancel)


def _down(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .backends import registry
    from .cmd_clusters import cmd_down

    q = sub.add_parser("down", help="stop clusters and remove them (logs included)")
    q.add_argument("clusters", nargs="*", metavar="CLUSTER")
    q.add_argument("-a", "--all", action="store_true", help="every cluster")
    q.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    q.add_argument(
        "--orphans",
        action="store_true",
        help="also remove what killed clients left with --provider (e.g. cloud instances)",
    )
    q.add_argument("--dry-run", action="store_true", help="with --orphans: list, remove nothing")
    registry.add_flags(q)  # --provider and its flags: where to look (--region, --namespace)
    q.set_defaults(func=cmd_down)


def _autostop(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_autostop import add_autostop_parser

    add_autostop_parser(sub)


def _config(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_config import add_config_parser

    add_config_parser(sub)  # config show|validate


def _stop(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_clusters import cmd_stop

    q = sub.add_parser("stop", help="stop clusters, keeping their disks and environments")
    q.add_argument("clusters", nargs="+", metavar="CLUSTER")
    q.set_defaults(func=cmd_stop)


def _start(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_clusters import cmd_start

    q = sub.add_parser("start", help="start stopped clusters again")
    q.add_argument("clusters", nargs="+", metavar="CLUSTER")
    q.set_defaults(func=cmd_start)


def _ssh(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_clusters import cmd_ssh

    q = sub.add_parser("ssh", help="a shell (or a command) on a node, in its working directory")
    q.add_argument("cluster")
    q.add_argument("--node", type=index("--node"), default=0, help="the node (default: 0)")
    q.add_argument("remote", nargs="*", metavar="CMD", help="a command instead of a shell")
    q.set_defaults(func=cmd_ssh, takes_rest=True)  # what follows `--` is CMD, unparsed


def _files(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_files import add_file_parsers

    add_file_parsers(sub)  # cp, download, rsync


def _ssh_config(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .sshconfig import add_parser as add_ssh_config

    add_ssh_config(sub)  # ssh-config


def _jobs(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .backends import registry
    from .managed.commands import add_jobs_parser

    add_jobs_parser(sub, job_flags, registry.add_flags)  # `flotilla jobs ...`: managed jobs


def _market(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .cmd_market import add_parsers

    add_parsers(sub)  # show-gpus, check, cost-report


def _observe(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from .observe import add_parsers as add_observe

    logs = made.get("logs") or argparse.ArgumentParser()  # --export, on `logs` when built
    add_observe(sub, logs)  # top, events, logs --export


def _server(sub: _Sub, made: dict[str, argparse.ArgumentParser]) -> None:
    from ..server.control import add_parser as add_server

    add_server(sub)  # server start|stop|status: the HTTP API and dashboard


_PARTS: tuple[
    tuple[
        tuple[str, ...], tuple[str, ...], Callable[[_Sub, dict[str, argparse.ArgumentParser]], None]
    ],
    ...,
] = (
    (("launch",), (), _launch),
    (("exec",), (), _exec),
    (("status",), (), _status),
    (("queue",), (), _queue),
    (("logs",), (), _logs),
    (("cancel",), (), _cancel),
    (("down",), (), _down),
    (("autostop",), (), _autostop),
    (("config",), (), _config),
    (("stop",), (), _stop),
    (("start",), (), _start),
    (("ssh",), (), _ssh),
    (("cp", "download", "rsync"), (), _files),
    (("ssh-config",), (), _ssh_config),
    (("jobs",), (), _jobs),
    (("show-gpus", "check", "cost-report"), (), _market),
    (("top", "events"), ("logs",), _observe),
    (("server",), (), _server),
)
"""The sub-commands in ``--help``'s order: (the names a part adds, the other commands it
changes, the function that adds them)."""


def resource_flags(
    q: argparse.ArgumentParser, what: str = "every node gets", more: str = ""
) -> None:
    """SkyPilot's ``--gpus``/``--cpus``/``--memory``: a task's ``resources`` fields, per node."""
    for flag, example in (("gpus", "A100:0.5"), ("cpus", "4+"), ("memory", "16")):
        q.add_argument(
            f"--{flag}",
            metavar=example.upper() if flag == "gpus" else "N",
            help=f"{flag} per node {what} (e.g. {example}; over the task's){more}",
        )


def command_options(parser: argparse.ArgumentParser, name: str) -> set[str] | None:
    """For a sub-command whose last words are a command to run (``flotilla ssh``), its
    options that take a value (see ``conventions.split_command``); None for the others."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(name)
            if sub is not None and sub.get_default("takes_rest"):
                return {o for a in sub._actions if a.nargs != 0 for o in a.option_strings}
    return None
