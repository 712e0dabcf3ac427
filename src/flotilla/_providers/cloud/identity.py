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


def pool_folder(prefix: str, pool_id: str) -> str:
    """A new private folder (0700) for a pool's keys and known_hosts,
    ``{tempdir}/{prefix}{pool}-XXXX``, with the client's identity in its ``client`` file
    (:func:`dead_folders` finds the folders of clients that are gone)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix=f"{prefix}{pool_id}-")
    with open(os.path.join(folder, "client"), "w") as f:
        f.write(client_id())
    return folder


def dead_folders(prefix: str) -> list[str]:
    """This user's pool folders (:func:`pool_folder`) whose client process is gone (a
    killed client's: ``flotilla down --orphans`` removes them)."""
    import glob
    import tempfile

    out = []
    for folder in sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}*"))):
        try:
            if os.stat(folder).st_uid != os.getuid():
                continue
            with open(os.path.join(folder, "client")) as f:
                client = f.read().strip()
        except OSError:
            continue
        if client_alive(client) is False:
            out.append(folder)
    return out
