"""Reproducible tar.gz archives: equal content gives equal bytes, hence an equal hash.

Everything flotilla ships to nodes as files is an archive built here, and its sha256 names
it on the node, so an unchanged input is never sent or unpacked twice:

* an Image's ``includes`` (:meth:`flotilla.Image.includes_archive`), part of the Image's
  content hash;
* the flotilla bundle shipped to SSH hosts (:mod:`flotilla._providers.bootstrap`), a zip
  kept on a node as the file ``lib/<hash>``;
* a task's ``workdir`` and ``file_mounts`` (:mod:`flotilla.cli.sync`), not sent again
  while its digest is unchanged.

One rule makes them reproducible; only names, content, link targets and the executable
bit go in:

* members in depth-first order, each folder's entries sorted by name, a folder before
  what it holds;
* every member's time is :data:`MTIME`, its owner 0:0 without user or group names;
* permissions as git keeps them: 0o755 for folders and for files with an executable bit,
  0o644 for the other files;
* symbolic links below a source are stored as links; a source that is itself a link is
  followed (the caller named it); sockets, FIFOs and devices are left out;
* a regular file is always stored whole (never as a hard link to an earlier member);
* the gzip header has no file name and no time.

:func:`build_zip` makes the same kind of reproducible archive as a zip (Python imports
modules straight from it, ``zipimport``): the flotilla bundle.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import stat
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

MTIME = 1_600_000_000
"""Every member's modification time (2020-09-13). Fixed, so that touching a file does not
change the archive; after 1980, so that unpacked files can go into zip files."""

Exclude = Callable[[str, bool], bool]
"""``exclude(relpath, is_dir)``: whether to leave out an entry below a source; ``relpath`` is
its path relative to the source, with ``/`` separators. A left-out folder is not walked."""


@dataclass(frozen=True)
class Source:
    """One thing to put in an archive.

    Attributes:
        path: a local file or folder (a folder goes in with everything below it).
        name: its name in the archive; what it holds goes under ``name/``.
        exclude: what to leave out below it (None: nothing).
    """

    path: str
    name: str
    exclude: Exclude | None = None


@dataclass(frozen=True)
class Archive:
    """A reproducible tar.gz.

    Attributes:
        data: the archive's bytes.
        sha256: the hex sha256 of ``data``.
        files: the number of regular files in it.
    """

    data: bytes
    sha256: str
    files: int


def glob_excludes(patterns: Iterable[str]) -> Exclude:
    """An :data:`Exclude` leaving out every entry whose base name matches one of the glob
    ``patterns`` (``.git``, ``*.pyc``...), at any depth."""
    pats = tuple(patterns)

    def exclude(relpath: str, is_dir: bool) -> bool:
        name = relpath.rpartition("/")[2]
        return any(fnmatch.fnmatch(name, p) for p in pats)

    return exclude


def build(sources: Iterable[Source], *, level: int = 6) -> Archive:
    """The archive of ``sources``, in the order given.

    ``level`` is gzip's compression level: it changes the size, never the reproducibility.
    Raises FileNotFoundError for a source that does not exist.
    """
    buf = io.BytesIO()
    files = 0
    with (
        gzip.GzipFile(filename="", fileobj=buf, mode="wb", mtime=0, compresslevel=level) as gz,
        io.BufferedWriter(gz, 1 << 20) as batched,  # tar writes 512-byte blocks: batch them
        tarfile.open(fileobj=batched, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for src in sources:
            for entry, arcname, st in _walk(src.path, src.name, "", src.exclude, os.stat(src.path)):
                files += _add(tar, entry, arcname, st)
    data = buf.getvalue()
    return Archive(data, hashlib.sha256(data).hexdigest(), files)


def build_zip(
    sources: Iterable[Source],
    stored: Iterable[tuple[str, bytes]] = (),
    deflated: Iterable[tuple[str, bytes]] = (),
) -> Archive:
    """A reproducible zip of ``stored`` (name in the archive, content), stored uncompressed,
    in the order given, then of ``deflated`` likewise but deflated, and then of the regular
    files of ``sources`` (the same walk and order as :func:`build`; folders and links are
    left out), deflated (level 9). Every member's time is :data:`MTIME`, its permissions
    0o755 or 0o644 as in :func:`build`.

    The stored members come first, so that the archive is one uncompressed head (the byte
    code every node start imports, :func:`flotilla._providers.bootstrap.build_bundle`) and
    one tail of deflated members (and the central directory)."""
    buf = io.BytesIO()
    files = 0
    when = time.gmtime(MTIME)[:6]

    def add(arcname: str, data: bytes, mode: int, how: int) -> None:
        info = zipfile.ZipInfo(arcname, date_time=when)
        info.external_attr = (stat.S_IFREG | mode) << 16
        info.create_system = 3  # unix: the permissions above are read
        out.writestr(info, data, compress_type=how, compresslevel=9)

    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as out:
        for arcname, data in stored:
            add(arcname, data, 0o644, zipfile.ZIP_STORED)
            files += 1
        for arcname, data in deflated:
            add(arcname, data, 0o644, zipfile.ZIP_DEFLATED)
            files += 1
        for src in sources:
            for entry, arcname, st in _walk(src.path, src.name, "", src.exclude, os.stat(src.path)):
                if stat.S_ISREG(st.st_mode):
                    with open(entry, "rb") as f:
                        mode = 0o755 if st.st_mode & 0o111 else 0o644
                        add(arcname, f.read(), mode, zipfile.ZIP_DEFLATED)
                    files += 1
    data = buf.getvalue()
    return Archive(data, hashlib.sha256(data).hexdigest(), files)


def _walk(
    path: str, arcname: str, rel: str, exclude: Exclude | None, st: os.stat_result
) -> Iterator[tuple[str, str, os.stat_result]]:
    """(path, name in the archive, lstat) of ``path`` and, for a folder, what it holds."""
    yield path, arcname, st
    if not stat.S_ISDIR(st.st_mode):
        return
    for entry in sorted(os.listdir(path)):
        child = os.path.join(path, entry)
        child_rel = f"{rel}/{entry}" if rel else entry
        try:
            child_st = os.lstat(child)
        except FileNotFoundError:
            continue  # removed while we walk
        if exclude is not None and exclude(child_rel, stat.S_ISDIR(child_st.st_mode)):
            continue
        yield from _walk(child, f"{arcname}/{entry}", child_rel, exclude, child_st)


def _add(tar: tarfile.TarFile, path: str, arcname: str, st: os.stat_result) -> int:
    """Add one entry with normalised metadata; 1 for a regular file, else 0."""
    info = tarfile.TarInfo(arcname)
    info.mtime = MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    elif stat.S_ISLNK(mode):
        info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, os.readlink(path)
        tar.addfile(info)
    elif stat.S_ISREG(mode):
        with open(path, "rb") as f:
            info.size = os.fstat(f.fileno()).st_size
            info.mode = 0o755 if mode & 0o111 else 0o644
            tar.addfile(info, f)
        return 1
    return 0
