"""A pool's shared-memory files in ``/dev/shm``, named so that they never outlive their client.

Large arguments and results travel between the client and the nodes on its machine through
files in ``/dev/shm`` (see ``_wire/serialize.py``); a probe file tells each node whether it
sees the client's ``/dev/shm``. Each is removed once read, every one of a pool when the
pool closes, and the agents remove their pool's when they exit. A client killed with
SIGKILL together with its agents (an OOM or cgroup kill), or one whose nodes are remote
(they cannot reach its ``/dev/shm``), would leave them behind: so every name says whose it
is, ``flotilla-<pool id>-<pid>.<start>.<pid namespace>-...`` (the client's process id, its
start time, which tells it from a later process with the same id, and its pid namespace,
outside which the id means nothing), and every pool start removes those whose client is
gone (:func:`sweep`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets

from .._node import procs
from .._wire.serialize import SHM_DIR, unlink_shm

logger = logging.getLogger("flotilla")

_OWNED = re.compile(rf"flotilla-[0-9a-f]+-{procs.OWNER}-")
"""A pool file's name: its pool, then its owner."""


def pool_prefix(pool_id: str) -> str:
    """The start of the names of pool ``pool_id``'s files: the pool and its owner (this
    process). The agents' own cleanup matches ``flotilla-<pool id>-``."""
    return f"flotilla-{pool_id}-{procs.owner_tag()}-"


def write_probe(prefix: str) -> dict[str, str]:
    """A probe file that nodes on this machine can read (then they use shared memory for
    large buffers, under ``prefix``): its name, token and the prefix; empty when
    ``/dev/shm`` cannot be written. Remove it with :func:`unlink_shm` once read."""
    # an unpredictable name, created new (never through a link or into a FIFO another
    # user planted in the shared folder)
    name = f"{prefix}probe-{secrets.token_hex(8)}"
    probe = {"name": name, "token": secrets.token_hex(16), "prefix": prefix}
    flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_WRONLY | os.O_CLOEXEC
    try:
        fd = os.open(os.path.join(SHM_DIR, name), flags, 0o600)
        try:
            os.write(fd, probe["token"].encode())
        finally:
            os.close(fd)
    except FileExistsError:  # not ours: left alone
        return {}
    except OSError:
        unlink_shm(name)
        return {}
    return probe


def remove_pool_files(prefix: str) -> None:
    """Remove every file of the pool whose names start with ``prefix`` (and that this
    user owns: what another user planted under such a name is left alone)."""
    me = os.geteuid()
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    if os.lstat(os.path.join(SHM_DIR, name)).st_uid == me:
                        unlink_shm(name)


def sweep() -> list[str]:
    """Remove the files of pools whose client is gone (killed before it could); their
    names. Files of clients in other pid namespaces (containers sharing ``/dev/shm``) are
    left alone: their process ids cannot be checked from here."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for name in procs.of_gone_owners(names, _OWNED):
        with contextlib.suppress(OSError):  # not ours to remove, or gone meanwhile
            unlink_shm(name)
            removed.append(name)
    if removed:
        logger.info("removed %d shared-memory file(s) of gone clients", len(removed))
    return removed
