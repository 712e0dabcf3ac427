"""Private folders and files: everything flotilla creates lives in a folder it has checked.

On a shared machine (a SLURM login node, a lab server) other local users can create files
and folders at names flotilla would use, or symlinks to where they like. So every folder
flotilla keeps files, locks or sockets in is *created fresh or verified*: opened without
following a symlink (``O_NOFOLLOW | O_DIRECTORY``), then checked on the open descriptor
(``fstat``, no race between check and use) to be owned by this user and not writable by
anyone else. Anything else is refused with a :class:`ConfigurationError` naming the folder
and the fix; nothing is ever created in a folder that failed the check.

Standard library only (node side): nodes take their locks under ``FLOTILLA_HOME`` too; the
client and the command line use it for everything they keep on disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from .._errors import ConfigurationError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def flotilla_home() -> Path:
    """``$FLOTILLA_HOME``, or ``~/.flotilla`` (not checked: see :func:`private_dir`)."""
    return Path(os.path.expanduser(os.environ.get("FLOTILLA_HOME") or "~/.flotilla"))


def _refuse(path: Path | str, problem: str, fix: str) -> ConfigurationError:
    return ConfigurationError(
        f"{path}: {problem}; flotilla keeps its files only in folders owned by you "
        f"(uid {os.geteuid()}) that nobody else can write to. Fix: {fix}"
    )


def open_private_dir(path: Path | str, create: bool = True) -> int:
    """An open descriptor of the folder ``path``, created (mode 0700, parents as needed)
    or verified: a real folder (not a symlink), owned by this user, not writable by group
    or others. Group/other read access on a folder of ours is removed. The caller closes
    the descriptor."""
    path = Path(path)
    if create:
        with contextlib.suppress(FileExistsError):
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.mkdir(path, 0o700)
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(
                path,
                "is a symlink or not a folder",
                f"remove it (rm {path}) so that flotilla creates the folder itself, or set "
                "FLOTILLA_HOME to a folder of yours",
            ) from None
        raise _refuse(
            path, f"cannot be opened ({e.strerror or e})", "check the path and its parents"
        ) from None
    try:
        _check_owned(fd, path, "folder")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_owned(fd: int, path: Path | str, what: str) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise _refuse(
            path,
            f"this {what} belongs to uid {st.st_uid}, not to you",
            "remove it (as its owner or root) or set FLOTILLA_HOME to a folder of yours",
        )
    if st.st_mode & 0o022:
        raise _refuse(
            path,
            f"this {what} is writable by others (mode {stat.S_IMODE(st.st_mode):o}), so its "
            "contents cannot be trusted",
            f"remove it (rm -r {path}) and let flotilla create it, or chmod go-w {path} "
            "after checking what is inside",
        )
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o077:
        os.fchmod(fd, 0o700)  # ours and not writable by others: tightening is harmless


def private_dir(path: Path | str, create: bool = True) -> Path:
    """``path`` once :func:`open_private_dir` accepted (or created) it."""
    os.close(open_private_dir(path, create))
    return Path(path)


def private_dirs(*paths: Path | str) -> None:
    """:func:`private_dir` for each of ``paths``, in order (parents first)."""
    for path in paths:
        private_dir(path)


def open_private_file(path: str | os.PathLike[str], flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """Open (by default create) the file ``path`` inside a verified folder: never through
    a symlink, and refused unless it is a regular file owned by this user. The folder is
    checked (and created) first. The caller closes the descriptor."""
    path = Path(path)
    os.close(open_private_dir(path.parent))
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "is a symlink", f"remove it (rm {path})") from None
        raise _refuse(
            path, f"cannot be opened ({e.strerror or e})", f"check {path} and its folder"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "is not a regular file", f"remove it (rm {path})")
        _check_owned(fd, path, "file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def locks_dir() -> Path:
    """``$FLOTILLA_HOME/locks``: locks shared by every flotilla process of this user on
    this machine (never in the shared temp folder, where others could take the name)."""
    return flotilla_home() / "locks"


@contextlib.contextmanager
def socket_address(path: Path | str) -> Iterator[str]:
    """An address to ``bind`` or ``connect`` the Unix socket ``path`` by, valid inside
    the block: ``/proc/self/fd/N/NAME`` where N is the verified folder of ``path``, held
    open. Going through the checked descriptor means a folder swapped after the check
    cannot redirect the socket, and the address stays short whatever the folder's path
    (``sun_path`` holds 108 bytes): no fallback into a shared folder is ever needed."""
    path = Path(path)
    fd = open_private_dir(path.parent)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)
