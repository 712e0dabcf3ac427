"""The exception tree: public names (``flotilla.WorkerDiedError``), pickling by that name,
and the docstring of flotilla._errors drawing every class."""

from __future__ import annotations

import importlib
import os
import pickle
import pkgutil
import re
import subprocess
import sys
import traceback

import cloudpickle
import pytest

import flotilla
import flotilla as sky
from flotilla import _errors

PUBLIC = [name for name in flotilla._EXPORTS["_errors"] if name.endswith("Error")]


def _samples() -> list[sky.FlotillaError]:
    """One instance of every public error, with every attribute set."""
    return [
        sky.FlotillaError("base"),
        sky.ConfigurationError("bad nodes=0"),
        sky.ClusterRequiredError("sky.dict needs a cluster pool"),
        sky.SerializationError("cannot pickle", path="args[1]['x']", type_name="lock"),
        sky.PoolClosedError("closed"),
        sky.ProvisionError("no host", cause=sky.ProvisionCause.UNREACHABLE),
        sky.RemoteError("mymod.Oops", "it broke", "Traceback...", 3),
        sky.TaskTimeoutError("too slow", node=1, timeout=2.5),
        sky.WorkerDiedError("died", node=2, exitcode=-9, signal="SIGKILL", stderr_tail="Killed"),
        sky.NodeLostError("lost", node=0, exitcode=1, stderr_tail="bye"),
    ]


def _state(err: BaseException) -> tuple[object, ...]:
    return type(err).__name__, str(err), err.args, sorted(vars(err).items())


@pytest.mark.parametrize("err", _samples(), ids=lambda e: type(e).__name__)
def test_public_errors_print_as_flotilla_names(err: sky.FlotillaError) -> None:
    name = type(err).__name__
    cls = getattr(sky, name)
    assert cls.__module__ == "flotilla"
    assert repr(cls) == f"<class 'flotilla.{name}'>"
    try:
        raise err
    except sky.FlotillaError as caught:
        formatted = traceback.format_exception(caught)
    assert formatted[-1] == f"flotilla.{name}: {err}\n"
    assert "_errors" not in formatted[-1]


def test_every_public_error_has_a_sample() -> None:
    assert sorted(type(e).__name__ for e in _samples()) == sorted(PUBLIC)


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_errors_pickle_by_their_public_name(dumps: object) -> None:
    for err in _samples():
        err.add_note("a note")
        data = dumps(err)  # type: ignore[operator]
        assert b"_errors" not in data  # by reference, through the public name
        back = pickle.loads(data)
        assert type(back) is type(err)
        assert _state(back) == _state(err)


def test_errors_unpickle_in_a_fresh_interpreter() -> None:
    """Only ``flotilla`` is named in the pickle: a new process finds each class through
    the package's lazy exports."""
    data = pickle.dumps(_samples())
    code = (
        "import pickle, sys; errs = pickle.loads(sys.stdin.buffer.read()); "
        "print(*(f'{type(e).__module__}.{type(e).__qualname__}|{e}' for e in errs), sep='\\n')"
    )
    src = os.path.dirname(os.path.dirname(flotilla.__file__))
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=data,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": src},
        check=True,
    )
    expected = [f"flotilla.{type(e).__name__}|{e}" for e in _samples()]
    assert done.stdout.decode().splitlines() == expected


def test_the_docstring_draws_every_flotilla_error() -> None:
    for info in pkgutil.walk_packages(flotilla.__path__, "flotilla."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    found: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [sky.FlotillaError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo.extend(cls.__subclasses__())
    names = {c.__name__ for c in found if c.__module__.startswith("flotilla")}
    assert {"CLIError", "TaskError", *PUBLIC} <= names
    drawn = set(re.findall(r"^ {4}[│ ]*(?:[├└]── )?(\w+Error)\b", _errors.__doc__ or "", re.M))
    assert drawn == names


def test_the_task_timeout_trap_is_documented_where_it_is_met() -> None:
    """TaskTimeoutError is a TimeoutError, and so is what fut.result(timeout=) raises when
    one stops waiting: the class and the guide (docs/guide.md) say how to tell them apart."""
    import concurrent.futures
    from pathlib import Path

    assert issubclass(sky.TaskTimeoutError, concurrent.futures.TimeoutError)
    doc = sky.TaskTimeoutError.__doc__ or ""
    assert "fut.result(timeout=...)" in doc and "fut.done()" in doc
    guide = (Path(__file__).parent.parent / "docs" / "guide.md").read_text()
    assert "concurrent.futures.TimeoutError" in guide
    assert "catch\n`sky.TaskTimeoutError` first" in guide
