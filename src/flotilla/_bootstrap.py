"""Bootstrap: make a remote node run exactly the client's flotilla, whatever is installed there.

Provider-independent: SSH uses it, and so can any provider that reaches its nodes through a
remote shell (cloud VMs over SSH, a container exec...). It needs only a :class:`Launcher`.

The client packs its own ``flotilla`` and ``cloudpickle`` package directories (both pure
Python; an editable development install works too) into a deterministic tar.gz named by
the sha256 of its content. A node keeps every bundle it received under
``{workdir}/lib/{hash}/`` and runs the agent with ``PYTHONPATH`` pointing there::

    cd {workdir} && PYTHONPATH={workdir}/lib/{hash} exec {python} -m flotilla.agent

One remote command checks the interpreter (>= 3.11; once per bundle and interpreter),
tests for the bundle and, when it is there, execs the agent at once: a cache hit costs a
single round trip and a single Python start. Otherwise the
command answers ``NEED_UPLOAD``; the bundle is then streamed to the node's Python, which
extracts it into a temporary directory and renames that into place (atomic: concurrent
pools never see a half-extracted bundle), and the command is run again.

Answer lines (stdout, before the agent's first frame)::

    FLOTILLA_BOOT AGENT             the agent follows on this stream
    FLOTILLA_BOOT NEED_UPLOAD       the bundle is missing
    FLOTILLA_BOOT NO_PYTHON 127     the interpreter cannot be run (its status)
    FLOTILLA_BOOT BAD_PYTHON 3.9    the interpreter is too old (its version)

Lines before the answer (a chatty shell profile) are ignored.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import shlex
import tarfile
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, TypeVar

from ._errors import ProvisionError

logger = logging.getLogger("flotilla.bootstrap")

MIN_PYTHON = (3, 11)
MARKER = b"FLOTILLA_BOOT "
"""Prefix of the answer line of the start command."""
_EXCLUDED_DIRS = {"__pycache__"}
_EXCLUDED_SUFFIXES = (".pyc", ".pyo")
_MTIME = 1_600_000_000  # fixed timestamps: equal content gives an equal archive and hash


@dataclass(frozen=True)
class Bundle:
    """The client's flotilla + cloudpickle as a tar.gz.

    Attributes:
        hash: sha256 (hex) of ``data``; the node-side directory name.
        data: the archive.
    """

    hash: str
    data: bytes


@dataclass
class BootstrapStats:
    """Counters of this process's bootstraps (tests and benchmarks read them).

    Attributes:
        hits: agents started from a bundle already on the node.
        uploads: bundles sent to a node.
    """

    hits: int = 0
    uploads: int = 0


stats = BootstrapStats()
_bundle: Bundle | None = None
_bundle_lock = threading.Lock()


class Answer(Enum):
    """What the start command said before (possibly) becoming the agent."""

    AGENT = "AGENT"
    NEED_UPLOAD = "NEED_UPLOAD"
    NO_PYTHON = "NO_PYTHON"
    BAD_PYTHON = "BAD_PYTHON"


P = TypeVar("P")


class Launcher(Protocol[P]):
    """Runs shell commands on one node (e.g. over one SSH connection).

    ``P`` is the launcher's handle of a running command, which becomes the agent's stdio.
    """

    host: str
    """The node's name, for messages."""

    async def launch(self, command: str) -> tuple[str, str, P]:
        """Start ``command`` (a POSIX shell script); wait for its answer line.

        Returns the answer line (without :data:`MARKER`), the stderr text seen so far and
        the running command, whose stdout continues after the answer line. Raises
        ProvisionError when the command ends without answering.
        """
        ...

    async def run(self, command: str, stdin: bytes) -> tuple[int | None, str]:
        """Run ``command`` to completion with ``stdin``; its exit status and stderr text."""
        ...

    async def discard(self, proc: P) -> None:
        """Release a command started by :meth:`launch` that is not used further."""
        ...


