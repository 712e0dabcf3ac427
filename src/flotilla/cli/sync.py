"""The sync phase's archive: a task's ``workdir`` and ``file_mounts`` as one tar.gz.

Built on the client (the daemon runs there), sent to every node in one broadcast and
unpacked by :func:`flotilla.cli.node_ops.unpack`. Members: ``workdir/...`` for the workdir,
``m0``, ``m1``... (a file, or a folder and its contents) for the file mounts.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .._image import DEFAULT_EXCLUDES
from .node_ops import WORKDIR_MEMBER

IGNORE_FILES = (".flotillaignore", ".skyignore")
"""Files in the workdir listing more patterns to leave out, one per line."""


@dataclass(frozen=True)
class SyncArchive:
    """What to send to every node.

    Attributes:
        data: the tar.gz bytes.
        targets: archive member -> node path, for the file mounts.
        digest: sha256 of ``data``; nodes that got this digest already need nothing.
        files: number of files in the archive.
    """

    data: bytes
    targets: dict[str, str]
    digest: str
    files: int


def build(workdir: str | None, file_mounts: Mapping[str, str]) -> SyncArchive | None:
    """The archive of ``workdir`` and ``file_mounts`` (node path -> local path), or None
    when there is nothing to sync."""
    if not workdir and not file_mounts:
        return None
    buf = io.BytesIO()
    targets: dict[str, str] = {}
    files = 0
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=1) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        if workdir:
            patterns = DEFAULT_EXCLUDES + _ignore_patterns(workdir)
            files += _add(tar, workdir, WORKDIR_MEMBER, patterns, top=True)
        for i, (target, source) in enumerate(sorted(file_mounts.items())):
            key = f"m{i}"
            targets[key] = target
            files += _add(tar, source, key, DEFAULT_EXCLUDES, top=True)
    data = buf.getvalue()
    return SyncArchive(data, targets, hashlib.sha256(data).hexdigest(), files)


def _ignore_patterns(workdir: str) -> tuple[str, ...]:
    out: list[str] = []
    for name in IGNORE_FILES:
        try:
            with open(os.path.join(workdir, name)) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        out.extend(
            line.strip().strip("/") for line in lines if line.strip() and not line.startswith("#")
        )
    return tuple(out)


def _add(tar: tarfile.TarFile, path: str, arc: str, patterns: tuple[str, ...], top: bool) -> int:
    count = 0
    for src, name in _walk(path, arc, patterns, top):
        info = tar.gettarinfo(src, arcname=name)
        info.uid, info.gid, info.uname, info.gname = 0, 0, "", ""
        if info.isfile():
            with open(src, "rb") as f:
                tar.addfile(info, f)
            count += 1
        else:
            tar.addfile(info)
    return count


def _walk(path: str, arc: str, patterns: tuple[str, ...], top: bool) -> Iterator[tuple[str, str]]:
    name = os.path.basename(path)
    if not top and any(fnmatch.fnmatch(name, p) for p in patterns):
        return
    yield path, arc
    if os.path.isdir(path) and not os.path.islink(path):
        for entry in sorted(os.listdir(path)):
            yield from _walk(os.path.join(path, entry), f"{arc}/{entry}", patterns, False)
