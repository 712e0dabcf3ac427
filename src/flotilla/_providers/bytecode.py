"""The node code as compiled byte code: built once per flotilla version and interpreter, kept.

Most of an agent's start CPU is compiling flotilla's node modules when it finds no byte
code: on an SSH host's first start (a new bundle), wherever ``PYTHONDONTWRITEBYTECODE`` is
set, or in an installation the node cannot write. So the client compiles them once:
:func:`compiled` returns a copy of the packages a node needs (flotilla and cloudpickle,
as this client has them) with a ``__pycache__`` of *checked-hash* byte code (PEP 552) for
this interpreter, kept under ``{XDG_CACHE_HOME or ~/.cache}/flotilla/code/{key}/``, where
``key`` is the sha256 of the packages' sources (names and contents) and of the
interpreter's magic number and cache tag. Another flotilla version, or an edited source, is
another key; the same one is never built twice (a build goes to a temporary folder renamed
into place: concurrent clients never see half of one).

Verified: the interpreter checks each checked-hash ``.pyc`` against the hash of its source
when it imports it (a mismatch compiles the source instead), and a node with another
interpreter ignores them (their file names carry the cache tag). The cache folder, whose
code every node runs, is a private one (``_system.private``: ours, nobody else can write
it), as is every entry before it is used.

Local agents import from this copy (``local``). The SSH bundle (``bootstrap``), a zip
the nodes import from, holds byte code of :data:`NODE_START` only, the modules a node's
start imports (a module outside the list is compiled by the node when first used), and
is kept in the copy's folder. Where the cache cannot be written the packages are used as they are
(byte code compiled by each node).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import py_compile
import shutil
import sys
import tempfile
import threading
import time

from .._errors import ConfigurationError
from .._system.private import private_dir

logger = logging.getLogger("flotilla.bytecode")

SKIP = ("__pycache__", "*.pyc", "*.pyo")
"""Never copied from the sources: the byte code the client's own imports wrote."""
NODE_START = (
    "flotilla/__init__",
    "flotilla/agent",
    "flotilla/_info",
    "flotilla/_version",
    "flotilla/_node/",
    "flotilla/_wire/",
    "flotilla/_system/",
    "cloudpickle/",  # a class sent by value, a result cloudpickle pickles (not a function)
)
"""The modules (a name without ``.py``) and packages (ending with ``/``) an agent and its
first executor import as they start: the byte code the SSH bundle ships
(``tests/test_bytecode.py`` checks that a first start compiles nothing)."""
STORED = (
    *("flotilla/__init__", "flotilla/agent", "flotilla/_version"),
    *("flotilla/_system/__init__", "flotilla/_system/fastjson", "flotilla/_system/procs"),
    *("flotilla/_wire/__init__", "flotilla/_wire/bodies", "flotilla/_wire/code"),
    *("flotilla/_wire/exits", "flotilla/_wire/frames", "flotilla/_wire/lanes"),
    *("flotilla/_wire/protocol", "flotilla/_wire/rebuild", "flotilla/_wire/serialize"),
    *("flotilla/_node/__init__", "flotilla/_node/agent", "flotilla/_node/batching"),
    *("flotilla/_node/environment", "flotilla/_node/eventloop", "flotilla/_node/executor"),
    *("flotilla/_node/feeds", "flotilla/_node/hooks", "flotilla/_node/lanes"),
    *("flotilla/_node/metrics", "flotilla/_node/processes", "flotilla/_node/relay"),
    *("flotilla/_node/supervisor", "flotilla/_node/cloud"),
)
"""The modules of :data:`NODE_START` that every node's start imports (the agent, its first
executor, a cloud instance's helper): the SSH bundle stores their byte code at its head,
which a start reads as it is, and deflates the rest's, which an import inflates
when it needs it (``tests/test_bytecode.py`` checks the list against a start)."""
KEEP_DAYS = 14
"""An entry unused for this long is removed when another one is built."""

_lock = threading.Lock()
_made: dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, str]] = {}


