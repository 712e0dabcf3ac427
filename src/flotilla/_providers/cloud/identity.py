"""Who rented it: the client's identity, written on everything a pool rents (a label, a
tag: ``host:pid:start``, the process's start time in clock ticks, so that a recycled pid
is not mistaken for the client), and whether that client still runs (``flotilla down
--orphans`` removes the pools of clients of this machine that are gone)."""

from __future__ import annotations

import os
import socket

from ..._system import procs


def client_id() -> str:
    """``host:pid:start`` of this process."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_ticks(os.getpid())}"


def _start_ticks(pid: int) -> str:
    """``pid``'s start time as the owner tag keeps it ("" when it is gone or a zombie)."""
    return str(procs.start_time(pid) or "")


def client_alive(client: str) -> bool | None:
    """Whether the client process ``client`` still runs (None: not on this machine)."""
    host, _, rest = client.partition(":")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not start or _start_ticks(int(pid)) == start


def orphaned(pool: str, client: str, skipped: set[str]) -> bool:
    """Whether ``pool``, rented by the client ``client`` ("" when no one is named), is an
    orphan: that client no longer runs. A pool whose client is not of this machine (or not
    named) cannot be told: it is added to ``skipped``."""
    alive = client_alive(client) if client else None
    if alive is None:
        skipped.add(pool)
    return alive is False
