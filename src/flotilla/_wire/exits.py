"""How a process ended, in words: the one place that says it (standard library only: the
agent imports it).

A status is an ``int | None`` as :mod:`subprocess` reports it: ``>= 0`` the exit status,
negative the number of the signal that killed it, None unknown. Two phrasings of the same
facts, for the two places a status appears in a sentence:

=====================  ===============================  ====================
status                 :func:`describe_exit` (a verb)   :func:`exit_summary`
=====================  ===============================  ====================
3                      exited with status 3             exit status 3
-9                     was killed by SIGKILL — out of   killed by SIGKILL
                       memory?
-99                    was killed by signal 99          killed by signal 99
None                   exited (status unknown)          status unknown
=====================  ===============================  ====================
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # (typeshed has no _signal: signal's names, its types)
else:
    import _signal  # signal.py's C module: the same calls and SIG* ints, without its enums

_OOM_HINT = " — out of memory?"
"""SIGKILL is what the kernel's out-of-memory killer sends: the likeliest cause to name."""


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number with no name. The name
    ``signal.Signals(number).name`` gives (its first in alphabetical order: SIGABRT, not
    SIGIOT; SIGCHLD, not SIGCLD; SIGIO, not SIGPOLL), found among ``_signal``'s constants:
    ``signal``'s import makes its enums, at every node's start."""
    for name in sorted(vars(_signal)):
        if name.startswith("SIG") and name[3:4] != "_" and getattr(_signal, name) == number:
            return name
    return f"signal {number}"


def exit_signal(status: int | None) -> str | None:
    """The name of the signal that ended a process with ``status``; None if none did."""
    return signal_name(-status) if status is not None and status < 0 else None


def describe_exit(status: int | None) -> tuple[str, str | None]:
    """How a process ended, as a verb phrase, and its signal's name: ('was killed by
    SIGSEGV', 'SIGSEGV'), ('exited with status 3', None)."""
    sig = exit_signal(status)
    if sig is not None:
        return f"was killed by {sig}{_OOM_HINT if sig == 'SIGKILL' else ''}", sig
    if status is None:
        return "exited (status unknown)", None
    return f"exited with status {status}", None


def exit_summary(status: int | None) -> str:
    """How a process ended, as a noun phrase for parentheses: 'killed by SIGKILL',
    'exit status 3', 'status unknown'."""
    sig = exit_signal(status)
    if sig is not None:
        return f"killed by {sig}"
    return "status unknown" if status is None else f"exit status {status}"
