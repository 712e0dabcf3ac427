"""Bootstrap: make a remote node run exactly the client's flotilla, whatever is installed there.

Provider-independent: SSH uses it, and so can any provider that reaches its nodes through a
remote shell (cloud VMs over SSH, a container exec...), through ``launch.start_remote_agent``.

The client packs its own ``flotilla`` and ``cloudpickle`` package directories (both pure
Python; an editable development install works too), with byte code of the node's modules,
into a reproducible zip (:func:`build_bundle`) named by the sha256 of its content: the byte
code of the modules every start imports stored uncompressed, then the other modules' byte
code and every source deflated (a start reads none; a later import inflates the one it
needs). It is sent as it is (1.4 MB: the host's sshd relays a MB for ~3 ms of CPU once
the node's stdin is a long pipe, :data:`PIPE_SIZE`, so compressing the stored head, 0.27 MB
less, cost a first start more, ~4 ms to inflate it, than it saved), and kept beside the
client's compiled copy of the node code (:func:`kept_bundle`). A node
keeps every bundle it received as the file ``{workdir}/lib/{hash}`` and runs the agent with
``PYTHONPATH`` pointing there: Python imports the modules straight from the zip
(``zipimport``), so a host's first start writes one file instead of unpacking a few
hundred::

    cd {workdir} && PYTHONPATH={workdir}/lib/{hash} exec {python} -m flotilla.agent

One remote command, on the connection that then carries the agent's stdio, starts one
Python process (:data:`_BOOT`; the shell runs nothing else), which becomes the agent: it
checks the interpreter (>= 3.11), refuses a working directory another user owns or can
write (made 0700 when missing), takes the agent lock when the provider asks for one, and,
when the bundle is there and intact (its CRC-32 is checked at every start, ~2 ms where a
sha256 would cost ~7: a damaged file is never imported; the folder is private, so this
guards against damage, not against its owner), runs the agent at once (its ``main``, as
``-m flotilla.agent`` would, without ``runpy``). Otherwise it answers ``NEED_UPLOAD`` and
reads the bundle (its exact size) from stdin: it checks its CRC-32 and writes it to a
temporary file renamed into place (:data:`_EXTRACT`; atomic: concurrent pools never see
half a bundle, and a damaged one is replaced), then goes on as the agent. Either way a
start costs one shell and one Python start.

The agent runs as a child of the command's shell, which reports on stderr the signal that
killed it (``FLOTILLA_BOOT SIGNAL 9``): remote shells do not pass signals on.

Answer lines (stdout, before the agent's first frame)::

    FLOTILLA_BOOT AGENT             the agent follows on this stream
    FLOTILLA_BOOT NEED_UPLOAD       the bundle is missing: send it on stdin
    FLOTILLA_BOOT UPLOAD_FAILED 1   installing the bundle failed (its status)
    FLOTILLA_BOOT NO_PYTHON 127     the interpreter cannot be run (its status)
    FLOTILLA_BOOT BAD_PYTHON 3.9    the interpreter is too old (its version)
    FLOTILLA_BOOT UNSAFE_WORKDIR owner|writable DIR
                                    the working directory (or the bundle's) belongs to
                                    another user or others can write it: nothing runs

Lines before the answer (a chatty shell profile) are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import py_compile
import shlex
import tempfile
import threading
import zlib
from dataclasses import dataclass
from enum import Enum

from .._archive import Source, build_zip, glob_excludes
from .._errors import ProvisionCause, ProvisionError
from . import bytecode
from .pipe import PipeAgent

logger = logging.getLogger("flotilla.bootstrap")

MIN_PYTHON = (3, 11)
MARKER = b"FLOTILLA_BOOT "
"""Prefix of the answer line of the start command."""
PIPE_SIZE = 1 << 20
"""The length a node's start makes the pipe of its stdin (``F_SETPIPE_SZ``; Linux's default
is 64 KiB, 1 MiB the most an unprivileged process may ask for by default). An sshd relays
what the client sends (the bundle, then every frame) into that pipe, and holds what does
not fit in a buffer it grows by reallocating and copying it whole, packet by packet: with
64 KiB, receiving the 1.15 MB bundle cost the host's sshd ~13 ms of CPU; with 1 MiB, ~3
(measured over 12 sessions each, the sshd's cgroup counted to the nanosecond)."""
_EXCLUDED = bytecode.SKIP
"""Left out of the bundle: the sources' byte code (:func:`build_bundle` compiles its own)."""


@dataclass(frozen=True)
class Bundle:
    """The client's flotilla + cloudpickle as a zip (:func:`build_bundle`), as it is sent.

    Attributes:
        hash: sha256 (hex) of the zip; its file name on a node.
        data: the zip, as it is sent.
        crc: the CRC-32 of the zip: a node checks its copy against it at every start.
    """

    hash: str
    data: bytes
    crc: int

    @classmethod
    def of(cls, data: bytes) -> Bundle:
        """The bundle of the zip ``data``."""
        return cls(hashlib.sha256(data).hexdigest(), data, zlib.crc32(data))


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
    UPLOAD_FAILED = "UPLOAD_FAILED"
    NO_PYTHON = "NO_PYTHON"
    BAD_PYTHON = "BAD_PYTHON"
    UNSAFE_WORKDIR = "UNSAFE_WORKDIR"


SIGNAL_LINE = MARKER + b"SIGNAL "
"""Prefix of the stderr line saying which signal killed the agent."""


NO_ANSWER_WAIT = 10.0
"""Seconds a start command that ended without answering gets to exit and finish its stderr."""


class NoAnswer(Exception):
    """The start command ended without answering: the remote shell itself failed (e.g.
    ssh could not connect). The provider turns this into a ProvisionError.

    Attributes:
        status: the command's exit status (None if unknown).
        stderr: its last stderr output.
    """

    def __init__(self, status: int | None, stderr: str) -> None:
        super().__init__(f"no answer (exit status {status}): {stderr.strip()[-500:]}")
        self.status = status
        self.stderr = stderr


# -- the bundle (client side) --------------------------------------------------------------
def client_bundle() -> Bundle:
    """This process's bundle: read from the client's cache, or built (~70 ms CPU) on first
    use (:func:`kept_bundle`), then held."""
    global _bundle
    with _bundle_lock:
        if _bundle is None:
            running = running_bundle()
            if running is not None:  # on a node: ship the bundle this flotilla runs from
                with open(running, "rb") as f:
                    data = f.read()
                _bundle = Bundle.of(data)
            else:
                _bundle = kept_bundle(node_packages())
        return _bundle


def running_bundle() -> str | None:
    """The bundle (a zip file) this process's flotilla is imported from, on a node; None
    where flotilla is a folder."""
    root = os.path.dirname(_package_dirs()["flotilla"])
    return root if os.path.isfile(root) else None


KEPT_PREFIX, KEPT_SUFFIX = "bundle-", ".zip"
"""A kept bundle's file name: ``bundle-{hash}-{crc}.zip`` (the bundle's fields in its
name), in the compiled copy's folder."""


def kept_bundle(packages: dict[str, str]) -> Bundle:
    """:func:`build_bundle` of ``packages``, kept on disk in their compiled copy's folder
    (:func:`bytecode.entry_of`: private, one per source and interpreter, so an edited
    source is another folder and another bundle), so that a client process reads it
    instead of building it. The kept file is checked against its hash (the sha256 in its
    name) and named with its CRC-32 too, which a client does not compute again. A kept
    file that does not match is removed and the bundle built again. Packages without a
    compiled copy: built."""
    entry = bytecode.entry_of(packages)
    if entry is None:
        return build_bundle(packages)
    for file in sorted(os.listdir(entry)):
        if not (file.startswith(KEPT_PREFIX) and file.endswith(KEPT_SUFFIX)):
            continue
        path = os.path.join(entry, file)
        digest, _, crc = file[len(KEPT_PREFIX) : -len(KEPT_SUFFIX)].partition("-")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if hashlib.sha256(data).hexdigest() == digest and crc.isdigit():
            return Bundle(digest, data, int(crc))
        logger.warning("%s does not match its hash: removed, the bundle is built again", path)
        with contextlib.suppress(OSError):
            os.unlink(path)
    bundle = build_bundle(packages)
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".bundle-", dir=entry)  # 0600
        with os.fdopen(fd, "wb") as f:
            f.write(bundle.data)
        name = f"{KEPT_PREFIX}{bundle.hash}-{bundle.crc}{KEPT_SUFFIX}"
        os.replace(tmp, os.path.join(entry, name))
    except OSError as e:
        logger.warning("cannot keep the bundle in %s (%s): the next client builds it", entry, e)
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return bundle


