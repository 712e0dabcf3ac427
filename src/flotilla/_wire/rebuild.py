"""Functions sent by value are rebuilt on the node without importing cloudpickle.

A function defined in ``__main__``, a notebook or a test module travels by value: cloudpickle
reduces it to calls of its own reconstructors (``_make_function``, ``_function_setstate``,
``_make_cell``, ``subimport``...), which a pickle stream names by reference, so unpickling
it would import cloudpickle, and with it ``logging``, ``platform``, ``uuid``, ``dis``,
``typing``, ``dataclasses``... (15 ms of CPU at an executor's first call, on top of its
own imports; 33 ms in a bare Python 3.11). The client's pickler (``serialize._pickler``)
writes instead ``twin(name)``: this module's exact copy of the reconstructor ``name``,
standard library only. What has no twin here (a class sent by value,
an enum, a TypeVar, a dict view) keeps cloudpickle's reconstructor, which the node then
imports as before.

The twins are copied, with their semantics unchanged, from the module
``cloudpickle.cloudpickle`` of cloudpickle 3.1.3 (https://github.com/cloudpipe/cloudpickle),
identical in 3.0.0, 3.1.0, 3.1.1 and 3.1.2 (``CLOUDPICKLE_SERIES``: the client maps
nothing for a version of another series). cloudpickle's licence (BSD-3-Clause)::

    Copyright (c) 2015, Cloudpickle contributors.
    Copyright (c) 2012, Regents of the University of California.
    Copyright (c) 2009 PiCloud, Inc. http://www.picloud.com.
    All rights reserved.

    Redistribution and use in source and binary forms, with or without modification, are
    permitted provided that the following conditions are met:
        * Redistributions of source code must retain the above copyright notice, this list
          of conditions and the following disclaimer.
        * Redistributions in binary form must reproduce the above copyright notice, this
          list of conditions and the following disclaimer in the documentation and/or other
          materials provided with the distribution.
        * Neither the name of the University of California, Berkeley nor the names of its
          contributors may be used to endorse or promote products derived from this
          software without specific prior written permission.

    THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS" AND ANY
    EXPRESS OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE IMPLIED WARRANTIES OF
    MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE ARE DISCLAIMED. IN NO EVENT SHALL
    THE COPYRIGHT HOLDER OR CONTRIBUTORS BE LIABLE FOR ANY DIRECT, INDIRECT, INCIDENTAL,
    SPECIAL, EXEMPLARY, OR CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT
    OF SUBSTITUTE GOODS OR SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS
    INTERRUPTION) HOWEVER CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER IN CONTRACT, STRICT
    LIABILITY, OR TORT (INCLUDING NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF THE USE
    OF THIS SOFTWARE, EVEN IF ADVISED OF THE POSSIBILITY OF SUCH DAMAGE.
"""

from __future__ import annotations

import builtins
import sys
import types
from types import CellType, CodeType, FunctionType, ModuleType

TYPE_CHECKING = False  # (typing is not imported: the node's start does without it)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

CLOUDPICKLE_SERIES = frozenset({"3.0", "3.1"})
"""The cloudpickle series (major.minor) whose reconstructors (and the function state they
read) were compared with the twins: the same source in 3.0.0 and 3.1.0 to 3.1.3. A patch
release of these keeps the twins (``tests/test_rebuild.py`` compares them with the installed
cloudpickle on every run); a new series maps nothing until it is compared."""


def checked(version: str) -> bool:
    """Whether cloudpickle ``version`` is of a series in :data:`CLOUDPICKLE_SERIES`."""
    return ".".join(version.split(".")[:2]) in CLOUDPICKLE_SERIES


def _make_function(
    code: CodeType,
    globals: dict[str, Any],
    name: str | None,
    argdefs: tuple[Any, ...] | None,
    closure: tuple[CellType, ...] | None,
) -> FunctionType:
    # Setting __builtins__ in globals is needed for nogil CPython (cloudpickle's comment).
    globals["__builtins__"] = builtins.__dict__
    return FunctionType(code, globals, name, argdefs, closure)


def _function_setstate(obj: FunctionType, state: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """Update the state of a function made by ``_make_function``: its ``__globals__`` and
    ``__closure__`` are read-only, so they are filled in place."""
    state_dict, slotstate = state
    obj.__dict__.update(state_dict)

    obj_globals = slotstate.pop("__globals__")
    obj_closure = slotstate.pop("__closure__")
    # the submodules the function uses: unpickling them imported them; nothing more to do
    slotstate.pop("_cloudpickle_submodules")

    obj.__globals__.update(obj_globals)
    obj.__globals__["__builtins__"] = builtins.__dict__

    if obj_closure is not None:
        closure = obj.__closure__
        assert closure is not None
        for i, cell in enumerate(obj_closure):
            try:
                value = cell.cell_contents
            except ValueError:  # cell is empty
                continue
            closure[i].cell_contents = value

    for k, v in slotstate.items():
        setattr(obj, k, v)


def _make_empty_cell() -> CellType:
    return CellType()


class _Empty:
    """The default of ``_make_cell``: no value (``cloudpickle.cloudpickle._empty_cell_value``)."""


_EMPTY = _Empty()


def _make_cell(value: Any = _EMPTY) -> CellType:
    cell = _make_empty_cell()
    if value is not _EMPTY:
        cell.cell_contents = value
    return cell


def subimport(name: str) -> ModuleType:
    # not simply __import__(name): for a submodule it returns the top-level package
    __import__(name)
    return sys.modules[name]


def _builtin_type(name: str) -> Any:
    if name == "ClassType":  # (cloudpickle < 1.3's streams)
        return type
    return getattr(types, name)


TWINS: dict[str, Callable[..., Any]] = {
    "_make_function": _make_function,
    "_function_setstate": _function_setstate,
    "_make_empty_cell": _make_empty_cell,
    "_make_cell": _make_cell,
    "subimport": subimport,
    "_builtin_type": _builtin_type,
}
"""The twins, by the name of the ``cloudpickle.cloudpickle`` function each copies."""


def twin(name: str) -> Callable[..., Any]:
    """The twin of cloudpickle's reconstructor ``name`` (what a stream calls to get it)."""
    return TWINS[name]
