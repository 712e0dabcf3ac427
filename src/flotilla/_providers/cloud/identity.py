"""Who rented it: the client's identity, written on everything a pool rents (a label, a
tag: ``host:pid:start``, the process's start time in clock ticks, so that a recycled pid
is not mistaken for the client), and whether that client still runs (``flotilla down
--orphans`` removes the pools of clients of this machine that are gone).

A named cluster's daemon is the client of its pool, but its instances outlive it for a
grace period (its agents wait for a new daemon, ``cli/adopt.py``): the daemon holds a
*lease* on its identity (:func:`lease`, renewed while it runs, ``grace`` s ahead), and a
daemon that re-attaches to the cluster holds the leases of the identities its instances
are labelled with. A client whose process is gone counts as alive while a lease on it
runs (:func:`client_alive`): no orphan cleanup takes the pool of a cluster during the
grace or after a new daemon took it over. Leases are files of this user's private folder
``{tempdir}/flotilla-leases-{uid}`` holding the time they end; :func:`drop_leases` ends
them (the cluster released its instances)."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from ..._errors import ConfigurationError
from ..._system import procs
from ..._system.private import private_dir


def client_id() -> str:
    """``host:pid:start`` of this process."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_ticks(os.getpid())}"


def _start_ticks(pid: int) -> str:
    """``pid``'s start time as the owner tag keeps it ("" when it is gone or a zombie)."""
    return str(procs.start_time(pid) or "")


def client_alive(client: str) -> bool | None:
    """Whether the client process ``client`` still runs, or a lease on it does (see the
    module docstring); None: not on this machine."""
    host, _, rest = client.partition(":")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return leased(client)
    except PermissionError:
        pass
    return (not start or _start_ticks(int(pid)) == start) or leased(client)


def _leases() -> Path:
    return Path(tempfile.gettempdir()) / f"flotilla-leases-{os.getuid()}"


def _lease_file(client: str) -> Path:
    return _leases() / client.replace("/", "_").replace(":", "_")


def lease(clients: Iterable[str], seconds: float) -> None:
    """Count the clients ``clients`` alive for ``seconds`` from now, whether their
    processes run or not."""
    try:
        folder = private_dir(_leases())
    except (ConfigurationError, OSError):
        return  # not ours to use: the orphan cleanup goes by the processes alone
    until = time.time() + seconds
    for client in clients:
        path = folder / _lease_file(client).name
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with contextlib.suppress(OSError):
            tmp.write_text(f"{until:.3f}\n")
            os.replace(tmp, path)
    for old in folder.iterdir():  # those that ran out (their daemons died long ago)
        with contextlib.suppress(OSError, ValueError):
            if not old.name.startswith(".") and float(old.read_text()) <= time.time():
                old.unlink()


def drop_leases(clients: Iterable[str]) -> None:
    """End the leases on ``clients``: their pools are orphans once their processes end."""
    for client in clients:
        with contextlib.suppress(OSError):
            _lease_file(client).unlink()


def leased(client: str) -> bool:
    """Whether a lease on ``client`` runs (a file of this user's private lease folder)."""
    try:
        folder = private_dir(_leases(), create=False)
        return float((folder / _lease_file(client).name).read_text()) > time.time()
    except (ConfigurationError, OSError, ValueError):
        return False


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


def remove_dead_folders(prefix: str) -> list[str]:
    """Remove this user's pool folders of clients that are gone (:func:`dead_folders`):
    what ``flotilla down --orphans`` does with a killed client's keys; those removed."""
    import shutil

    folders = dead_folders(prefix)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return folders
