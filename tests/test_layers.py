"""The layers: data flows one way (command line -> client -> providers -> specs -> node side
-> wire format -> the standard-library helpers at the bottom), and the node side needs nothing
but the standard library. Every module of the package belongs to one layer (``LAYERS``).

The agent runs on machines that have nothing but a Python: the SSH bootstrap ships only
flotilla and cloudpickle, and an agent must start before any Image is built."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import flotilla
from flotilla._providers import bootstrap

PACKAGE = Path(flotilla.__file__).parent
SRC = PACKAGE.parent

NODE_SIDE = ("flotilla._node", "flotilla._wire", "flotilla._system")
"""The packages the agent and executor are made of."""
NODE_SIDE_ALSO = (
    "flotilla",  # the package: its __init__ loads nothing until a name is used
    "flotilla._version",
    "flotilla.agent",  # python -m flotilla.agent
    "flotilla._info",  # instance_info(), for the plugins' hooks and the task processes
    "flotilla._collections",  # sky.dict, sky.counter...: used by tasks
    "flotilla._errors",  # raised by plugins' checks
    "flotilla.plugins",  # the plugins' classes unpickle in the executor, which enters their hooks
)
"""Other flotilla modules the node side may load (``flotilla.plugins`` with its modules)."""

_PROBE = """
import pkgutil, sys
sys.path.insert(0, {src!r})
before = set(sys.modules)  # the interpreter's own start-up (site, .pth files)
import flotilla, flotilla.agent, flotilla._node, flotilla._wire, flotilla._system, flotilla.plugins
for package in (flotilla._node, flotilla._wire, flotilla._system, flotilla.plugins):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        __import__(info.name)
from flotilla._node.executor import main  # and what it imports before it says READY:
from flotilla._info import instance_info
from flotilla._wire import serialize
from flotilla._node.hooks import enter_plugins
import json
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _node_side_allowed(name: str) -> bool:
    if name.split(".")[0] in sys.stdlib_module_names or name == "__main__":
        return True
    if name in NODE_SIDE_ALSO:
        return True
    return name.startswith(tuple(p + "." for p in (*NODE_SIDE, "flotilla.plugins"))) or (
        name in NODE_SIDE
    )


