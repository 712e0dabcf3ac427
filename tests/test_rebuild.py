"""Functions sent by value are rebuilt on the node without importing cloudpickle.

The client's pickler names ``flotilla._wire.rebuild``'s twins of cloudpickle's function
reconstructors; a node that unpickles a by-value function (a lambda, a closure, a recursive
function, one that uses modules, builtins and other ``__main__`` functions) never imports
cloudpickle. A class sent by value still goes through cloudpickle."""

from __future__ import annotations

import builtins
import json
import linecache
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import FunctionType
from typing import Any

import cloudpickle
import pytest

import flotilla as sky
from flotilla._wire import rebuild, serialize

SRC = Path(sky.__file__).parent.parent

CASES = '''\
import collections
import math
import os.path
import sys
import types

FUNCTION_TYPE = types.FunctionType
counter = 0


def helper(x):
    return x + 1


def factorial(n):
    return 1 if n <= 1 else n * factorial(n - 1)


def make_closure():
    k = 3

    def inner(x: int, y: int = 2, *, z: int = 5) -> int:
        """inner's doc"""
        return x * k + y + z + helper(0) + int(math.sqrt(16)) + len(os.path.join("a", "b"))

    return inner


def nested(n):
    def square(v):
        return v * v

    return [square(i) for i in range(n)]


def recursive_closure():
    def countdown(n):
        return [] if n == 0 else [n, *countdown(n - 1)]

    return countdown


def empty_cell():
    def later():
        return value

    lookup = later
    value = "set after"
    return lookup


def never_set():
    def f(x):
        return x if x else missing

    if False:
        missing = 1
    return f


def builtin_type(x):
    return [isinstance(helper, FUNCTION_TYPE), type(None).__name__, collections.OrderedDict(a=x)]


def bump(n):
    global counter
    counter += n
    return counter


def read_counter(_):
    return counter


def both(n):
    return [bump(n), read_counter(None)]


def with_attributes(x):
    return [with_attributes.scale * x, with_attributes.__doc__, with_attributes.__qualname__]


with_attributes.scale = 10
with_attributes.__doc__ = "scaled"


def uses_a_class(x):
    class Point:
        def __init__(self, v):
            self.v = v

    return Point(x).v * 2


class ByValue:
    def __init__(self, v):
        self.v = v


def uses_a_class_by_value(x):
    return ByValue(x).v + 1


def probe():
    return "cloudpickle" in sys.modules, os.getpid()
'''

_COMMON = [
    ("lambda", "lambda x: x * 2", 21),
    ("recursive", "factorial", 6),
    ("closure, defaults, kwdefaults, annotations, modules", "make_closure()", 1),
    ("nested function", "nested", 4),
    ("recursive closure", "recursive_closure()", 3),
    ("closure cell set after the def", "empty_cell()", None),
    ("cell never set", "never_set()", 7),
    ("builtin type, module attribute", "builtin_type", 5),
    ("shared globals", "both", 4),
    ("function attributes", "with_attributes", 3),
    ("class defined inside", "uses_a_class", 4),
]


def _main_namespace(tmp_path: Path) -> dict[str, Any]:
    """``CASES`` run as a script's ``__main__`` runs: its functions travel by value."""
    path = tmp_path / "cases_script.py"
    path.write_text(CASES)
    linecache.checkcache(str(path))
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": str(path)}
    exec(compile(CASES, str(path), "exec"), namespace)
    return namespace


_NODE = textwrap.dedent(
    """
    import json, pickle, sys
    sys.path[:0] = json.loads(sys.argv[1])
    fn, arg = pickle.loads(sys.stdin.buffer.read())
    result = fn() if arg is None else fn(arg)
    print(json.dumps({"result": repr(result), "cloudpickle": "cloudpickle" in sys.modules}))
    """
)


def _on_a_fresh_node(data: bytes, *, with_cloudpickle: bool = False) -> dict[str, Any]:
    """Unpickle ``(fn, arg)`` and call ``fn(arg)`` in a fresh interpreter (-I -S: no
    site-packages) whose path holds flotilla's source, as a node's bundle, and cloudpickle
    only when asked."""
    path = [str(SRC)]
    if with_cloudpickle:
        path.append(str(Path(cloudpickle.__file__).parent.parent))
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _NODE, json.dumps(path)],
        input=data,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def _checked_series() -> None:
    """Skips (with what to do) when the installed cloudpickle is of a series the twins were
    not compared with: the client then maps nothing, and a node imports cloudpickle."""
    if not rebuild.checked(cloudpickle.__version__):
        pytest.skip(
            f"cloudpickle {cloudpickle.__version__} is not of a series compared with "
            "flotilla._wire.rebuild's twins: compare its function reconstructors and the "
            "state they read, then add the series to CLOUDPICKLE_SERIES"
        )


