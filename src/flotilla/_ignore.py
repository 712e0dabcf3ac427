"""Which files of a folder to leave out when it is synced, with gitignore's semantics.

The rules of a synced folder (a task's ``workdir``) come from, in this order:

1. the built-in excludes (``.git``, ``__pycache__``, virtual environments...);
2. ``.skyignore`` and ``.flotillaignore`` at the folder's top (SkyPilot's file and
   flotilla's; both are read when both exist);
3. when neither exists: ``.gitignore`` files, the top one and those of subfolders, each
   applying below its own folder, as git applies them.

Patterns follow gitignore (matched with ``pathspec``): ``data/raw`` and ``/ckpt`` are
anchored to the file's folder, ``*.pt`` matches at any depth, ``logs/`` only folders,
``**`` any number of folders, and ``!keep.pt`` re-includes what an earlier pattern left
out (not inside a folder that is itself left out, as in git).

:func:`walk` yields what to sync and adds up what it left out, so that the sync can say
how much it did not send (a dataset or checkpoints left out by a rule are the point;
left in by a missing rule, they are what makes a sync slow).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._image import DEFAULT_EXCLUDES

if TYPE_CHECKING:
    from pathspec import GitIgnoreSpec

DEFAULT_RULES = DEFAULT_EXCLUDES
"""Left out of every sync (as gitignore patterns: a bare name matches at any depth)."""
IGNORE_FILES = (".skyignore", ".flotillaignore")
"""Files at the top of a synced folder listing patterns to leave out (gitignore syntax)."""
GITIGNORE = ".gitignore"


@dataclass
class Excluded:
    """What a walk left out.

    Attributes:
        files: files left out (those inside left-out folders included).
        bytes: their total size.
        paths: the left-out entries as the rules named them (a folder once, not its files).
    """

    files: int = 0
    bytes: int = 0
    paths: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """``"3 files (1.2 GB)"``: for the sync's message."""
        return f"{self.files} file(s) ({human_size(self.bytes)})"


@dataclass(frozen=True)
class Rules:
    """The ignore rules of one folder.

    Attributes:
        root: the folder (absolute).
        sources: the ignore files read, relative to ``root`` (``.gitignore`` files of
            subfolders are found during the walk and not listed here).
        nested_gitignore: whether subfolders' ``.gitignore`` files apply (the fallback).
    """

    root: str
    sources: tuple[str, ...]
    nested_gitignore: bool
    top: GitIgnoreSpec

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Whether ``rel`` (a ``/``-separated path under ``root``) is left out by the
        top-level rules (subfolders' ``.gitignore`` files are applied by :func:`walk`)."""
        return _ignored([("", self.top)], rel, is_dir)


def load(root: str, extra: Iterable[str] = ()) -> Rules:
    """The rules of ``root``: built-in, the ignore files found there, then ``extra``."""
    from pathspec import GitIgnoreSpec

    root = os.path.abspath(root)
    lines: list[str] = list(DEFAULT_RULES)
    sources: list[str] = []
    for name in IGNORE_FILES:
        found = _read(os.path.join(root, name))
        if found is not None:
            sources.append(name)
            lines += found
    nested = not sources
    if nested:
        found = _read(os.path.join(root, GITIGNORE))
        if found is not None:
            sources.append(GITIGNORE)
            lines += found
    lines += extra
    return Rules(root, tuple(sources), nested, GitIgnoreSpec.from_lines(lines))


def walk(rules: Rules, excluded: Excluded | None = None) -> Iterator[tuple[str, str]]:
    """``(absolute path, relative path)`` of every entry to sync under ``rules.root``,
    folders before their contents, in sorted order; what is left out is added to
    ``excluded``. Symbolic links are yielded, never followed."""
    from pathspec import GitIgnoreSpec

    specs: list[tuple[str, GitIgnoreSpec]] = [("", rules.top)]
    yield from _walk(rules, rules.root, "", specs, excluded, GitIgnoreSpec)


def _walk(
    rules: Rules,
    folder: str,
    rel: str,
    specs: list[tuple[str, GitIgnoreSpec]],
    excluded: Excluded | None,
    spec_type: type[GitIgnoreSpec],
) -> Iterator[tuple[str, str]]:
    if rules.nested_gitignore and rel:
        found = _read(os.path.join(folder, GITIGNORE))
        if found is not None:
            specs = [*specs, (rel + "/", spec_type.from_lines(found))]
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        child = f"{rel}/{entry.name}" if rel else entry.name
        is_dir = entry.is_dir(follow_symlinks=False)
        if _ignored(specs, child, is_dir):
            if excluded is not None:
                excluded.paths.append(child + ("/" if is_dir else ""))
                _count(entry, is_dir, excluded)
            continue
        yield entry.path, child
        if is_dir:
            yield from _walk(rules, entry.path, child, specs, excluded, spec_type)


def _ignored(specs: list[tuple[str, GitIgnoreSpec]], rel: str, is_dir: bool) -> bool:
    """The last rule that matches decides; a deeper ``.gitignore`` comes after."""
    verdict = False
    for base, spec in specs:
        if not rel.startswith(base):
            continue
        result = spec.check_file(rel[len(base) :] + ("/" if is_dir else ""))
        if result.include is not None:
            verdict = result.include
    return verdict


def _count(entry: os.DirEntry[str], is_dir: bool, excluded: Excluded) -> None:
    if not is_dir:
        try:
            excluded.bytes += entry.stat(follow_symlinks=False).st_size
        except OSError:
            pass
        excluded.files += 1
        return
    for dirpath, _dirs, files in os.walk(entry.path):
        for name in files:
            try:
                excluded.bytes += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
            excluded.files += 1


def _read(path: str) -> list[str] | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def human_size(n: int) -> str:
    """``1536`` -> ``"1.5 KB"``."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"
