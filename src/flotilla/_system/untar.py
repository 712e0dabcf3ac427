"""The one safe archive extraction of the node side: includes, workdir sync.

``tarfile``'s ``filter="data"`` exists from Python 3.11.4 (and 3.12) on; Debian 12's Python
is 3.11.2. On every version :func:`extract` first checks every member itself, refusing the
whole archive (nothing is written) when a member

* has an absolute name or a ``..`` component,
* is a symbolic or hard link whose target lies outside the destination,
* is a device, a FIFO or any other special file;

then extracts with the filter where it exists; elsewhere, as the filter does, extracted
files get neither their recorded owner nor set-user-ID,
set-group-ID or sticky bits, and their permissions are taken from the archive without
letting others write.

Standard library only, and self-contained.
"""

from __future__ import annotations

import copy
import os
import tarfile
from collections.abc import Iterable


class UnsafeArchive(Exception):
    """An archive member that would write outside the destination or make a special file."""


def extract(
    tar: tarfile.TarFile, dest: str, members: Iterable[tarfile.TarInfo] | None = None
) -> None:
    """Extract ``members`` (default: all) of ``tar`` below ``dest``, safely on every
    Python >= 3.11 (see the module docstring). Raises UnsafeArchive before writing
    anything when a member breaks a rule."""
    chosen = list(tar.getmembers() if members is None else members)
    checked = [_checked(m, dest) for m in chosen]  # all first: a bad archive writes nothing
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, chosen, filter="data")  # the same rules, tarfile's own way
    else:
        tar.extractall(dest, checked)


def _checked(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """``member`` made safe to extract below ``dest`` without ``filter=`` (a copy with
    this user as owner and tame permissions); UnsafeArchive when it cannot be."""
    name = member.name
    parts = name.replace(os.sep, "/").split("/")
    if name.startswith(("/", os.sep)) or ".." in parts:
        raise UnsafeArchive(f"{name!r} would be written outside {dest}")
    root = os.path.realpath(dest)
    target = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, target]) != root:
        raise UnsafeArchive(f"{name!r} would be written outside {dest}")
    if member.issym() or member.islnk():
        link = member.linkname
        base = os.path.dirname(target) if member.issym() else root
        if (
            os.path.isabs(link)
            or os.path.commonpath([root, os.path.realpath(os.path.join(base, link))]) != root
        ):
            raise UnsafeArchive(f"{name!r} links to {link!r}, outside {dest}")
    elif not (member.isfile() or member.isdir()):
        raise UnsafeArchive(f"{name!r} is a special file (device, FIFO...)")
    safe = copy.copy(member)  # (TarInfo.replace is 3.11.4's too)
    safe.uid, safe.gid, safe.uname, safe.gname = os.getuid(), os.getgid(), "", ""
    if member.isfile() or member.isdir():
        mode = member.mode & 0o755
        if member.isfile() and not mode & 0o100:
            mode &= 0o644
        safe.mode = mode | (0o700 if member.isdir() else 0o600)
    return safe