def _expected(fn: Any, arg: Any) -> str:
    return repr(fn() if arg is None else fn(arg))


@pytest.mark.parametrize(("case", "expression", "arg"), _COMMON, ids=[c[0] for c in _COMMON])
def test_a_function_sent_by_value_is_rebuilt_without_cloudpickle(
    tmp_path: Path, case: str, expression: str, arg: Any
) -> None:
    _checked_series()
    namespace = _main_namespace(tmp_path)
    fn = eval(expression, namespace)
    data = serialize.dumps((fn, arg))
    expected = _expected(fn, arg)  # (after pickling: "shared globals" changes a global)
    node = _on_a_fresh_node(data)
    assert node == {"result": expected, "cloudpickle": False}, case


def _shape(fn: Any) -> dict[str, Any]:
    """What a rebuilt function is made of, comparable between two rebuilds."""
    return {
        "names": (fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__),
        "defaults": (fn.__defaults__, fn.__kwdefaults__, fn.__annotations__),
        "dict": {k: v for k, v in vars(fn).items() if k != "__wrapped__"},
        "globals": sorted(fn.__globals__),
        "builtins": fn.__globals__["__builtins__"] is builtins.__dict__,
        "cells": [_contents(cell) for cell in fn.__closure__ or ()],
    }


def _contents(cell: Any) -> str:
    try:
        value = cell.cell_contents
    except ValueError:
        return "<empty>"
    return f"<function {value.__qualname__}>" if type(value) is FunctionType else repr(value)


@pytest.mark.parametrize(("case", "expression", "arg"), _COMMON, ids=[c[0] for c in _COMMON])
def test_the_twins_rebuild_what_cloudpickle_rebuilds(
    tmp_path: Path, case: str, expression: str, arg: Any
) -> None:
    _checked_series()
    fn = eval(expression, _main_namespace(tmp_path))
    twins = pickle.loads(serialize.dumps(fn))
    theirs = pickle.loads(cloudpickle.dumps(fn, protocol=5))
    assert type(twins) is type(theirs) is FunctionType
    assert _shape(twins) == _shape(theirs), case


def test_a_class_sent_by_value_still_goes_through_cloudpickle(tmp_path: Path) -> None:
    namespace = _main_namespace(tmp_path)
    fn = namespace["uses_a_class_by_value"]
    node = _on_a_fresh_node(serialize.dumps((fn, 41)), with_cloudpickle=True)
    assert node == {"result": "42", "cloudpickle": True}


def test_an_unchecked_cloudpickle_version_keeps_cloudpickles_reconstructors() -> None:
    _checked_series()
    assert serialize._twins(cloudpickle)
    patch = type(cloudpickle)("cloudpickle")
    patch.__dict__.update(vars(cloudpickle), __version__=cloudpickle.__version__ + "9")
    assert serialize._twins(patch) == serialize._twins(cloudpickle)  # a patch release
    unknown = type(cloudpickle)("cloudpickle")
    unknown.__dict__.update(vars(cloudpickle), __version__="99.0.0")
    assert serialize._twins(unknown) == {}


@pytest.fixture
def pool1() -> Iterator[sky.Compute]:
    """A fresh one-node local pool: its executor has run nothing yet."""
    with sky.Compute(nodes=1) as pool:
        yield pool


def test_a_main_function_runs_on_a_node_whose_executor_never_imports_cloudpickle(
    tmp_path: Path, pool1: sky.Compute
) -> None:
    _checked_series()
    namespace = _main_namespace(tmp_path)
    probe = sky.function(namespace["probe"])
    imported, pid = probe() >> pool1
    assert pid != os.getpid()
    assert imported is False
    by_value = sky.function(namespace["uses_a_class_by_value"])
    assert by_value(1) >> pool1 == 2  # a class by value: cloudpickle, as before