def cache_root() -> str:
    """Where the compiled copies are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flotilla", "code")


def compiled(packages: dict[str, str]) -> dict[str, str]:
    """Import name -> directory, like ``packages``, of their compiled copy (built on first
    use, then kept: see the module docstring); ``packages`` itself where that fails."""
    key = (cache_root(), tuple(sorted(packages.items())))
    with _lock:
        if key not in _made:
            try:
                root = _entry(packages)
                _made[key] = {name: os.path.join(root, name) for name in packages}
            except (OSError, ConfigurationError, py_compile.PyCompileError) as e:
                logger.warning("no compiled copy of the node code (%s): nodes compile it", e)
                _made[key] = dict(packages)
        return _made[key]


def _entry(packages: dict[str, str]) -> str:
    """The cache entry for ``packages``: found, or built."""
    cache = str(private_dir(cache_root()))
    entry = os.path.join(cache, source_key(packages))
    if os.path.isdir(entry):
        private_dir(entry, create=False)  # ours, and nobody else's to write
        os.utime(entry)  # in use: not pruned
        return entry
    tmp = tempfile.mkdtemp(prefix=".build-", dir=cache)
    try:
        for name, path in sorted(packages.items()):
            target = os.path.join(tmp, name)
            shutil.copytree(path, target, ignore=shutil.ignore_patterns(*SKIP))
            compile_tree(target)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not os.path.isdir(entry):  # not another client's build of the same key
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(cache, keep=entry)
    return entry


def source_key(packages: dict[str, str]) -> str:
    """sha256 (hex) of the packages' sources (relative names and contents, byte code left
    out) and of this interpreter's byte code format."""
    h = hashlib.sha256(importlib.util.MAGIC_NUMBER + sys.implementation.cache_tag.encode())
    for name, path in sorted(packages.items()):
        for folder, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            rel = os.path.relpath(folder, path)
            for file in sorted(files):
                if file.endswith((".pyc", ".pyo")):
                    continue
                with open(os.path.join(folder, file), "rb") as f:
                    data = f.read()
                h.update(f"{name}/{rel}/{file}\0{len(data)}\0".encode())
                h.update(data)
    return h.hexdigest()


def compile_tree(root: str) -> None:
    """Write checked-hash byte code for this interpreter next to every ``.py`` under
    ``root`` (whatever ``PYTHONDONTWRITEBYTECODE`` or a ``pycache_prefix`` say)."""
    tag = sys.implementation.cache_tag
    for folder, _, files in os.walk(root):
        for file in files:
            if file.endswith(".py"):
                py_compile.compile(
                    os.path.join(folder, file),
                    cfile=os.path.join(folder, "__pycache__", f"{file[:-3]}.{tag}.pyc"),
                    doraise=True,
                    optimize=0,
                    invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH,
                )


def _prune(cache: str, keep: str) -> None:
    """Remove the entries (and stale builds) nobody used for :data:`KEEP_DAYS`."""
    old = time.time() - KEEP_DAYS * 86400
    for name in os.listdir(cache):
        path = os.path.join(cache, name)
        try:
            if path != keep and os.stat(path).st_mtime < old:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def node_start(name: str, relpath: str) -> bool:
    """Whether the module file ``relpath`` (a path under the package ``name``, e.g.
    ``_node/agent.py``) is in :data:`NODE_START`."""
    package, _, file = f"{name}/{relpath}".rpartition("/")
    return f"{package}/{file.split('.', 1)[0]}" in NODE_START or package + "/" in NODE_START


def entry_of(packages: dict[str, str]) -> str | None:
    """The compiled copy's folder that holds every one of ``packages`` (as
    :func:`compiled` returns them); None when they are not such a copy."""
    folders = {os.path.dirname(path) for path in packages.values()}
    if len(folders) != 1 or not all(is_compiled(path) for path in packages.values()):
        return None
    return folders.pop()


def is_compiled(path: str) -> bool:
    """Whether ``path`` is a compiled copy's (its byte code is ours to ship)."""
    return os.path.realpath(path).startswith(os.path.realpath(cache_root()) + os.sep)