# -- the bundle (client side) --------------------------------------------------------------
def client_bundle() -> Bundle:
    """This process's bundle, built on first use (a few tens of ms) and then cached."""
    global _bundle
    with _bundle_lock:
        if _bundle is None:
            _bundle = build_bundle(_package_dirs())
        return _bundle


def _package_dirs() -> dict[str, str]:
    """Import name -> directory of the packages a node needs, as this client has them."""
    import cloudpickle

    import flotilla

    return {
        "flotilla": os.path.dirname(os.path.abspath(flotilla.__file__)),
        "cloudpickle": os.path.dirname(os.path.abspath(cloudpickle.__file__)),
    }


def build_bundle(packages: dict[str, str]) -> Bundle:
    """A deterministic tar.gz of ``packages`` (name -> directory), without byte code."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(packages):
            for path, arcname in _package_files(packages[name], name):
                _add_file(tar, path, arcname)
    data = gzip.compress(raw.getvalue(), compresslevel=6, mtime=0)
    return Bundle(hashlib.sha256(data).hexdigest(), data)


def _package_files(root: str, name: str) -> list[tuple[str, str]]:
    """(path, name in the archive) of every file of a package directory, sorted."""
    out: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        rel = os.path.relpath(dirpath, root)
        for filename in sorted(filenames):
            if filename.endswith(_EXCLUDED_SUFFIXES):
                continue
            arc_dir = name if rel == "." else f"{name}/{rel.replace(os.sep, '/')}"
            out.append((os.path.join(dirpath, filename), f"{arc_dir}/{filename}"))
    return out


def _add_file(tar: tarfile.TarFile, path: str, arcname: str) -> None:
    """Add one regular file with normalised metadata (owner, mode, time)."""
    with open(path, "rb") as f:
        content = f.read()
    info = tarfile.TarInfo(arcname)
    info.size = len(content)
    info.mtime = _MTIME
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(content))


# -- remote commands -----------------------------------------------------------------------
def shell_path(path: str) -> str:
    """``path`` as a shell word; a leading ``~`` becomes ``$HOME`` (expanded remotely)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def python_words(python: str) -> str:
    """The interpreter command (``python3``, ``/opt/py/bin/python -X dev``) as shell words."""
    return " ".join(shlex.quote(w) for w in shlex.split(python))


_CHECK_PYTHON = (
    "import sys; print('%d.%d' % sys.version_info[:2]); "
    f"sys.exit(0 if sys.version_info >= {MIN_PYTHON!r} else 3)"
)


def start_command(workdir: str, python: str, bundle_hash: str) -> str:
    """The command that checks the node and execs the agent (see the module docstring).

    The interpreter check runs once per bundle and interpreter: it leaves a marker file in
    the bundle directory, so a cache hit starts a single Python process, the agent.
    """
    py = python_words(python)
    checked = ".python-ok-" + hashlib.sha256(python.encode()).hexdigest()[:16]
    script = f"""\
W={shell_path(workdir)}
L="$W/lib/{bundle_hash}"
if [ ! -e "$L/{checked}" ]; then
  V=$({py} -S -c {shlex.quote(_CHECK_PYTHON)})
  S=$?
  if [ "$S" -eq 3 ]; then echo "FLOTILLA_BOOT BAD_PYTHON $V"; exit 0; fi
  if [ "$S" -ne 0 ]; then echo "FLOTILLA_BOOT NO_PYTHON $S"; exit 0; fi
  if [ ! -d "$L" ]; then echo "FLOTILLA_BOOT NEED_UPLOAD"; exit 0; fi
  : > "$L/{checked}" 2>/dev/null
fi
cd "$W" || exit 1
echo "FLOTILLA_BOOT AGENT"
PYTHONPATH="$L${{PYTHONPATH:+:$PYTHONPATH}}" exec {py} -m flotilla.agent
"""
    return "exec sh -c " + shlex.quote(script)


