"""File locks shared by processes of one machine: one flock helper for the node side and the
command line (environment builds, file-mount syncs, cluster state files).

An ``flock`` is released by the kernel when its file descriptor closes, so a process that
dies (kill -9 included) never leaves a lock held. Lock files are never removed: removing one
while another process waits on it would let two processes "hold" different files at once.
Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterator

from .private import locks_dir, open_private_file


@contextlib.contextmanager
def exclusive(path: str | os.PathLike[str]) -> Iterator[int]:
    """Hold an exclusive flock on ``path`` (created, mode 0600, if missing) for the block;
    waits while another process holds it. The file is opened through
    :func:`~flotilla._system.private.open_private_file`: in a folder verified private, never
    through a symlink, and only when this user owns it. Yields its descriptor."""
    fd = open_private_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # closing releases the lock


def named(key: str) -> contextlib.AbstractContextManager[int]:
    """An exclusive lock for ``key`` (e.g. a path several nodes of this machine write to),
    shared by every process of this user on this machine. Its file lives under
    ``$FLOTILLA_HOME/locks`` (private to the user), never in the shared temp folder where
    another user could take the name first or plant a symlink."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return exclusive(locks_dir() / f"{digest}.lock")