def node_packages() -> dict[str, str]:
    """Import name -> directory of the packages a node runs: this client's flotilla and
    cloudpickle, as their compiled copy (:func:`bytecode.compiled`); where flotilla runs
    from a bundle (:func:`running_bundle`), their places in it."""
    if running_bundle() is not None:
        return _package_dirs()
    return bytecode.compiled(_package_dirs())


def _package_dirs() -> dict[str, str]:
    """Import name -> directory of the packages a node needs, as this client has them."""
    import cloudpickle

    return {  # flotilla: the package this module is in
        "flotilla": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "cloudpickle": os.path.dirname(os.path.abspath(cloudpickle.__file__)),
    }


def build_bundle(packages: dict[str, str]) -> Bundle:
    """A reproducible zip (:func:`flotilla._archive.build_zip`) of ``packages`` (name ->
    directory), without their byte code, with byte code of :data:`bytecode.NODE_START`
    where ``zipimport`` reads it: ``module.pyc`` beside ``module.py``, named in tracebacks
    by its path in the bundle (``flotilla/agent.py``); stored first for the modules of
    :data:`bytecode.STORED`, then deflated for the others. The byte code is unchecked-hash:
    the zip, whose hash covers every source with its byte code, is checked whole at every
    start, so an import does not read and hash its source again."""
    skip = glob_excludes(_EXCLUDED)
    sources = [Source(packages[name], name, skip) for name in sorted(packages)]
    compiled: list[tuple[str, bytes]] = []
    with tempfile.TemporaryDirectory(prefix="flotilla-bundle-") as tmp:
        for src in sources:
            for folder, dirs, files in os.walk(src.path):
                rel = os.path.relpath(folder, src.path).replace(os.sep, "/")
                dirs[:] = sorted(d for d in dirs if not skip(d, True))
                for file in sorted(files):
                    relpath = f"{rel}/{file}" if rel != "." else file
                    if not file.endswith(".py") or not bytecode.node_start(src.name, relpath):
                        continue
                    arcname = f"{src.name}/{relpath}"
                    cfile = os.path.join(tmp, "module.pyc")
                    py_compile.compile(
                        os.path.join(folder, file),
                        cfile=cfile,
                        dfile=arcname,
                        doraise=True,
                        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
                    )
                    with open(cfile, "rb") as f:
                        compiled.append((arcname + "c", f.read()))
    stored = [(name, code) for name, code in compiled if name[:-4] in bytecode.STORED]
    later = [(name, code) for name, code in compiled if name[:-4] not in bytecode.STORED]
    archive = build_zip(sources, sorted(stored), sorted(later))  # the byte code first
    return Bundle.of(archive.data)


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