_EXTRACT = """\
import os, shutil, sys, tarfile, tempfile
lib, name = sys.argv[1], sys.argv[2]
target = os.path.join(lib, name)
os.makedirs(lib, exist_ok=True)
if os.path.isdir(target):
    sys.stdin.buffer.read()
    sys.exit(0)
tmp = tempfile.mkdtemp(prefix=".tmp-" + name[:12] + "-", dir=lib)
try:
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|gz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp, filter="data")
        else:
            tar.extractall(tmp)
    try:
        os.rename(tmp, target)
    except OSError:
        if not os.path.isdir(target):
            raise
finally:
    shutil.rmtree(tmp, ignore_errors=True)
"""


def upload_command(workdir: str, python: str, bundle_hash: str) -> str:
    """The command that reads a bundle on stdin and installs it under ``{workdir}/lib``."""
    py = python_words(python)
    script = (
        f'W={shell_path(workdir)}\nexec {py} -c {shlex.quote(_EXTRACT)} "$W/lib" {bundle_hash}\n'
    )
    return "exec sh -c " + shlex.quote(script)


# -- the dance -------------------------------------------------------------------------------
def parse_answer(host: str, line: str) -> tuple[Answer, str]:
    """(answer, detail) of an answer line without its marker."""
    word, _, detail = line.strip().partition(" ")
    try:
        return Answer(word), detail
    except ValueError:
        raise ProvisionError(
            f"{host}: unexpected answer from the start command: {line!r}"
        ) from None


async def start_agent(launcher: Launcher[P], workdir: str, python: str, bundle: Bundle) -> P:
    """Start the agent on the launcher's node, uploading the bundle first if needed.

    Returns the running agent command (its stdio is the protocol channel). Raises
    ProvisionError naming the host when the node has no suitable Python or the upload fails.
    """
    command = start_command(workdir, python, bundle.hash)
    for attempt in range(2):
        line, err, proc = await launcher.launch(command)
        answer, detail = parse_answer(launcher.host, line)
        if answer is Answer.AGENT:
            if attempt == 0:
                stats.hits += 1
            return proc
        await launcher.discard(proc)
        if answer is not Answer.NEED_UPLOAD:
            raise _python_error(launcher.host, python, answer, detail, err)
        if attempt:
            break
        await upload(launcher, workdir, python, bundle)
    raise ProvisionError(
        f"{launcher.host}: the flotilla bundle is still missing under {workdir}/lib after "
        "uploading it (is the work directory writable and on a persistent file system?)"
    )


async def upload(launcher: Launcher[P], workdir: str, python: str, bundle: Bundle) -> None:
    """Send the bundle to the node and install it atomically under ``{workdir}/lib``."""
    logger.info(
        "%s: uploading flotilla bundle %s (%d KB)",
        launcher.host,
        bundle.hash[:12],
        len(bundle.data) // 1024,
    )
    stats.uploads += 1
    status, err = await launcher.run(upload_command(workdir, python, bundle.hash), bundle.data)
    if status != 0:
        detail = err.strip().splitlines()[-1] if err.strip() else f"exit status {status}"
        raise ProvisionError(
            f"{launcher.host}: cannot install the flotilla bundle under {workdir}/lib: {detail}"
        )


def _python_error(host: str, python: str, answer: Answer, detail: str, err: str) -> ProvisionError:
    """The error for a node whose interpreter is missing or too old."""
    need = ".".join(map(str, MIN_PYTHON))
    if answer is Answer.BAD_PYTHON:
        return ProvisionError(
            f"{host}: {python!r} is Python {detail}; flotilla needs Python >= {need} on the "
            f"nodes: pass SSH(python=...) naming a newer interpreter"
        )
    why = err.strip().splitlines()[-1] if err.strip() else f"exit status {detail}"
    return ProvisionError(
        f"{host}: cannot run Python {python!r} ({why}); flotilla needs Python >= {need} on "
        f"the nodes: install it or pass SSH(python=...) with its path"
    )
