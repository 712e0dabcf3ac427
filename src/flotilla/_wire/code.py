"""Code sent by value keeps its file name and source lines, whatever the serializer does.

A function defined in ``__main__``, a notebook or a test module travels by value: its code
object is rebuilt on the node. What cloudpickle writes in ``co_filename`` is its own choice
(3.1.3 writes ``"<dynamic-code>"`` for every function), and a node usually cannot read the
client's file anyway, so a remote traceback would lose the user's file and source line.

So flotilla sends code objects itself, as ``marshal`` data (the form ``.pyc`` files use:
exact, nested code included) together with the file name, the interpreter version that
compiled it, and the function's source lines from the client's ``linecache``. The node
checks the version (bytecode runs only on the minor version that made it: a mismatch is an
error, never a crash), loads the code and puts those lines in its own ``linecache``, where
Python's traceback formatting finds them: the traceback shows the user's file, line number
and source line on every provider. A node that has not imported ``linecache`` yet (it
brings ``tokenize`` and ``re``: ~3 ms of a node's first call, which rarely fails) keeps the
lines until something imports it (:class:`_WhenImported`, first on ``sys.meta_path`` until
then), and they are in its cache as soon as it is.

A file name that is not a file on the client (a notebook cell, code compiled from a string
under a made-up path) is replaced by a stand-in in angle brackets (``<notebook cell 42>``),
which ``linecache`` never opens as a path: the node cannot read an unrelated file by
accident. Names already in angle brackets (``<string>`` for ``python -c``, ``<stdin>``) stay.

Standard library only: the node unpickles with ``load_code``.
"""

from __future__ import annotations

import marshal
import os
import sys
from collections.abc import Callable, Iterator
from types import CodeType

TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any, TypeAlias

    Reduced: TypeAlias = tuple[Callable[..., CodeType], tuple[Any, ...]]

_reduced: dict[int, Reduced] = {}  # by id(code); an entry goes when its code object does


class CodeVersionError(RuntimeError):
    """Code compiled by one Python minor version was sent to another (bytecode differs)."""


def reduce_code(code: CodeType) -> Reduced | None:
    """``code`` as pickle's reduce value (built once per code object), or None when
    ``marshal`` cannot write it (a constant no compiler makes: let the pickler do it)."""
    key = id(code)
    reduced = _reduced.get(key)
    if reduced is None:
        try:
            reduced = _reduce(code)
        except ValueError:
            return None
        _reduced[key] = reduced
        import weakref  # the client's: a node's start does without it (~0.5-1 ms)

        weakref.finalize(code, _reduced.pop, key, None)
    return reduced


def load_code(
    data: bytes, version: tuple[int, int], first: int, lines: tuple[str, ...]
) -> CodeType:
    """The node's side of ``reduce_code``: the code object, its source lines remembered."""
    if tuple(version) != sys.version_info[:2]:
        here = f"{sys.version_info[0]}.{sys.version_info[1]}"
        raise CodeVersionError(
            f"a function compiled by Python {version[0]}.{version[1]} cannot run on this "
            f"node's Python {here} (bytecode differs between minor versions): run the "
            f"client on Python {here}, or give the provider python= with a "
            f"Python {version[0]}.{version[1]} interpreter on the node"
        )
    code = marshal.loads(data)
    if not isinstance(code, CodeType):
        raise TypeError(f"expected code, got {type(code).__name__}")
    if lines:
        _remember(code.co_filename, first, lines)
    return code


def shown_name(filename: str) -> str:
    """The name a node shows for ``filename``: the path when it is a file on the client,
    else a stand-in in angle brackets that no one can open."""
    if filename.startswith("<") and filename.endswith(">"):
        return filename
    if os.path.isfile(filename):
        return filename
    stem = os.path.splitext(os.path.basename(filename))[0] or "code"
    if "ipykernel" in filename or "ipython" in filename.lower():
        return f"<notebook cell {stem}>"
    return f"<{stem}>"


def _reduce(code: CodeType) -> Reduced:
    lines = _source_lines(code)
    name = shown_name(code.co_filename)
    if name != code.co_filename:
        code = _renamed(code, name)
    return load_code, (marshal.dumps(code), sys.version_info[:2], code.co_firstlineno, lines)


def _source_lines(code: CodeType) -> tuple[str, ...]:
    """The client's lines of ``code``: from its first line (decorators included) to the
    last line any of its code (nested functions too) runs; () when there are none."""
    import linecache  # the client's (imported by then: traceback, inspect, cloudpickle)

    lines = linecache.getlines(code.co_filename)
    if not lines:
        return ()
    numbers = [n for c in _all(code) for _, _, n in c.co_lines() if n is not None]
    last = max(numbers, default=code.co_firstlineno)
    return tuple(lines[code.co_firstlineno - 1 : last])


def _all(code: CodeType) -> Iterator[CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _all(const)


def _renamed(code: CodeType, name: str) -> CodeType:
    consts = tuple(_renamed(c, name) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=name, co_consts=consts)


def _remember(filename: str, first: int, lines: tuple[str, ...]) -> None:
    """Put ``lines`` (``first`` is the number of the first) in ``linecache`` for
    ``filename``, or keep them until it is imported (see the module docstring)."""
    linecache = sys.modules.get("linecache")
    if linecache is not None:
        _put(linecache.cache, filename, first, lines)
        return
    _waiting.append((filename, first, lines))
    if _WhenImported not in sys.meta_path:
        sys.meta_path.insert(0, _WhenImported)


def _put(cache: dict[str, Any], filename: str, first: int, lines: tuple[str, ...]) -> None:
    """Put ``lines`` in ``cache`` (``linecache.cache``) beside lines other functions of the
    same file brought; an entry of a real file of the node's with that name is replaced:
    the client's lines are the truth."""
    entry: tuple[Any, ...] = cache.get(filename, ())
    have = list(entry[2]) if len(entry) == 4 and entry[1] is None else []
    end = first - 1 + len(lines)
    if len(have) < end:
        have.extend(["\n"] * (end - len(have)))
    have[first - 1 : end] = lines
    # mtime None: checkcache() leaves the entry alone (as for a module's __loader__ source)
    cache[filename] = (sum(map(len, have)), None, have, filename)


_waiting: list[tuple[str, int, tuple[str, ...]]] = []
"""Lines loaded before ``linecache`` was imported: (file name, first line number, lines)."""


class _WhenImported:
    """A finder first on ``sys.meta_path`` while lines wait for ``linecache``: it finds
    nothing, but ``linecache`` itself, which the next finders find, and whose loader it
    follows with the lines (it then leaves ``sys.meta_path``, and the module its loader)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    @classmethod
    def find_spec(cls, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name != "linecache":
            return None
        try:
            sys.meta_path.remove(cls)
        except ValueError:
            pass  # another thread's import of linecache took it out
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec: ModuleSpec | None = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = cls(spec.loader)  # type: ignore[assignment]
                return spec
        return None

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        while _waiting:
            _put(module.cache, *_waiting.pop(0))