_BOOT = f"""\
import os, sys
def say(line):
    sys.stdout.write("FLOTILLA_BOOT " + line + "\\n")
    sys.stdout.flush()
if sys.version_info < {MIN_PYTHON!r}:
    say("BAD_PYTHON %d.%d" % sys.version_info[:2])
    sys.exit(0)
import gc
gc.disable()
try:
    import fcntl
    fcntl.fcntl(0, fcntl.F_SETPIPE_SZ, {PIPE_SIZE})
except (ImportError, AttributeError, OSError):
    pass
if not sys.flags.safe_path:
    del sys.path[0]
work, name, size, crc, lock, code = sys.argv[1:7]
del sys.argv[1:]
lib = os.path.join(work, "lib")
target = os.path.join(lib, name)
try:
    os.makedirs(work, 0o700, exist_ok=True)
except OSError:
    pass
for d in (work, lib, target):
    try:
        if os.stat(d).st_uid != os.geteuid():
            say("UNSAFE_WORKDIR owner " + d)
            sys.exit(0)
    except OSError:
        pass
if os.path.isdir(work) and os.stat(work).st_mode & 0o022:
    say("UNSAFE_WORKDIR writable " + work)
    sys.exit(0)
try:
    os.chdir(work)
except OSError as e:
    sys.exit("cannot enter the working directory %s: %s" % (work, e))
st = os.stat(".")
if st.st_uid != os.geteuid() or st.st_mode & 0o022:
    say("UNSAFE_WORKDIR %s %s" % ("owner" if st.st_uid != os.geteuid() else "writable", work))
    sys.exit(0)
lib = os.path.join(os.getcwd(), "lib")
target = os.path.join(lib, name)
if lock:
    import fcntl
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.set_inheritable(fd, True)
def intact():
    import mmap, zlib
    try:
        with open(target, "rb") as f:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return zlib.crc32(data) == int(crc)
    except (OSError, ValueError):
        return False
if not intact():
    say("NEED_UPLOAD")
    sys.argv[1:] = [lib, name, size, crc]
    try:
        exec(compile(code, "<flotilla-extract>", "exec"), {{"__name__": "extract"}})
    except BaseException as e:
        if not isinstance(e, SystemExit):
            import traceback
            traceback.print_exc()
        elif e.code is not None and not isinstance(e.code, int):
            sys.stderr.write(str(e.code) + "\\n")
        sys.stderr.flush()
        say("UPLOAD_FAILED 1")
        sys.exit(0)
    del sys.argv[1:]
del code
if not sys.flags.safe_path:
    sys.path.insert(0, os.getcwd())
sys.path.insert(1, target)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [target, os.environ.get("PYTHONPATH")]))
say("AGENT")
import flotilla.agent
sys.argv[0] = flotilla.agent.__file__
flotilla.agent.main()
"""
"""The node side of the start command, in one Python process: it checks the interpreter (first,
in syntax any Python parses), pauses the cyclic garbage collector for the start (its passes
over the modules being imported find nothing; the agent freezes what they made and resumes
it, :func:`flotilla._node.agent.main`), makes its stdin pipe :data:`PIPE_SIZE` long (where
stdin is a pipe and the host allows it), takes the session's folder off ``sys.path``
(nothing is imported from it), refuses a working directory another user owns or others can
write (made 0700 when missing) and enters it (the folder entered is checked again and named
by its real path from then on: a link on the way, which its owner could point elsewhere
after the first check, is not followed again), takes the agent lock when asked, installs the
bundle when it is missing (the extraction code, :data:`_EXTRACT`, comes as its last argument
and is compiled only then) and becomes the agent: it calls :func:`flotilla.agent.main` with
what ``python -m flotilla.agent`` would give it (the working directory first on
``sys.path``, the module's file as ``sys.argv[0]``; its command line names
``flotilla.agent``, as tools that look for agents expect), without ``runpy`` (with
``importlib.util``: ~0.7 ms CPU of every start)."""


