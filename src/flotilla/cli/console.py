"""What the command line prints: its messages, job output as it streams, tables; and
:class:`CLIError`, a command that cannot go on. Imports nothing heavy."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from typing import Any

from .._errors import FlotillaError
from .ipc import Event
from .state import JobStatus


class CLIError(FlotillaError):
    """A command that cannot go on; ``code`` is the exit status (see ``conventions``)."""

    def __init__(self, message: str, code: int = 100) -> None:
        super().__init__(message)
        self.code = code


def say(text: str) -> None:
    sys.stderr.write(f"flotilla: {text}\n")
    sys.stderr.flush()


def show(events: Iterable[Event], raw: bool = False, quiet_end: bool = False) -> int | None:
    """Print a job's events as they come; the job's exit status (None: the daemon no
    longer has the job). Node lines carry their node unless ``raw`` (one node's log), in
    the node's colour on a terminal; bars (``bar`` events) are redrawn in place there, and
    written now and then elsewhere (see ``flotilla._client.console``)."""
    from .._client.console import Console

    console = Console()
    try:
        return _show(events, raw, quiet_end, console)
    finally:
        console.close()


def _show(events: Iterable[Event], raw: bool, quiet_end: bool, console: Any) -> int | None:
    out, err = sys.stdout, sys.stderr
    for ev in events:
        what = ev["ev"]
        if what == "out" and raw:
            stream = out if ev["stream"] == 1 else err
            stream.write(ev["line"] + "\n")
            stream.flush()
        elif what == "out":
            console.lines(ev["node"], ev["rank"], ev["stream"], [ev["line"]])
        elif what == "bar":
            if not raw:
                console.state(ev["node"], ev["rank"], ev["stream"], ev["line"])
        elif what == "log":
            out.write(ev["line"] + "\n")
            out.flush()
        elif what == "phase":
            if not raw:
                say(ev["text"])
        elif what == "end":
            console.close()
            out.flush()
            report(ev, quiet_end)
            code = ev.get("exit_code")
            if code is None:
                return 1
            return 128 - int(code) if int(code) < 0 else int(code)  # killed by signal N
        elif what == "gone":
            return None
        elif what == "error":
            raise CLIError(ev["message"])
    raise CLIError(
        "the cluster daemon went away before the job ended (see `flotilla status`)", code=102
    )


def report(ev: Event, quiet: bool) -> None:
    """The end of a job: root cause first for a failure."""
    report: list[str] = ev.get("report") or []
    if ev["status"] == JobStatus.SUCCEEDED.value:
        if not quiet:
            say(f"job {ev['job']} succeeded ({ev.get('elapsed', 0):.2f} s)")
        return
    if report:
        sys.stderr.write(f"flotilla: {report[0]}\n")
        sys.stderr.write("".join(f"  {line}\n" for line in report[1:]))
    else:
        sys.stderr.write(f"flotilla: job {ev['job']} {ev['status']}\n")
    sys.stderr.flush()


def json_flag(parser: Any) -> None:
    """A reporting command's ``--json`` (see :func:`print_json`)."""
    parser.add_argument(
        "--json", action="store_true", help="one JSON document on stdout (docs/command-line.md)"
    )


def print_json(document: object) -> int:
    """``--json`` of a reporting command: one JSON document on stdout (the fields are
    documented in docs/command-line.md); exit status 0."""
    sys.stdout.write(json.dumps(document, indent=1) + "\n")
    return 0


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n" for r in rows
    )


def duration(seconds: float) -> str:
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def tail(path: str | os.PathLike[str], lines: int) -> str:
    """The last ``lines`` lines of a text file ('' when it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""
