"""How a process ended, in words (standard library only: the agent imports it)."""

from __future__ import annotations

import signal


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number with no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(exitcode: int | None) -> tuple[str, str | None]:
    """How a process ended and its signal's name: ('was killed by SIGSEGV', 'SIGSEGV'),
    ('exited with status 3', None). ``exitcode`` is negative for a signal, as in
    ``subprocess``."""
    if exitcode is None:
        return "exited (status unknown)", None
    if exitcode < 0:
        name = signal_name(-exitcode)
        hint = " — out of memory?" if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}", name
    return f"exited with status {exitcode}", None