def start_command(workdir: str, python: str, bundle: Bundle, lock: str | None = None) -> list[str]:
    """The command (an argv) that checks the node, installs the bundle if needed and runs
    the agent (see the module docstring): one shell and one Python process, the agent.

    ``lock``: a file (relative to ``workdir``) the agent holds a shared ``flock`` on while
    it and the processes it starts run (a pod's holder ends the pod when none does).
    """
    py = python_words(python)
    first = shlex.quote(shlex.split(python)[0])
    script = f"""\
command -v {first} >/dev/null 2>&1 || {{ echo "FLOTILLA_BOOT NO_PYTHON 127"; exit 0; }}
{py} -c {shlex.quote(_BOOT)} {shell_path(workdir)} {bundle.hash} {len(bundle.data)} \\
  {bundle.crc} {shlex.quote(lock or "")} {shlex.quote(_EXTRACT)}
S=$?
if [ "$S" -gt 128 ]; then echo "FLOTILLA_BOOT SIGNAL $((S - 128))" >&2; fi
exit "$S"
"""
    return ["sh", "-c", script]


_EXTRACT = """\
import os, sys, zlib
lib, name, size, crc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
data = bytearray(size)
view = memoryview(data)
got = 0
while got < size:
    part = os.readv(0, [view[got:]])
    if not part:
        sys.exit("the bundle upload ended early")
    got += part
if zlib.crc32(data) != crc:
    sys.exit("the uploaded bundle does not match its CRC-32")
os.makedirs(lib, 0o700, exist_ok=True)
tmp = os.path.join(lib, ".tmp-%s-%d-%s" % (name[:12], os.getpid(), os.urandom(6).hex()))
fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
try:
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(lib, name))
except BaseException:
    os.unlink(tmp)
    raise
"""
"""The node's bundle installer: reads the bundle (its exact size) into one buffer, checks its
CRC-32, as every later start does, and writes it as the file ``lib/{hash}`` (a private
temporary file, created new, renamed into place: concurrent starts never see half of one,
and a damaged bundle is replaced whole). It imports ``zlib`` only: no ``tempfile`` (~15 ms
to import on a plain interpreter), no ``hashlib`` (OpenSSL's start and a sha256 of the zip,
~5 ms of a first start: the upload comes over the client's own SSH session, whose MAC covers
it, into a private folder, so the check guards against damage, as the CRC-32 does, not
against anyone)."""


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


