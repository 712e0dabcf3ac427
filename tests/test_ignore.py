"""Ignore files for synced folders: gitignore semantics, the .gitignore fallback, sizes."""

from __future__ import annotations

import os
from pathlib import Path

from flotilla._ignore import Excluded, Rules, human_size, load


def make(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def walk(rules: Rules, folder: str = "", rel: str = "") -> list[str]:
    """The files an archive builder keeps: asks about a folder before what it holds."""
    kept: list[str] = []
    for name in sorted(os.listdir(os.path.join(rules.root, folder))):
        child = f"{rel}/{name}" if rel else name
        path = os.path.join(rules.root, child)
        is_dir = os.path.isdir(path) and not os.path.islink(path)
        if rules(child, is_dir):
            continue
        kept += walk(rules, child, child) if is_dir else [child]
    return kept


def synced(root: Path, excluded: Excluded | None = None) -> list[str]:
    rules = load(str(root))
    kept = walk(rules)
    if excluded is not None:
        excluded.__dict__.update(rules.excluded.__dict__)
    return kept


TREE = {
    "train.py": "x",
    "data/raw/a.bin": "x" * 1000,
    "data/raw/b.bin": "x" * 24,
    "data/small.csv": "x",
    "ckpt/last.pt": "x" * 100,
    "sub/ckpt/notes.txt": "x",
    "sub/model.pt": "x" * 10,
    "sub/keep.pt": "x",
    "logs/run.txt": "x",
    "sub/logs": "a file named like the folder rule",
    ".git/HEAD": "x",
    "pkg/__pycache__/m.pyc": "x",
}


def test_skyignore_nested_anchored_and_reincluded(tmp_path: Path) -> None:
    make(tmp_path, TREE)
    (tmp_path / ".skyignore").write_text(
        "# comments and blank lines are fine\n\ndata/raw\n/ckpt\n*.pt\n!keep.pt\nlogs/\n"
    )
    excluded = Excluded()
    assert sorted(synced(tmp_path, excluded)) == [
        ".skyignore",
        "data/small.csv",
        "sub/ckpt/notes.txt",  # /ckpt is anchored to the top
        "sub/keep.pt",  # re-included by !keep.pt
        "sub/logs",  # logs/ names folders only
        "train.py",
    ]
    assert "data/raw/" in excluded.paths and "ckpt/" in excluded.paths
    # data/raw (1024) + ckpt (100) + sub/model.pt (10) + logs (1) + .git + __pycache__ (2)
    assert excluded.bytes == 1024 + 100 + 10 + 1 + 2
    assert excluded.files == 7


def test_flotillaignore_and_skyignore_both_apply(tmp_path: Path) -> None:
    make(tmp_path, {"a.txt": "", "b.txt": "", "c.txt": ""})
    (tmp_path / ".skyignore").write_text("a.txt\n")
    (tmp_path / ".flotillaignore").write_text("b.txt\n")
    assert sorted(synced(tmp_path)) == [".flotillaignore", ".skyignore", "c.txt"]


def test_gitignore_is_the_fallback_with_nested_files(tmp_path: Path) -> None:
    make(tmp_path, {**TREE, "sub/deep/x.tmp": "", "y.tmp": ""})
    (tmp_path / ".gitignore").write_text("data/\n*.pt\n")
    (tmp_path / "sub" / ".gitignore").write_text("*.tmp\n!keep.pt\n")
    rules = load(str(tmp_path))
    assert rules.sources == (".gitignore",)
    got = synced(tmp_path)
    assert "data/small.csv" not in got and "ckpt/last.pt" not in got
    assert "sub/deep/x.tmp" not in got  # sub/.gitignore applies below sub
    assert "y.tmp" in got  # ... and not above it
    assert "sub/keep.pt" in got  # re-included by the deeper file
    assert "sub/model.pt" not in got


def test_gitignore_is_not_read_when_a_skyignore_exists(tmp_path: Path) -> None:
    make(tmp_path, {"a.pt": "", "b.txt": ""})
    (tmp_path / ".gitignore").write_text("*.pt\n")
    (tmp_path / ".skyignore").write_text("b.txt\n")
    assert sorted(synced(tmp_path)) == [".gitignore", ".skyignore", "a.pt"]


def test_builtin_rules_without_any_file(tmp_path: Path) -> None:
    make(tmp_path, {"main.py": "", ".venv/bin/python": "", "pkg/__pycache__/x.pyc": ""})
    assert synced(tmp_path) == ["main.py"]


def test_human_size() -> None:
    assert human_size(10) == "10 B"
    assert human_size(1536) == "1.5 KB"
    assert human_size(3 * 1024**3) == "3.0 GB"
