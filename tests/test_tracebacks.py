"""Remote tracebacks: the user's frames first, flotilla's own frames hidden."""

from __future__ import annotations

import json
import linecache
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any

import pytest
from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture

import flotilla as sky
from flotilla._client.tracebacks import RemoteTraceback, user_frames
from flotilla._wire.code import CodeVersionError, shown_name
from flotilla._wire.code import reduce_code as dumps_reduce
from flotilla._wire.serialize import dumps


def inner(x: int) -> float:
    return 1 / x


@sky.function
@sky.stdout(only="head")  # a wrapper of flotilla's own between the executor and the user
def divide(x: int) -> float:
    return inner(x)


def test_user_frames_come_first_and_flotilla_frames_are_hidden(pool2: sky.Compute) -> None:
    with pytest.raises(ZeroDivisionError) as info:
        divide(0) >> pool2
    err = info.value
    assert isinstance(err.__cause__, RemoteTraceback)
    remote = err.__cause__.text
    assert "in divide" in remote and "in inner" in remote
    assert "_output.py" not in remote and "executor.py" not in remote
    assert "1 frame(s) of flotilla's own code hidden" in remote
    printed = "".join(traceback.format_exception(err))
    assert printed.index("in inner") < printed.index("in __rshift__")  # user first, ours last


def test_user_frames_filter_keeps_chained_tracebacks() -> None:
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/x/site-packages/flotilla/_output.py", line 3, in wrapper\n'
        "    return fn()\n"
        '  File "/home/me/train.py", line 9, in step\n'
        "    raise KeyError(1)\n"
        "KeyError: 1\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "/home/me/flotilla_utils.py", line 2, in g\n'
        "    raise ValueError\n"
        "ValueError\n"
    )
    shown = user_frames(tb)
    assert "_output.py" not in shown and "return fn()" not in shown
    assert "train.py" in shown and "flotilla_utils.py" in shown  # not flotilla's package
    assert "During handling" in shown and shown.rstrip().endswith("hidden)")


# -- code shipped by value keeps its file, line and source line ---------------------------
# cloudpickle chooses what a by-value function's co_filename is on the node (3.1.3 writes
# "<dynamic-code>"); flotilla ships code with its file name and source lines itself.
SCRIPT = """\
import json, os, traceback
import flotilla as sky

@sky.function
def fail(x):
    y = x * 2
    raise ValueError(f"bad value {y}")  # the failing line: 7

if __name__ == "__main__":
    ssh = os.environ.get("TEST_SSH_PROVIDER")
    provider = sky.SSH(**json.loads(ssh)) if ssh else sky.Local()
    with sky.Compute(provider=provider, nodes=1) as pool:
        try:
            fail(21) >> pool
        except ValueError as e:
            print("".join(traceback.format_exception(e)))
"""


def _run_script(tmp_path: Path, env: dict[str, str] | None = None) -> str:
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, **(env or {})},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split("The above exception was the direct cause")[0]


def _assert_shows_the_script(remote: str, tmp_path: Path) -> None:
    script = tmp_path / "train_script.py"
    assert f'File "{script}", line 7, in fail' in remote, remote
    assert 'raise ValueError(f"bad value {y}")  # the failing line: 7' in remote, remote
    assert "<dynamic-code>" not in remote


def test_a_script_run_as_main_shows_its_path_line_and_source_line(tmp_path: Path) -> None:
    _assert_shows_the_script(_run_script(tmp_path), tmp_path)


def test_a_script_run_as_main_shows_its_source_over_ssh(ssh_lab: Lab, tmp_path: Path) -> None:
    provider = {
        "hosts": [ssh_lab.hosts[0].addr],
        "user": "root",
        "key": str(ssh_lab.client_key),
        "known_hosts": str(ssh_lab.known_hosts),
        "workdir": str(ssh_lab.tmp / "workdir"),
        "connect_timeout": 5.0,
    }
    remote = _run_script(tmp_path, {"TEST_SSH_PROVIDER": json.dumps(provider)})
    _assert_shows_the_script(remote, tmp_path)


