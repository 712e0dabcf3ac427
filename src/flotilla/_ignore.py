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

:class:`Rules` is the archive builder's exclusion hook (``_archive``); it adds up what it
leaves out, so that the sync can say how much it did not send (a dataset or checkpoints
left out by a rule are the point; left in by a missing rule, they make a sync slow).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
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


class Rules:
    """The ignore rules of one folder, as an exclusion hook: ``rules(rel, is_dir)`` says
    whether to leave out ``rel`` (a ``/``-separated path below the folder) and counts what
    it leaves out in :attr:`excluded`. The archive builder asks about a folder before what
    it holds, and does not walk a folder left out.

    Attributes:
        root: the folder (absolute).
        sources: the top-level ignore files read (``.gitignore`` files of subfolders are
            read when the walk gets there).
        excluded: what was left out so far.
    """

    def __init__(self, root: str, extra: Iterable[str] = ()) -> None:
        from pathspec import GitIgnoreSpec

        self._spec_type = GitIgnoreSpec
        self.root = os.path.abspath(root)
        self.excluded = Excluded()
        lines: list[str] = list(DEFAULT_RULES)
        sources: list[str] = []
        for name in IGNORE_FILES:
            found = _read(os.path.join(self.root, name))
            if found is not None:
                sources.append(name)
                lines += found
        self._nested = not sources  # the .gitignore fallback, as git reads it
        if self._nested:
            found = _read(os.path.join(self.root, GITIGNORE))
            if found is not None:
                sources.append(GITIGNORE)
                lines += found
        lines += extra
        self.sources = tuple(sources)
        self._specs: dict[str, GitIgnoreSpec | None] = {"": GitIgnoreSpec.from_lines(lines)}

    def __call__(self, rel: str, is_dir: bool) -> bool:
        if not self.ignored(rel, is_dir):
            return False
        self.excluded.paths.append(rel + ("/" if is_dir else ""))
        _count(os.path.join(self.root, *rel.split("/")), is_dir, self.excluded)
        return True

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Whether ``rel`` is left out: the last rule that matches decides, and a deeper
        ``.gitignore`` comes after the ones above it (nothing is counted)."""
        verdict = False
        parts = rel.split("/")
        for depth in range(len(parts)):
            base = "/".join(parts[:depth])
            spec = self._spec(base)
            if spec is None:
                continue
            below = "/".join(parts[depth:]) + ("/" if is_dir else "")
            result = spec.check_file(below)
            if result.include is not None:
                verdict = result.include
        return verdict

    def _spec(self, base: str) -> GitIgnoreSpec | None:
        if base not in self._specs:
            found = None
            if self._nested:
                found = _read(os.path.join(self.root, *base.split("/"), GITIGNORE))
            self._specs[base] = None if found is None else self._spec_type.from_lines(found)
        return self._specs[base]


def load(root: str, extra: Iterable[str] = ()) -> Rules:
    """The rules of ``root``: built-in, the ignore files found there, then ``extra``."""
    return Rules(root, extra)


def _count(path: str, is_dir: bool, excluded: Excluded) -> None:
    if not is_dir:
        try:
            excluded.bytes += os.lstat(path).st_size
        except OSError:
            pass
        excluded.files += 1
        return
    for dirpath, _dirs, files in os.walk(path):
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
