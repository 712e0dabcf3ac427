"""The documentation names what exists: a module, class, function or file of flotilla that
a docstring or a doc page cites in double back-quotes (``_client/node.py``,
``flotilla._node.volumes``, ``Compute.map``, ``_switch_python``), or a file a page cites in
single back-quotes (`_client/shm.py`), is there; the README stays short and links to the
pages; the internals page's diagram has the layers of ``tests/test_layers.py`` and the
folders of the package."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_layers import LAYERS

import flotilla

PACKAGE = Path(flotilla.__file__).parent
ROOT = PACKAGE.parent.parent
DOCS = ROOT / "docs"
PAGES = ("guide", "providers", "command-line", "data-and-secrets", "internals", "development")

_QUOTED = re.compile(r"``([^`\n]+)``")
_SINGLE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass
class Index:
    """What the package defines, read from its source (nothing is run)."""

    modules: dict[str, Path] = field(default_factory=dict)  # dotted name -> file
    names: set[str] = field(default_factory=set)  # every name defined anywhere
    members: dict[str, set[str]] = field(default_factory=dict)  # class -> its members
    bases: dict[str, set[str]] = field(default_factory=dict)  # class -> its bases' names

    def has_member(self, cls: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in self.members.get(cls, ()):
            return True
        return any(
            b not in seen and self.has_member(b, name, seen | {cls})
            for b in self.bases.get(cls, ())
        )


def _index(package: Path) -> Index:
    index = Index()
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        index.modules[".".join(parts)] = path
        index.names.add(parts[-1])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                index.names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                index.names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                index.names.add(node.attr)
            if isinstance(node, ast.ClassDef):
                members = index.members.setdefault(node.name, set())
                index.bases.setdefault(node.name, set()).update(
                    b.id if isinstance(b, ast.Name) else b.attr
                    for b in node.bases
                    if isinstance(b, ast.Name | ast.Attribute)
                )
                for inner in ast.walk(node):
                    if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                        members.add(inner.name)
                    elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                        members.add(inner.id)
                    elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
                        members.add(inner.attr)  # self.x = ...
    return index


def _attribute_exists(index: Index, module: str, rest: list[str]) -> bool:
    """``rest`` is reached from the module: by import and getattr, or, past a class, among
    what its source defines (attributes set in its methods too)."""
    if module.endswith("__main__"):
        return not rest  # (importing it would run the command line)
    value: object = importlib.import_module(module)
    for i, name in enumerate(rest):
        submodule = f"{getattr(value, '__name__', '')}.{name}"
        if isinstance(value, type(importlib)) and submodule in index.modules:
            value = importlib.import_module(submodule)
            continue
        if hasattr(value, name):
            value = getattr(value, name)
            continue
        if isinstance(value, type):
            return index.has_member(value.__name__, name) and i == len(rest) - 1
        return False
    return True


def _resolves(index: Index, dotted: str) -> bool | None:
    """Whether a dotted citation names something of flotilla; None when it is not one (a
    variable's attribute, another library's name)."""
    parts = dotted.split(".")
    if parts[0] == "sky":
        parts[0] = "flotilla"
    if parts[0] == "flotilla":
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in index.modules:
                return _attribute_exists(index, ".".join(parts[:n]), parts[n:])
        return False
    # a module named by its last parts (``_node.volumes``, ``aws.orphans``, ``launch``)
    for n in range(len(parts), 0, -1):
        tail = "." + ".".join(parts[:n])
        found = [m for m in index.modules if m.endswith(tail)]
        if found and (n > 1 or parts[0].startswith("_") or len(found) == 1):
            return any(_attribute_exists(index, m, parts[n:]) for m in found)
    if parts[0] in sys.stdlib_module_names:  # ``_socket``, ``_ctypes.dlopen``: Python's
        return None
    private = parts[0].startswith("_") and not parts[0].startswith("__")
    if len(parts) == 1:  # a private name is always flotilla's; a class may be another's
        return parts[0] in index.names if private or parts[0] in index.names else None
    if parts[0] in index.members:  # ``Compute.map``, ``_PoolEvents.output``
        return len(parts) == 2 and index.has_member(parts[0], parts[1])
    return False if private else None  # ``_Gone.x``; ``config.ttl`` is a variable's


def _path_exists(cited: str) -> bool | None:
    """Whether a cited file of flotilla (``_client/node.py``, ``aws/guard.py``,
    ``bringup.py``) is there; None when the citation is not one."""
    if not cited.endswith(".py") or cited.startswith("/"):
        return None
    if cited.startswith(("tests/", "bench/", "examples/", "src/")):
        return (ROOT / cited).exists()
    if cited == "__main__.py" or (PACKAGE / cited).exists():
        return True
    if "/" in cited or cited.split(".")[0] in {p.stem for p in PACKAGE.rglob("*.py")}:
        return any(str(p).endswith("/" + cited) for p in PACKAGE.rglob("*.py"))
    return None  # another program's file (``setup.py``)


def _cited(text: str, markdown: bool = False) -> Iterator[str]:
    """The names ``text`` cites; on a page (``markdown``) also the files it cites in single
    back-quotes (`_client/shm.py`), outside code blocks."""
    for quoted in _QUOTED.findall(text):
        yield quoted.strip().removesuffix("()")
    if markdown:
        for quoted in _SINGLE.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
            if quoted.endswith(".py") and "*" not in quoted:
                yield quoted


def stale_in(index: Index, text: str, markdown: bool = False) -> list[str]:
    """The citations of ``text`` that name something of flotilla that is not there."""
    stale: list[str] = []
    for cited in _cited(text, markdown):
        ok = _path_exists(cited) if "/" in cited or cited.endswith(".py") else None
        if ok is None and _DOTTED.fullmatch(cited):
            ok = _resolves(index, cited)
        if ok is False:
            stale.append(cited)
    return stale


def _documentation(path: Path) -> str:
    """A page's text; a module's docstrings, strings and comments (not its code)."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    strings = [
        c.value
        for c in ast.walk(ast.parse(text))
        if isinstance(c, ast.Constant) and isinstance(c.value, str)
    ]
    return "\n".join([*strings, *(line for line in text.splitlines() if "#" in line)])