def _function_from(path: str, source: str, name: str) -> Any:
    """A function compiled from ``source`` under the file name ``path`` (as a notebook or a
    script defines one), its lines in ``linecache`` as IPython registers a cell's."""
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, path, "exec"), namespace)
    return namespace[name]


def test_code_carries_its_source_lines_to_a_node_that_cannot_read_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gone.py"
    source = "x = 1\n\ndef broken(a):\n    b = a + 1\n    return b / 0  # line 5\n"
    path.write_text(source)
    fn = _function_from(str(path), source, "broken")
    data = dumps(fn)
    path.unlink()  # the node cannot read the client's file
    node = textwrap.dedent(
        """
        import pickle, sys, traceback
        fn = pickle.loads(sys.stdin.buffer.read())
        try:
            fn(1)
        except ZeroDivisionError:
            traceback.print_exc(file=sys.stdout)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", node], input=data, capture_output=True, timeout=60
    ).stdout.decode()
    assert f'File "{path}", line 5, in broken' in out, out
    assert "return b / 0  # line 5" in out, out


def test_lines_loaded_before_linecache_is_imported_are_in_it_once_it_is(
    tmp_path: Path,
) -> None:
    """A node that has not imported ``linecache`` (its start does without it) keeps a
    function's lines until something imports it: a traceback printed then (its first
    failure), or the user's own ``linecache`` look-up, shows them; and ``linecache`` is
    the module its own loader made."""
    path = tmp_path / "gone.py"
    source = "x = 1\n\ndef broken(a):\n    b = a + 1\n    return b / 0  # line 5\n"
    path.write_text(source)
    data = dumps(_function_from(str(path), source, "broken"))
    path.unlink()
    node = textwrap.dedent(
        """
        import _pickle, sys
        fn = _pickle.loads(sys.stdin.buffer.read())
        print("linecache before:", "linecache" in sys.modules)
        try:
            fn(1)
        except ZeroDivisionError:
            import traceback
            traceback.print_exc(file=sys.stdout)
        import linecache
        print("line 4:", linecache.getline({path!r}, 4), end="")
        loaders = linecache.__loader__, linecache.__spec__.loader
        print("loader:", *(type(loader).__name__ for loader in loaders))
        """
    ).format(path=str(path))
    out = subprocess.run(
        [sys.executable, "-I", "-c", node], input=data, capture_output=True, timeout=60
    ).stdout.decode()
    assert "linecache before: False" in out, out
    assert f'File "{path}", line 5, in broken' in out, out
    assert "return b / 0  # line 5" in out, out
    assert "line 4:     b = a + 1" in out, out
    assert "loader: SourceFileLoader SourceFileLoader" in out, out


def test_a_notebook_cell_gets_a_stand_in_name_the_node_never_opens(pool2: sky.Compute) -> None:
    cell = "/tmp/ipykernel_4242/3141592653.py"  # not a file: ipykernel keeps cells in linecache
    assert not os.path.exists(cell)
    source = "def from_cell(v):\n    return {}[v]  # KeyError here\n"
    fn = sky.function(_function_from(cell, source, "from_cell"))
    with pytest.raises(KeyError) as info:
        fn("k") >> pool2
    remote = info.value.__cause__.text  # type: ignore[union-attr]
    assert 'File "<notebook cell 3141592653>", line 2, in from_cell' in remote, remote
    assert "return {}[v]  # KeyError here" in remote, remote
    assert shown_name("<string>") == "<string>"  # python -c: Python's own stand-in stays
    assert shown_name(__file__) == __file__  # a real file of the client's: its path


def test_code_from_another_python_minor_version_is_refused_not_run() -> None:
    reduced = dumps_reduce(inner.__code__)
    assert reduced is not None
    reducer, (data, version, first, lines) = reduced
    assert reducer(data, version, first, lines).co_name == "inner"  # the same version loads
    with pytest.raises(CodeVersionError, match=r"compiled by Python 3\.99 cannot run"):
        reducer(data, (3, 99), first, lines)
