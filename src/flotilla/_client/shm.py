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

A large argument's file is not removed after its call when it can be written again safely:
the pool keeps a few (:class:`Files`) and writes the next large arguments into one of them,
which saves creating (zeroing) and removing 100 MB of pages per broadcast. Safely means:
every process that mapped it has unmapped it again (a copy-on-write mapping still shows
later writes to the file in the pages its process did not write). Each call's executor
says so in its RESULT (``frames.UNMAPPED``); the file goes back to the pool only when every
call sent it said so (see ``node.Payload``). The files keep their names (and the pool's
prefix), so the pool's close and the sweep remove them as any other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass

from .._system import procs
from .._wire.serialize import (
    SHM_DIR,
    Pickled,
    create_shm,
    shm_layout,
    shm_unavailable,
    unlink_shm,
    write_buffers,
)

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


KEEP_FILES = 2
"""Files a pool keeps for the next large arguments, at most (see :class:`Files`)."""
KEEP_IDLE = 60.0
"""Seconds a kept file waits for a next call before it is removed (an idle pool gives its
shared memory back)."""


@dataclass(eq=False)
class File:
    """A shared-memory file the client wrote: its name, a descriptor open on it (it is
    never opened by name again: what the name shows may have changed) and its size."""

    name: str
    fd: int
    size: int
    kept_at: float = 0.0  # when it was given back to be kept (monotonic)


class Files:
    """A pool's shared-memory files for large arguments, kept for reuse.

    :meth:`write` writes a call's large buffers into a kept file (the one whose size is
    closest above theirs), or into a new one; :meth:`give` takes it back once no process
    maps it any more (else it is removed). At most :data:`KEEP_FILES` files and a quarter
    of ``/dev/shm`` are kept, each for :data:`KEEP_IDLE` s at most (:meth:`trim`);
    :meth:`close` removes them. Thread-safe."""

    def __init__(self, prefix: str, keep: int = KEEP_FILES, cap: int | None = None) -> None:
        self.prefix = prefix
        self.keep = keep
        self.cap = _quarter_of_shm() if cap is None else cap
        self._kept: list[File] = []  # oldest first
        self._lock = threading.Lock()
        self._closed = False

    def write(self, p: Pickled) -> File | None:
        """A file holding ``p``'s large buffers (see ``serialize.encode``); None when there
        are none, or shared memory cannot be used (then nothing is left behind and one
        warning per process says so: the buffers travel through the pipe)."""
        big, size = shm_layout(p)
        if not big:
            return None
        f = self._take(size)
        if f is None:
            try:
                name, fd = create_shm(self.prefix)
            except OSError as e:
                shm_unavailable(e)
                return None
            f = File(name, fd, 0)
        try:
            if f.size != size:  # (a smaller size frees the pages beyond it)
                os.ftruncate(f.fd, size)
                f.size = size
            write_buffers(f.fd, big)
        except OSError as e:  # typically ENOSPC: /dev/shm is full
            _remove(f)
            shm_unavailable(e)
            return None
        except BaseException:
            _remove(f)
            raise
        return f

    def give(self, f: File, reusable: bool) -> None:
        """``f``'s call is done: keep it for the next one if ``reusable`` (no process maps
        it any more), else remove it. The oldest kept files go beyond the limits."""
        removed = [f]
        with self._lock:
            if reusable and not self._closed and f.size <= self.cap:
                f.kept_at = time.monotonic()
                self._kept.append(f)
                removed = []
                while len(self._kept) > self.keep or self._bytes() > self.cap:
                    removed.append(self._kept.pop(0))
        for old in removed:
            _remove(old)

    def trim(self, now: float) -> None:
        """Remove the files kept for more than :data:`KEEP_IDLE` s by ``now`` (monotonic)."""
        if not self._kept:  # (most ticks: no lock)
            return
        with self._lock:
            old = [f for f in self._kept if now - f.kept_at > KEEP_IDLE]
            self._kept = [f for f in self._kept if f not in old]
        for f in old:
            _remove(f)

    def close(self) -> None:
        """Remove the kept files; those given back later are removed too."""
        with self._lock:
            self._closed = True
            kept, self._kept = self._kept, []
        for f in kept:
            _remove(f)

    @property
    def kept(self) -> list[str]:
        """The names of the files kept now."""
        with self._lock:
            return [f.name for f in self._kept]

    def _take(self, size: int) -> File | None:
        """The kept file best for ``size`` bytes (the smallest that holds them, else the
        largest), taken out of the pool; None if none is kept. A file whose name no longer
        shows it (an agent of the pool removed the pool's files when it exited) is
        dropped: its name could now be anyone's."""
        while True:
            with self._lock:
                if not self._kept:
                    return None
                holds = [f for f in self._kept if f.size >= size]
                f = min(holds, key=_size) if holds else max(self._kept, key=_size)
                self._kept.remove(f)
            if _named(f):
                return f
            _remove(f)

    def _bytes(self) -> int:
        return sum(f.size for f in self._kept)


def _size(f: File) -> int:
    return f.size


def _named(f: File) -> bool:
    """Whether ``f``'s name still shows ``f`` (the same file, still linked there)."""
    try:
        named = os.lstat(os.path.join(SHM_DIR, f.name))
        held = os.fstat(f.fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino) and held.st_nlink > 0


def _remove(f: File) -> None:
    """Remove ``f`` (its name only if that still shows it) and close its descriptor."""
    try:
        if _named(f):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, f.name))
    finally:
        os.close(f.fd)


def _quarter_of_shm() -> int:
    """A quarter of ``/dev/shm``'s size: the most a pool keeps there between calls."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize // 4
