"""Command-line conventions people bring from SkyPilot and other tools.

* Exit statuses: the job's own code, and codes of flotilla's own (:data:`EXIT_CODES`).
* Counts are checked where they are parsed: ``--nodes 0`` or ``-1`` is an error, not
  "all" or "nothing"; ``--num-nodes`` is SkyPilot's spelling of ``--nodes``.
* ``flotilla ssh NAME --node K CMD ARGS...``: options may come before or after NAME; the
  command starts at the first word after NAME that is not an option (or after ``--``), so
  the command's own flags are never read as flotilla's.
* Questions before destructive commands on many clusters or jobs (``down -a``,
  ``cancel -a``), skipped with ``-y/--yes``; never asked where nobody can answer.
* Ad-hoc commands get a readable job name; ``launch`` ends with the next steps.

Light on imports: every command goes through here.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_FLOTILLA = 100
EXIT_PROVISION = 101
EXIT_LOST = 102
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    EXIT_OK: "the job succeeded (every node's `run` exited 0), or the command did its work",
    EXIT_USAGE: "bad command line, task file or value: nothing was started",
    EXIT_FLOTILLA: "flotilla could not do it: no such cluster, a cluster that is not up, "
    "a job or node that does not exist, a question answered no",
    EXIT_PROVISION: "the cluster's nodes could not be started (provider, agent, environment)",
    EXIT_LOST: "flotilla lost its cluster: the daemon or a node went away during the command",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}
"""Exit status -> meaning. Any other status is the job's own: the exit code of the node
whose ``run`` failed first (128+N when signal N killed it, as shells report it)."""


def count(flag: str) -> Callable[[str], int]:
    """An argparse ``type`` for ``flag``: a whole number of at least 1."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a whole number of nodes, 1 or more (got {text!r})"
            )
        return value

    parse.__name__ = "count"  # argparse names the type in its messages
    return parse


def index(flag: str) -> Callable[[str], int]:
    """An argparse ``type`` for ``flag``: a node index, 0 or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a node index, 0 for the head (got {text!r})"
            )
        return value

    parse.__name__ = "index"
    return parse


def split_command(argv: list[str], valued: set[str]) -> tuple[list[str], list[str]]:
    """Split ``NAME [options] CMD ARGS...`` (options anywhere before CMD) into what
    argparse should read and the command, verbatim.

    ``valued`` are the options that take a value (``--node``). The first word that is
    neither an option (nor its value) nor NAME starts the command; ``--`` starts it
    explicitly. Options before the command are all left to argparse (an unknown one is
    refused there, with its message).
    """
    parsed: list[str] = []
    positional = 0
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return parsed, argv[i + 1 :]
        if word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            parsed.append(word)
            if name in valued and "=" not in word and i + 1 < len(argv):
                parsed.append(argv[i + 1])
                i += 1
            i += 1
            continue
        if positional >= 1:
            return parsed, argv[i:]
        parsed.append(word)
        positional += 1
        i += 1
    return parsed, []


def confirm(question: str, yes: bool) -> bool:
    """Whether to go on: ``yes`` (``-y``), or the person at the terminal says so. Where
    nobody can answer (no terminal), a ConfigurationError says to pass ``-y``."""
    if yes:
        return True
    if not sys.stdin.isatty():
        from .._errors import ConfigurationError

        raise ConfigurationError(f"{question.rstrip('?')}: add -y/--yes to confirm (no terminal)")
    sys.stderr.write(f"flotilla: {question} [y/N] ")
    sys.stderr.flush()
    try:
        answer = sys.stdin.readline().strip().lower()
    except (OSError, KeyboardInterrupt):
        answer = ""
    return answer in ("y", "yes")


def job_name(command: str, limit: int = 40) -> str:
    """A readable name for an ad-hoc command's job, not just its first word (``for``,
    ``if``): its words joined by ``-`` (``python-train.py-lr-3``), cut to ``limit``
    characters; no spaces, so that ``flotilla queue``'s columns stay columns."""
    slug = re.sub(r"[^A-Za-z0-9._]+", "-", command).strip("-.")
    if len(slug) > limit:
        slug = slug[:limit].rstrip("-.")
    return slug or "command"


def next_steps(cluster: str, job: int | None, idle_minutes: float | None) -> list[str]:
    """What to do with a cluster after ``launch`` (said once it is up)."""
    where = f"{cluster} {job}" if job is not None else cluster
    idle = (
        f"it stops by itself after {idle_minutes:g} minute(s) without jobs"
        if idle_minutes
        else f"it keeps running until `flotilla down {cluster}` "
        "(`launch --idle-minutes N` stops a cluster after N minutes without jobs)"
    )
    steps = [
        (f"flotilla logs {where}", "the job's output (follows it; --no-follow: print, exit)"),
        (f"flotilla exec {cluster} 'CMD'", "run a command on it (no setup)"),
        (f"flotilla ssh {cluster} [--node K]", "a shell on a node"),
        (f"flotilla down {cluster}", "stop it and remove it"),
    ]
    width = max(len(c) for c, _ in steps)
    return [f"cluster {cluster} is up; {idle}"] + [f"  {c.ljust(width)}  {w}" for c, w in steps]


DEFAULT_AUTOSTOP_MINUTES = 5.0
"""SkyPilot's default idle time: ``resources.autostop: true``, ``flotilla autostop`` without
``-i``."""
