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
and source line on every provider.

A file name that is not a file on the client (a notebook cell, code compiled from a string
under a made-up path) is replaced by a stand-in in angle brackets (``<notebook cell 42>``),
which ``linecache`` never opens as a path: the node cannot read an unrelated file by
accident. Names already in angle brackets (``<string>`` for ``python -c``, ``<stdin>``) stay.

Standard library only: the node unpickles with ``load_code``.
"""

from __future__ import annotations

import linecache
import marshal
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from types import CodeType

TYPE_CHECKING = False
if TYPE_CHECKING:
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
    ``filename``, beside lines other functions of the same file brought; an entry of a real
    file of the node's with that name is replaced: the client's lines are the truth."""
    entry: tuple[Any, ...] = linecache.cache.get(filename, ())
    have = list(entry[2]) if len(entry) == 4 and entry[1] is None else []
    end = first - 1 + len(lines)
    if len(have) < end:
        have.extend(["\n"] * (end - len(have)))
    have[first - 1 : end] = lines
    # mtime None: checkcache() leaves the entry alone (as for a module's __loader__ source)
    linecache.cache[filename] = (sum(map(len, have)), None, have, filename)
