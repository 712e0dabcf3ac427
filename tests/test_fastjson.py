"""``_system.fastjson``: ``json.dumps``/``json.loads`` without importing ``json`` (a node's
start), giving ``json``'s text, values and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flotilla._system import fastjson

SRC = Path(__file__).resolve().parent.parent / "src"

VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    10**30,
    1.5,
    1e300,
    float("nan"),
    float("inf"),
    -float("inf"),
    "",
    'é\u2028\x00"\\/',
    "\ud800",  # a lone surrogate: json writes it escaped, and reads it back
    [],
    {},
    (1, 2),
    [[[]]],
    {"a": [1, 2, {"b": None}], "c": "d", "n": {"x": float("nan")}},
    {7: 2, 2.5: 3, None: 4, True: 5, False: 6},
]


def _outcome(call: Any, *args: Any, **kwargs: Any) -> str:
    """``repr`` of what ``call`` returns, or of its error's type and words."""
    try:
        return repr(call(*args, **kwargs))
    except Exception as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("value", VALUES, ids=repr)
@pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")])
def test_dumps_writes_what_json_writes(value: Any, separators: tuple[str, str]) -> None:
    assert fastjson.dumps(value, separators=separators) == json.dumps(value, separators=separators)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_loads_reads_what_json_reads_from_text_and_bytes(value: Any) -> None:
    text = json.dumps(value)
    for given in (text, text.encode(), bytearray(text.encode()), f" \n{text}\t\r "):
        assert repr(fastjson.loads(given)) == repr(json.loads(given))


def test_a_value_json_cannot_write_raises_json_s_error() -> None:
    circular: list[Any] = []
    circular.append(circular)
    for value in (object(), {(1, 2): 3}, [set()], circular):
        assert _outcome(fastjson.dumps, value) == _outcome(json.dumps, value)
        assert _outcome(fastjson.dumps, value).startswith(("TypeError", "ValueError"))
    assert fastjson.dumps([1, {"a": 2}]) == '[1, {"a": 2}]'  # nothing left of the errors


BAD = ["", " ", "{", "[1,]", "1 2", "nan", '"\x01"', "\ufeff{}", '{"a" 1}', "[1] x"]
OTHER_ENCODINGS = [
    b"\xff",  # not UTF-8
    b"\xef\xbb\xbf{}",  # UTF-8 behind a byte-order mark: json reads it
    '{"a": "é"}'.encode("utf-16"),
    '["x"]'.encode("utf-16-le"),
    '{"b": 1}'.encode("utf-32-be"),
    3,
    None,
    memoryview(b"{}"),
]


def _id(value: Any) -> str:
    """A test id that is the same in every process (a memoryview's repr has its address:
    pytest-xdist's workers would collect different tests)."""
    return f"memoryview({bytes(value)!r})" if isinstance(value, memoryview) else repr(value)


@pytest.mark.parametrize("given", BAD + OTHER_ENCODINGS, ids=_id)
def test_what_is_not_plain_json_text_gets_json_s_answer(given: Any) -> None:
    """Bad text raises json's JSONDecodeError (position and all); other encodings are
    read by json; a type json refuses is refused with json's words."""
    assert _outcome(fastjson.loads, given) == _outcome(json.loads, given)


def test_the_module_imports_neither_json_nor_re() -> None:
    """The point of it: a clean interpreter that writes and reads JSON with it has not
    imported json (nor re, which json brings)."""
    probe = (
        f"import sys; sys.path.insert(0, {str(SRC)!r})\n"
        "from flotilla._system import fastjson\n"
        "assert fastjson.loads(fastjson.dumps({'a': [1, 2.5, 'x']})) == {'a': [1, 2.5, 'x']}\n"
        "assert fastjson.loads(b'{\"b\": null}') == {'b': None}\n"
        "print(sorted(m for m in ('json', 're') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
