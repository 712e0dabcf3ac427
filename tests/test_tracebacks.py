"""Remote tracebacks: the user's frames first, flotilla's own frames hidden."""

from __future__ import annotations

import traceback

import pytest

import flotilla as sky
from flotilla._client.tracebacks import RemoteTraceback, user_frames


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
