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
import stat
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def exclusive(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created, mode 0600, if missing) for the block;
    waits while another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def named(key: str) -> contextlib.AbstractContextManager[None]:
    """An exclusive lock for ``key`` (e.g. a path several nodes of this machine write to),
    shared by every process of this user on this machine. Its file lives in a folder only
    this user can write (:func:`private_dir`), never directly in the shared temp folder."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return exclusive(os.path.join(private_dir(), f"{digest}.lock"))


def private_dir() -> str:
    """``$TMPDIR/flotilla-<uid>``: created mode 0700; refused when another user owns it or
    others can write to it (someone could then plant files flotilla trusts)."""
    folder = os.path.join(tempfile.gettempdir(), f"flotilla-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        raise PermissionError(
            f"{folder} is not a folder private to this user (uid {os.getuid()}): "
            "remove it, or set TMPDIR to a folder of your own"
        )
    return folder
