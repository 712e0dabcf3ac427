"""``flotilla autostop CLUSTER... [-i MINUTES] [--down] | --cancel`` (SkyPilot's
``sky autostop``): change a running cluster's idle limit.

The cluster's daemon stops the cluster (or, with ``--down``, tears it down) after
``MINUTES`` without jobs, counted from now; ``--cancel`` removes the limit. Without
``-i`` the limit is 5 minutes, as SkyPilot's. The record keeps it, so ``flotilla status``
and ``flotilla start`` see it.
"""

from __future__ import annotations

import argparse

from .._errors import ConfigurationError
from .backends import registry
from .clusters import running
from .console import CLIError, say
from .conventions import DEFAULT_AUTOSTOP_MINUTES
from .state import Paths


def cmd_autostop(args: argparse.Namespace) -> int:
    from .ipc import request

    if args.cancel and (args.idle_minutes is not None or args.down):
        raise ConfigurationError("give --cancel alone, or -i MINUTES [--down]")
    minutes = None if args.cancel else args.idle_minutes
    if not args.cancel and minutes is None:
        minutes = DEFAULT_AUTOSTOP_MINUTES
    if minutes is not None and minutes <= 0:
        raise ConfigurationError(f"-i must be a positive number of minutes, got {minutes:g}")
    for name in args.clusters:  # every cluster checked before any is changed
        paths = Paths(name)
        rec = running(paths)
        spec = registry.spec_from_dict(rec.provider)
        refusal = registry.backend_for(spec).autostop_refusal(spec)
        if minutes is not None and not args.down and refusal:
            raise CLIError(
                f"cluster {name} cannot be stopped: {refusal}; add --down to tear it down "
                "after that long instead",
                code=2,
            )
    for name in args.clusters:
        paths = Paths(name)
        answers = list(
            request(paths.socket, {"op": "autostop", "minutes": minutes, "down": args.down})
        )
        if not any(a.get("ev") == "autostop" for a in answers):
            why = next((a.get("message") for a in answers if a.get("ev") == "error"), "")
            raise CLIError(
                f"cluster {name}: its daemon did not take the new limit"
                + (f" ({why}: an older daemon? `flotilla launch` it again)" if why else "")
            )
        if minutes is None:
            say(f"cluster {name}: autostop cancelled (it runs until `flotilla down {name}`)")
        else:
            what = "torn down" if args.down else "stopped"
            say(f"cluster {name}: {what} after {minutes:g} minute(s) without jobs, from now")
    return 0


def add_autostop_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    q = sub.add_parser("autostop", help="stop (or tear down) running clusters when idle")
    q.add_argument("clusters", nargs="+", metavar="CLUSTER")
    q.add_argument(
        "-i",
        "--idle-minutes",
        dest="idle_minutes",
        type=float,
        metavar="MINUTES",
        help=f"minutes without jobs, counted from now (default {DEFAULT_AUTOSTOP_MINUTES:g})",
    )
    q.add_argument("--down", action="store_true", help="tear the cluster down, not stop it")
    q.add_argument("--cancel", action="store_true", help="remove the idle limit")
    q.set_defaults(func=cmd_autostop)