@functools.cache
def _package_index() -> Index:
    return _index(PACKAGE)


def test_what_the_docs_cite_exists() -> None:
    sources = [*sorted(PACKAGE.rglob("*.py")), *sorted(DOCS.glob("*.md")), ROOT / "README.md"]
    stale = [
        f"{path.relative_to(ROOT)}: ``{cited}``"
        for path in sources
        for cited in stale_in(_package_index(), _documentation(path), path.suffix == ".md")
    ]
    assert stale == []


@pytest.mark.parametrize(
    "cited",
    [
        "_plugins",  # a module that became plugins/
        "Compute._settle",  # a method that is gone
        "flotilla._node.procs",  # moved to _system
        "_node/procs.py",
        "flotilla.Pool",
        "_node.volumes.S3Client",
        "aws.orphans.nothing_here",
        "_PoolEvents.outputs",
    ],
)
def test_the_citation_check_notices_a_stale_name(tmp_path: Path, cited: str) -> None:
    """The check above can fail: a citation of what is not there is reported, in a
    docstring as on a page."""
    module = tmp_path / "m.py"
    module.write_text(f'"""See ``{cited}``."""\n\nX = 1  # or ``{cited}``\n')
    page = tmp_path / "page.md"
    page.write_text(f"Read ``{cited}`` first.\n")
    assert stale_in(_package_index(), _documentation(module)) == [cited, cited]
    assert stale_in(_package_index(), _documentation(page)) == [cited]
    if cited.endswith(".py"):  # a page's file in single back-quotes too
        assert stale_in(_package_index(), f"See `{cited}`.", markdown=True) == [cited]


@pytest.mark.parametrize(
    "cited",
    [
        "Compute.map",
        "flotilla._system.procs",
        "_system/procs.py",
        "sky.dict",
        "_switch_python",
        "aws.orphans",
        "_PoolEvents.output",
        "_providers.launch",
        "config.ttl",  # a variable's field: not checked
        "PartialState",  # another library's class: not checked
    ],
)
def test_the_citation_check_passes_what_exists(cited: str) -> None:
    assert stale_in(_package_index(), f"Read ``{cited}`` first.") == []


# -- the README and the pages ------------------------------------------------------------------
def test_the_readme_is_short_and_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "./dev demo" in readme and "./dev test" in readme
    for page in PAGES:
        assert f"(docs/{page}.md)" in readme
        assert (DOCS / f"{page}.md").exists()


def _diagram_blocks() -> list[str]:
    text = (DOCS / "internals.md").read_text()
    diagram = text.split("```\n", 2)[1]
    return re.split(r"\n\s*▼\n", diagram)


def _drawn_as(unit: str) -> str:
    if unit == "flotilla":
        return "__init__"
    path = PACKAGE.parent / unit.replace(".", "/")
    return unit.rpartition(".")[2] + ("/" if path.is_dir() else "")


def test_the_internals_diagram_draws_the_layers_and_folders() -> None:
    """The diagram of docs/internals.md has one block per layer of LAYERS, top first, each
    naming its modules and folders (``_client/``, ``_output``), and names every folder of
    the providers."""
    blocks = _diagram_blocks()
    assert len(blocks) == len(LAYERS)
    for block, units in zip(blocks, LAYERS, strict=True):
        for unit in units:
            name = _drawn_as(unit)
            assert re.search(rf"(?<![\w/]){re.escape(name)}(?![\w])", block), (name, block)
    folders = [
        p.name + "/" for p in (PACKAGE / "_providers").iterdir() if (p / "__init__.py").exists()
    ]
    providers = blocks[next(i for i, u in enumerate(LAYERS) if "flotilla._providers" in u)]
    assert [f for f in folders if f not in providers] == []