async def start_agent(agent: PipeAgent, workdir: str, python: str, bundle: Bundle) -> None:
    """Follow the start command (:func:`start_command`) that ``agent`` runs until the agent
    itself runs, sending the bundle when the node lacks it.

    Raises NoAnswer when the command ends without answering, and ProvisionError naming
    the host when the node has no suitable Python or installing the bundle fails.
    """
    uploaded = False
    while True:
        answer, detail = await _next_answer(agent)
        if answer is Answer.AGENT:
            if not uploaded:
                stats.hits += 1
            return
        if answer is Answer.NEED_UPLOAD and not uploaded:
            logger.info(
                "%s: uploading flotilla bundle %s (%d KB)",
                agent.host,
                bundle.hash[:12],
                len(bundle.data) // 1024,
            )
            stats.uploads += 1
            uploaded = True
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, agent.write, [bundle.data])
            except OSError:
                continue  # the command ended: the next read says why
            continue
        if answer is Answer.UNSAFE_WORKDIR:
            raise _unsafe_workdir(agent.host, detail)
        err = agent.err_tail.decode(errors="replace")
        if answer is Answer.UPLOAD_FAILED:
            why = err.strip().splitlines()[-1] if err.strip() else f"exit status {detail}"
            raise ProvisionError(
                f"{agent.host}: cannot install the flotilla bundle under {workdir}/lib: {why}",
                cause=ProvisionCause.NODE,
            )
        raise _python_error(agent.host, python, answer, detail, err)


def _unsafe_workdir(host: str, detail: str) -> ProvisionError:
    """The error for a working directory another user could write flotilla's code into."""
    why, _, path = detail.partition(" ")
    if why == "owner":
        problem, fix = "belongs to another user", "remove it or use another workdir"
    else:
        problem, fix = "can be written by other users", f"run `chmod go-w {path}` on the node"
    return ProvisionError(
        f"{host}: refusing to run flotilla from {path}: it {problem}, who could replace the "
        f"code the agent runs as you. {fix[0].upper()}{fix[1:]}, or pass a working directory "
        "you own (workdir=..., default ~/.flotilla)",
        cause=ProvisionCause.NODE,
    )


async def _next_answer(agent: PipeAgent) -> tuple[Answer, str]:
    """The start command's next answer; NoAnswer (with its status and stderr) when it
    ended without one."""
    line = await agent.read_line(MARKER)
    if line is None:
        # stdout may end before stderr is all read, and the shell's own words on stderr are
        # what explains the failure: wait for both, on an error path only (a loaded machine
        # took more than 2 s to deliver ssh's "Connection refused")
        status = await agent.wait(NO_ANSWER_WAIT)
        await agent.stderr_ended(NO_ANSWER_WAIT)
        raise NoAnswer(status, agent.err_tail.decode(errors="replace"))
    return parse_answer(agent.host, line)


def announced(command: list[str]) -> list[str]:
    """``command`` (an agent command line, for a node that needs no bundle) behind a shell
    that first answers ``AGENT``: :func:`wait_announced` then tells a remote launcher that
    failed (srun refused the step) from an agent that runs."""
    return ["sh", "-c", f'echo "{MARKER.decode()}{Answer.AGENT.value}"; exec "$@"', "sh", *command]


async def wait_announced(agent: PipeAgent) -> None:
    """Wait for the answer of an :func:`announced` command: NoAnswer when it ended first."""
    answer, _ = await _next_answer(agent)
    if answer is not Answer.AGENT:
        raise ProvisionError(f"{agent.host}: unexpected answer from the start command: {answer}")


def _python_error(host: str, python: str, answer: Answer, detail: str, err: str) -> ProvisionError:
    """The error for a node whose interpreter is missing or too old."""
    need = ".".join(map(str, MIN_PYTHON))
    if answer is Answer.BAD_PYTHON:
        return ProvisionError(
            f"{host}: {python!r} is Python {detail}; flotilla needs Python >= {need} on the "
            f"nodes: pass SSH(python=...) naming a newer interpreter",
            cause=ProvisionCause.NODE,
        )
    why = err.strip().splitlines()[-1] if err.strip() else f"exit status {detail}"
    return ProvisionError(
        f"{host}: cannot run Python {python!r} ({why}); flotilla needs Python >= {need} on "
        f"the nodes: install it or pass SSH(python=...) with its path",
        cause=ProvisionCause.NODE,
    )
