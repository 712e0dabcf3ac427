"""Reproducible archives (flotilla._archive): one rule for the Image includes, the SSH
bundle and the sync archive. Real files, real tar and gzip; no pool is started."""

from __future__ import annotations

import calendar
import io
import os
import tarfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

import flotilla as sky
from flotilla._archive import MTIME, Source, build, glob_excludes
from flotilla._providers import bootstrap
from flotilla.cli import sync
from flotilla.cli.node_ops import unpack


def _tree(root: Path, mode: int = 0o644) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "sub" / "b.py").write_text("B = 2\n")
    (root / "pkg" / "a.py").write_text("A = 1\n")
    (root / "pkg-data.txt").write_text("data\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    for f in root.rglob("*"):
        if f.is_file():
            f.chmod(mode)
    (root / "run.sh").chmod(0o750 if mode == 0o640 else 0o755)
    return root


def _members(data: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return tar.getmembers()


def test_equal_content_gives_equal_bytes_whatever_times_owners_and_modes(tmp_path: Path) -> None:
    a = _tree(tmp_path / "a")
    b = _tree(tmp_path / "b", mode=0o640)  # other permission bits, same executable bits
    os.utime(b / "pkg" / "a.py", (1, 1))
    if os.geteuid() == 0:
        os.chown(b / "pkg" / "a.py", 1234, 1234)
    first = build([Source(str(a), "x")])
    second = build([Source(str(b), "x")])
    assert first.data == second.data and first.sha256 == second.sha256
    assert first.files == 5
    (b / "pkg" / "a.py").write_text("A = 3\n")
    assert build([Source(str(b), "x")]).sha256 != first.sha256


def test_members_follow_the_one_rule(tmp_path: Path) -> None:
    root = _tree(tmp_path / "t")
    os.symlink("pkg/a.py", root / "link")
    os.link(root / "pkg" / "a.py", root / "hard.py")
    os.mkfifo(root / "fifo")  # left out: reading it would block
    members = _members(build([Source(str(root), "x")]).data)
    names = [m.name for m in members]
    assert names == [
        "x",
        "x/hard.py",
        "x/link",
        "x/pkg",
        "x/pkg/__init__.py",
        "x/pkg/a.py",
        "x/pkg/sub",
        "x/pkg/sub/b.py",
        "x/pkg-data.txt",
        "x/run.sh",
    ]  # depth-first, each folder's entries sorted, a folder before what it holds
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(MTIME, 0, 0, "", "")}
    modes = {m.name: (m.type, m.mode) for m in members}
    assert modes["x/pkg"] == (tarfile.DIRTYPE, 0o755)
    assert modes["x/run.sh"] == (tarfile.REGTYPE, 0o755)
    assert modes["x/pkg/a.py"] == modes["x/hard.py"] == (tarfile.REGTYPE, 0o644)
    link = next(m for m in members if m.name == "x/link")
    assert link.issym() and link.linkname == "pkg/a.py"


def test_exclude_sees_relative_paths_and_prunes_folders(tmp_path: Path) -> None:
    root = _tree(tmp_path / "t")
    seen: list[tuple[str, bool]] = []

    def exclude(rel: str, is_dir: bool) -> bool:
        seen.append((rel, is_dir))
        return rel == "pkg/sub"

    names = [m.name for m in _members(build([Source(str(root), "x", exclude)]).data)]
    assert "x/pkg/sub" not in names and "x/pkg/sub/b.py" not in names
    assert ("pkg/sub", True) in seen and ("pkg/a.py", False) in seen
    assert not any(rel.startswith("pkg/sub/") for rel, _ in seen)  # not walked


def test_glob_excludes_match_base_names_but_never_the_source_itself(tmp_path: Path) -> None:
    root = tmp_path / "__pycache__"  # a source named like an excluded entry
    (root / "deep" / "__pycache__").mkdir(parents=True)
    (root / "deep" / "__pycache__" / "m.pyc").write_bytes(b"")
    (root / "deep" / "keep.py").write_text("")
    exclude = glob_excludes(["__pycache__", "*.pyc"])
    names = [m.name for m in _members(build([Source(str(root), "src", exclude)]).data)]
    assert names == ["src", "src/deep", "src/deep/keep.py"]


def test_a_source_that_is_a_link_is_followed(tmp_path: Path) -> None:
    real = _tree(tmp_path / "real")
    os.symlink(real, tmp_path / "alias")
    via_link = build([Source(str(tmp_path / "alias"), "x")])
    assert via_link.data == build([Source(str(real), "x")]).data
    with pytest.raises(FileNotFoundError):
        build([Source(str(tmp_path / "missing"), "x")])


Builder = Callable[[Path], bytes]


def _includes(root: Path) -> bytes:
    return sky.Image(includes=[str(root / "pkg")]).includes_archive()


def _bundle(root: Path) -> bytes:
    return bootstrap.build_bundle({"pkg": str(root / "pkg")}).data


def _sync(root: Path) -> bytes:
    archive = sync.build(str(root), {"data": str(root / "pkg-data.txt")})
    assert archive is not None
    return archive.data


@pytest.mark.parametrize("builder", [_includes, _bundle, _sync], ids=["includes", "bundle", "sync"])
def test_every_archive_flotilla_ships_uses_the_rule(tmp_path: Path, builder: Builder) -> None:
    a = _tree(tmp_path / "a")
    b = _tree(tmp_path / "b", mode=0o640)
    os.utime(b / "pkg" / "a.py", (1, 1))
    (a / "pkg" / "__pycache__").mkdir()
    (a / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert builder(a) == builder(b)
    data = builder(a)
    if data.startswith(b"PK"):  # the bundle, a zip: no owners
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            stamps = {(calendar.timegm((*i.date_time, 0, 0, 0)), 0, 0) for i in z.infolist()}
            names = z.namelist()
    else:
        members = _members(data)
        stamps = {(m.mtime, m.uid, m.gid) for m in members}
        names = [m.name for m in members]
    assert stamps == {(MTIME, 0, 0)}
    assert not [n for n in names if "__pycache__" in n]


def test_unpacked_sync_files_carry_the_time_they_were_unpacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every archive carries one fixed time, so an edit that keeps a module's size would
    look unchanged to Python's byte-code cache (time + size) on the node, which would then
    import the old code: the node stamps what it unpacks with the time it unpacks it."""
    project = _tree(tmp_path / "project")
    node = tmp_path / "node"
    node.mkdir()
    monkeypatch.chdir(node)
    archive = sync.build(str(project), {"cfg/data.txt": str(project / "pkg-data.txt")})
    assert archive is not None
    before = int(time.time())
    assert unpack.local(archive.data, archive.targets, True) == 8
    for path in (node / "pkg" / "a.py", node / "run.sh", node / "cfg" / "data.txt"):
        assert path.stat().st_mtime >= before > MTIME
