"""The sync phase's archive: a task's ``workdir`` and ``file_mounts`` as one tar.gz.

Built on the client (the daemon runs there), sent to every node in one broadcast and
unpacked by :func:`flotilla.cli.node_ops.unpack`. Members: ``workdir/...`` for the workdir,
``m0``, ``m1``... (a file, or a folder and its contents) for the file mounts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .._archive import Source, glob_excludes
from .._archive import build as build_archive
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
    when there is nothing to sync. Reproducible (see :mod:`flotilla._archive`): an
    unchanged workdir has the same digest, however often its files were touched."""
    if not workdir and not file_mounts:
        return None
    sources: list[Source] = []
    if workdir:
        patterns = DEFAULT_EXCLUDES + _ignore_patterns(workdir)
        sources.append(Source(workdir, WORKDIR_MEMBER, glob_excludes(patterns)))
    targets: dict[str, str] = {}
    for i, (target, source) in enumerate(sorted(file_mounts.items())):
        targets[f"m{i}"] = target
        sources.append(Source(source, f"m{i}", glob_excludes(DEFAULT_EXCLUDES)))
    archive = build_archive(sources, level=1)
    return SyncArchive(archive.data, targets, archive.sha256, archive.files)


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