def _probe(template: str) -> Any:
    """What ``template`` (given ``src``) prints as JSON, run in a clean interpreter (-I)."""
    done = subprocess.run(
        [sys.executable, "-I", "-c", template.format(src=str(SRC))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_node_side_loads_only_the_standard_library() -> None:
    """In a clean interpreter (-I: no PYTHONPATH, no user site, no current folder), importing
    every agent-side module loads nothing from outside the standard library and flotilla's
    node-side modules. The interpreter keeps its site-packages: a third-party import would
    succeed there, and be reported by name."""
    loaded = _probe(_PROBE)
    assert "flotilla._node.agent" in loaded and "flotilla.plugins._torch" in loaded
    assert "flotilla._system.s3" in loaded
    assert [m for m in loaded if not _node_side_allowed(m)] == []


_START_PROBE = """
import sys
sys.path.insert(0, {src!r})
before = set(sys.modules)  # the interpreter's own start-up (site, .pth files)
import flotilla.agent  # what ``python -m flotilla.agent`` loads before main() runs
import flotilla._node.metrics  # and at CONFIG (metrics are on by default)
from flotilla._node import processes
processes.warm()  # before the first executor's fork: what every executor imports
from flotilla._node.hooks import enter_plugins  # and what an executor imports before READY
import flotilla._node.cloud  # and, on a cloud instance, its helper's module
loaded = sorted(set(sys.modules) - before)
import json  # after the list is made: the start does without it
print(json.dumps(loaded))
"""

NOT_AT_START = (
    *("cloudpickle", "rich", "flotilla.plugins", "hashlib", "hmac", "subprocess"),
    *("typing", "dataclasses", "runpy", "traceback"),
    *("json", "pickle", "linecache", "tokenize", "re", "importlib", "warnings", "weakref"),
    *("enum", "signal"),
)
"""Modules a node's start does without (issue 42): the pickler and the plugins come with
the first call that needs them, OpenSSL's hashes with the first broadcast, subprocess
with the first environment build, process-table walk or command metric; typing (the node
side's annotations are for mypy alone), dataclasses (with inspect) and runpy never, nor
traceback (an executor's first failure imports it); nor json (``_system.fastjson`` calls
its accelerator), pickle.py (the node uses ``_pickle``), linecache with tokenize (a
function's lines wait for it, ``_wire.code``), and so no ``re``: ~5 ms of every start; nor
importlib's package, with warnings (``flotilla.__getattr__`` uses ``__import__``), nor
weakref (the client's cache of reduced code objects); nor enum (the wire's kinds and
statuses are plain ints) and signal, which makes four enums as it starts (the node uses
``_signal``, its C module): ~4 ms of a start."""


def _not_at_start(loaded: list[str], allowed: tuple[str, ...] = ()) -> list[str]:
    """The modules of ``loaded`` a node's start does without (:data:`NOT_AT_START`, but
    ``allowed``)."""
    banned = [m for m in NOT_AT_START if m not in allowed]
    return [m for m in loaded if m.split(".")[0] in banned or m in banned]


def test_the_agent_starts_without_the_modules_only_some_pools_use() -> None:
    """The agent's start (every node's, every provider's; its metrics' sampler and a cloud
    instance's helper included) and its executors' (forked from it once it imported what
    they need) import neither cloudpickle, rich nor a plugin's module, nor hashlib, hmac
    or subprocess, nor typing, dataclasses or runpy, nor enum or signal: each costs CPU at
    every node start, and a plain pool never uses them in the agent."""
    loaded = _probe(_START_PROBE)
    assert "flotilla._node.agent" in loaded and "flotilla._node.relay" in loaded
    assert "flotilla._node.executor" in loaded and "flotilla._wire.serialize" in loaded
    assert _not_at_start(loaded) == []
    assert [m for m in loaded if m.startswith("flotilla.plugins")] == []


_WARM_PROBE = """
import sys
sys.path.insert(0, {src!r})
from flotilla._node import processes
processes.warm(shared={shared})
print(__import__("json").dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("shared", [False, True])
def test_dataclasses_are_warmed_once_only_for_a_node_of_several_executor_processes(
    shared: bool,
) -> None:
    """One executor process imports ``dataclasses`` (``instance_info()``, cloudpickle) with
    the first call that needs it, if one does; several would each import it after their
    fork, so the agent imports it once before it forks them (``processes.warm``)."""
    src = str(Path(__file__).resolve().parent.parent / "src")
    out = subprocess.run(
        [sys.executable, "-I", "-c", _WARM_PROBE.format(src=src, shared=shared)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    loaded = json.loads(out.stdout)
    assert "flotilla._node.executor" in loaded
    assert ("dataclasses" in loaded) is shared


def test_the_ssh_start_command_becomes_the_agent_without_runpy(tmp_path: Path) -> None:
    """The start command a remote shell runs (``bootstrap.start_command``: here through a
    local shell, with this interpreter in isolated mode), first start and next, imports
    none of the modules a node's start does without, and runs the agent (which ends at
    the end of its stdin): it calls its ``main`` rather than ``runpy``'s, as ``python -m``
    would."""
    bundle = bootstrap.client_bundle()
    python = f"{sys.executable} -I -X importtime"  # every import, on stderr
    command = bootstrap.start_command(str(tmp_path / "work"), python, bundle)
    for data in (bundle.data, b""):  # the first start installs the bundle
        done = subprocess.run(command, input=data, capture_output=True, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        assert b"FLOTILLA_BOOT AGENT" in done.stdout
        imported = [
            line.rpartition(b"|")[2].strip().decode()
            for line in done.stderr.splitlines()
            if line.startswith(b"import time:")
        ]
        assert "flotilla._node.agent" in imported
        assert _not_at_start(imported) == []


_SERVER_PROBE = """
import sys, signal, threading
sys.path.insert(0, {src!r})
before = set(sys.modules)
handlers = {{s: signal.getsignal(s) for s in signal.valid_signals() if s not in (9, 19)}}
import flotilla._node.forkserver  # what a local pool's fork server holds before it forks
loaded = sorted(set(sys.modules) - before)
import json
changed = [int(s) for s, h in handlers.items() if signal.getsignal(s) != h]
print(json.dumps([loaded, threading.active_count(), changed]))
"""


def test_the_fork_server_holds_nothing_an_agent_must_start_without() -> None:
    """What a local pool's fork server imports before it forks the agents (they inherit
    it): none of the modules an agent starts without (but dataclasses, with what its
    inspect imports, re, linecache, tokenize, importlib, warnings, weakref: it warms
    ``flotilla._info`` for its agents' tasks, once per pool), no plugin, nothing outside the
    standard library and the node side (so no torch or CUDA in a forked process); and it
    starts no thread and sets no signal handler (a fork after either is unsafe)."""
    loaded, threads, handlers = _probe(_SERVER_PROBE)
    assert "flotilla._node.agent" in loaded and "flotilla._node.executor" in loaded
    dataclasses = ("dataclasses", "re", "linecache", "tokenize", "importlib", "warnings", "weakref")
    assert _not_at_start(loaded, allowed=dataclasses) == []
    assert [m for m in loaded if not _node_side_allowed(m)] == []
    assert (threads, handlers) == (1, [])


def test_the_probe_notices_a_foreign_module() -> None:
    """The check above can fail: a third-party or client-side module is reported."""
    assert not _node_side_allowed("cloudpickle")
    assert not _node_side_allowed("flotilla._client.compute")
    assert not _node_side_allowed("flotilla._image")
    assert _node_side_allowed("flotilla._node.agent") and _node_side_allowed("json")


# -- one-way imports ---------------------------------------------------------------------------
LAYERS: tuple[tuple[str, ...], ...] = (
    ("flotilla", "flotilla.__main__"),  # the face: the public names, ``python -m flotilla``
    ("flotilla.cli", "flotilla.server"),  # the command line, and its HTTP server
    ("flotilla._client", "flotilla._output", "flotilla.plugins"),  # the client and its hooks
    ("flotilla._providers", "flotilla.providers"),  # where nodes come from
    (  # the specs a user builds, and what turns them into bytes (both sides of a pool)
        "flotilla._image",
        "flotilla._ignore",
        "flotilla._archive",
        "flotilla._redaction",
        "flotilla._volume",
        "flotilla.storage",
        "flotilla._accelerators",
        "flotilla._worker",
        "flotilla._shard",
        "flotilla.metrics",
        "flotilla.events",
        "flotilla._health",
    ),
    ("flotilla._node", "flotilla.agent", "flotilla._collections", "flotilla._info"),  # node side
    ("flotilla._wire",),  # the protocol: frames, serialization, constants
    ("flotilla._system", "flotilla._errors", "flotilla._version"),  # the standard-library bottom
)
"""The layers, top first: a module imports (at any level: also inside functions and under
TYPE_CHECKING) only from its own layer and the layers below. ``flotilla`` is the package's
``__init__`` alone; every other module falls under exactly one of the other names."""

NODE_ENTRIES = {
    "flotilla.agent": "``python -m flotilla.agent``, which every provider starts",
    "flotilla._client.feeds": "a streamed argument unpickles on the node as the node's reader",
    "flotilla._client.health": "a health check runs on the node as the node's probe",
}
"""The modules above the node side that import ``flotilla._node``: the rest of the client,
the providers and the command line reach the node side only through the protocol
(``_wire``) and share its helpers through ``_system``."""


def _layer(name: str) -> int | None:
    """The index in LAYERS of the layer of a module (or of a name it imports: ``x.y`` in
    ``from x import y``), None for a name of no layer."""
    best: tuple[int, int] | None = None  # (length of the matching name, layer)
    for index, names in enumerate(LAYERS):
        for unit in names:
            if unit == "flotilla":
                continue
            if (name == unit or name.startswith(unit + ".")) and (
                best is None or len(unit) > best[0]
            ):
                best = (len(unit), index)
    return None if best is None else best[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module, relative ones resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            # ``from . import x`` / ``from .. import cli``: the names may be modules
            out.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names)
    return out


NODE_LAYER = next(i for i, names in enumerate(LAYERS) if "flotilla._node" in names)


def _upward(module: str, layer: int, target: str) -> bool:
    """``module`` (of ``layer``) imports ``target`` from a layer above."""
    above = _layer(target)
    if above is None and target.startswith("flotilla."):
        above = 0  # a public name of the face: ``from .. import Pool``
    # (``flotilla`` itself, as the source of ``from .. import x``, is none: x is checked)
    return above is not None and above < layer


def _into_the_node_side(module: str, layer: int, target: str) -> bool:
    """``module``, above the node side and not one of its entries, imports ``_node``."""
    into = (target + ".").startswith("flotilla._node.")
    return into and layer < NODE_LAYER and module not in NODE_ENTRIES


def _violations(path: Path) -> list[str]:
    module = _module_name(path)
    layer = 0 if module == "flotilla" else _layer(module)
    found: dict[int, str] = {}  # one per import statement
    if layer is None:
        return [f"{path.relative_to(SRC)}: {module} is in no layer"]  # give it one in LAYERS
    for line, target in _imports(path):
        if line in found:
            continue
        if _upward(module, layer, target) or _into_the_node_side(module, layer, target):
            found[line] = f"{path.relative_to(SRC)}:{line}: {module} imports {target}"
    return list(found.values())


def test_layers_import_one_way() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30
    assert [v for path in modules for v in _violations(path)] == []


PROVIDER_PACKAGES = (
    "aws",
    "vast",
    "runpod",
    "lambda_cloud",
    "gcp",
    "verda",
    "k8s",
    "container",
    "slurm",
)


def test_providers_share_the_cloud_kit_not_one_another() -> None:
    """The clouds' shared code (keys, boot guard, client identity, port waiting, the SSH
    allocation) is ``_providers/cloud/``: no module of the provider layer imports another
    provider's package (the market, which lists every provider's offers, aside), and the
    kit imports none."""
    found = []
    for path in sorted((PACKAGE / "_providers").rglob("*.py")):
        module = _module_name(path)
        if module == "flotilla._providers.market":
            continue
        own = module.split(".")[2] if module.count(".") >= 2 else ""
        for line, target in _imports(path):
            parts = target.split(".")
            if target.startswith("flotilla._providers.") and len(parts) > 2:
                other = parts[2]
                if other in PROVIDER_PACKAGES and other != own:
                    found.append(f"{path.relative_to(SRC)}:{line}: {module} imports {target}")
    assert found == []


@pytest.mark.parametrize(
    ("where", "source", "expected"),
    [
        ("_wire/x.py", "from .._client import compute\n", "flotilla._client"),
        ("_node/x.py", "def f():\n    from ..cli.main import main\n", "flotilla.cli.main"),
        ("_providers/x.py", "from .. import _client\n", "flotilla._client"),
        ("_client/x.py", "import flotilla.cli.jobs\n", "flotilla.cli.jobs"),
        ("_system/x.py", "from .._wire import frames\n", "flotilla._wire"),
        ("_system/x.py", "def f():\n    from .._info import in_task\n", "flotilla._info"),
        (
            "_wire/x.py",
            "from .._system import procs\nfrom .._node import agent\n",
            "flotilla._node",
        ),
        ("_node/x.py", "from ..plugins import _torch\n", "flotilla.plugins"),
        ("_image.py", "from . import Pool\n", "flotilla.Pool"),
        # above the node side, only its entries import it (helpers come from _system)
        ("_providers/x.py", "from .._node.procs import kill_all\n", "flotilla._node.procs"),
        ("cli/x.py", "from .._node import agent\n", "flotilla._node"),
    ],
)
def test_the_layer_check_notices_a_backward_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, source: str, expected: str
) -> None:
    """The check above can fail: every kind of backward import is reported."""
    fake = tmp_path / "flotilla"
    (fake / where).parent.mkdir(parents=True)
    (fake / where).write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert [v.rpartition(" imports ")[2] for v in _violations(fake / where)] == [expected]


def test_the_layer_check_notices_a_module_of_no_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new top-level module must be given a layer: until then the check above fails."""
    fake = tmp_path / "flotilla" / "_new.py"
    fake.parent.mkdir()
    fake.write_text("import os\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert _violations(fake) == ["flotilla/_new.py: flotilla._new is in no layer"]


# -- no import cycles --------------------------------------------------------------------------
def _import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package under ``root`` it imports (at any level: also
    inside functions and under TYPE_CHECKING), a name resolved to its longest module."""
    paths = {_module_name(p): p for p in sorted((root / "flotilla").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets: set[str] = set()
        for _, target in _imports(path):
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of two modules or
    more (Tarjan's algorithm, without recursion), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    """No module imports, through any chain, a module that imports it: each one can be read
    (and loaded) after what it depends on."""
    graph = _import_graph(SRC)
    assert len(graph) > 30
    assert _cycles(graph) == []


def test_the_cycle_check_notices_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a cycle through three modules, one import under
    TYPE_CHECKING, one inside a function, is reported."""
    package = tmp_path / "flotilla"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
    )
    (package / "d.py").write_text("from .a import b\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert _cycles(_import_graph(tmp_path)) == [["flotilla.a", "flotilla.b", "flotilla.c"]]


def test_the_library_loads_without_the_command_lines_dependencies() -> None:
    """pyyaml and pathspec serve the command line (task files, folder sync): every public
    name of the library loads without them."""
    probe = (
        f"import sys; sys.path.insert(0, {str(SRC)!r}); "
        "sys.modules['yaml'] = sys.modules['pathspec'] = None; "  # importing them fails
        "import flotilla; [getattr(flotilla, name) for name in flotilla.__all__]; "
        "import flotilla.providers"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
