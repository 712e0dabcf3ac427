"""The sync phase's archive: a task's ``workdir`` and ``file_mounts`` as one tar.gz.

Built on the client (the daemon runs there), sent to every node in one broadcast and
unpacked by :func:`flotilla.cli.node_ops.unpack`. Members: ``workdir/...`` for the workdir,
``m0``, ``m1``... (a file, or a folder and its contents) for the file mounts.

The workdir goes without what its ignore files leave out (``.skyignore``,
``.flotillaignore``, else ``.gitignore``; gitignore's rules, see :mod:`flotilla._ignore`);
the archive says how much that was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .._archive import Source, glob_excludes
from .._archive import build as build_archive
from .._ignore import Excluded, Rules
from .._image import DEFAULT_EXCLUDES
from .node_ops import WORKDIR_MEMBER


@dataclass(frozen=True)
class SyncArchive:
    """What to send to every node.

    Attributes:
        data: the tar.gz bytes.
        targets: archive member -> node path, for the file mounts.
        digest: sha256 of ``data``; nodes that got this digest already need nothing.
        files: number of files in the archive.
        excluded: what the workdir's rules left out.
        rules: the workdir's ignore files that were read (none: the built-in rules only).
    """

    data: bytes
    targets: dict[str, str]
    digest: str
    files: int
    excluded: Excluded = field(default_factory=Excluded)
    rules: tuple[str, ...] = ()


def build(workdir: str | None, file_mounts: Mapping[str, str]) -> SyncArchive | None:
    """The archive of ``workdir`` and ``file_mounts`` (node path -> local path), or None
    when there is nothing to sync. Reproducible (see :mod:`flotilla._archive`): an
    unchanged workdir has the same digest, however often its files were touched."""
    if not workdir and not file_mounts:
        return None
    sources: list[Source] = []
    rules = Rules(workdir) if workdir else None
    if workdir and rules is not None:
        sources.append(Source(workdir, WORKDIR_MEMBER, rules))
    targets: dict[str, str] = {}
    for i, (target, source) in enumerate(sorted(file_mounts.items())):
        targets[f"m{i}"] = target
        sources.append(Source(source, f"m{i}", glob_excludes(DEFAULT_EXCLUDES)))
    archive = build_archive(sources, level=1)
    if rules is None:
        return SyncArchive(archive.data, targets, archive.sha256, archive.files)
    return SyncArchive(
        archive.data, targets, archive.sha256, archive.files, rules.excluded, rules.sources
    )
