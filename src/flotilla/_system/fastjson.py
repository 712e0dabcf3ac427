"""``json.dumps`` and ``json.loads`` without importing ``json``, for a node's start.

``json`` imports ``re`` and compiles five expressions as it is imported (~1.5-2 ms of
every node's start, ``/usr/bin/python3`` 3.11, after the agent's other imports), though
what it does with default options is done by its C accelerator, ``_json``. This module
calls the accelerator as ``json`` does (``json.encoder.JSONEncoder.iterencode`` in one
shot, ``json.decoder.JSONDecoder.decode``), with ``json``'s default options, so
its text and its values are ``json``'s. Anything else goes to ``json`` itself, imported
then: an interpreter without ``_json``, an accelerator that takes other arguments, bytes
in UTF-16 or UTF-32 or behind a byte-order mark (``json.detect_encoding``), and every
error (a value ``json`` cannot write, text it cannot read), which ``json`` then raises as
it would have. ``tests/test_fastjson.py`` compares the two.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

try:
    from _json import encode_basestring_ascii as _ascii
    from _json import make_encoder as _make_encoder
    from _json import make_scanner as _make_scanner
except ImportError:  # an interpreter without json's accelerator: json does it all
    _ascii = _make_encoder = _make_scanner = None  # type: ignore[assignment,misc]

_WHITESPACE = " \t\n\r"
"""What ``json.decoder.WHITESPACE`` matches around a document."""
_ENCODINGS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")
"""Byte-order marks, which ``json.detect_encoding`` reads (UTF-8-sig, UTF-16, UTF-32)."""


_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}


class _Decoding:
    """What ``_json.make_scanner`` reads of a ``json.JSONDecoder()``: its defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__


def _default(o: Any) -> Any:
    """``json.JSONEncoder.default``: a value json cannot write (json then says which)."""
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


_scan: Callable[[str, int], tuple[Any, int]] | None = None


def dumps(obj: Any, separators: tuple[str, str] = (", ", ": ")) -> str:
    """``json.dumps(obj, separators=separators)``."""
    if _make_encoder is not None:
        try:
            if isinstance(obj, str):
                return _ascii(obj)
            # a new encoder each time, as json makes: its circular-reference markers
            # are left behind by an error
            item, key = separators
            encode = _make_encoder({}, _default, _ascii, None, key, item, False, False, True)
            return "".join(encode(obj, 0))
        except (TypeError, ValueError, RecursionError):
            pass  # json raises the error as it words it (or takes other arguments)
    import json

    return json.dumps(obj, separators=separators)


def loads(text: str | bytes | bytearray) -> Any:
    """``json.loads(text)``."""
    global _scan
    if _make_scanner is not None:
        try:
            s = text
            if isinstance(s, (bytes, bytearray)):
                if s.startswith(_ENCODINGS) or 0 in s[:4]:
                    raise ValueError("not UTF-8: json.detect_encoding reads it")
                s = s.decode("utf-8", "surrogatepass")
            elif not isinstance(s, str):
                raise TypeError("json says what it reads")
            if _scan is None:  # json.decoder passes its decoder as the context
                _scan = _make_scanner(_Decoding())  # type: ignore[arg-type]
            value, end = _scan(s, len(s) - len(s.lstrip(_WHITESPACE)))
            if not s[end:].strip(_WHITESPACE):
                return value
        except (StopIteration, ValueError, TypeError, RecursionError):
            pass  # json raises the error as it words it
    import json

    return json.loads(text)
