"""A node's output stream cut into what a terminal would show: lines and in-place updates.

Programs draw progress bars (tqdm, pip, wget) by rewriting one line with ``\\r``. Cut on
``\\n`` alone, such a bar shows nothing until its newline, then one line holding every
state, and the ``\\r`` in it wipes the node's prefix on a terminal. :class:`LineAssembler`
keeps what a terminal would show instead: for a finished line the text after its last
``\\r``; for an unfinished one that has a ``\\r``, its current state (the bar as it stands).

:class:`Throttle` decides which of a bar's states are written where nothing can be redrawn
(a pipe, a log file): the first one, then at most one every ``interval`` seconds; the final
state always comes through as the finished line.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_MAX_PARTIAL = 64 * 1024  # an unfinished line longer than this is cut into a line of its own


class LineAssembler:
    """Turns chunks of one stream into finished lines and the current in-place state.

    ``feed`` returns ``(lines, state)``: the lines finished by this chunk (each the text a
    terminal would show) and, when the unfinished rest of the stream was redrawn with
    ``\\r``, its current text (else None: nothing to redraw).
    """

    __slots__ = ("_partial",)

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, data: bytes) -> tuple[list[str], str | None]:
        buf = self._partial + data
        raw = buf.split(b"\n")
        rest = raw.pop()
        if len(rest) > _MAX_PARTIAL:
            raw.append(rest)
            rest = b""
        self._partial = rest
        lines = [_shown(r) for r in raw]
        state = _shown(rest) if b"\r" in rest else None
        return lines, state

    def flush(self) -> str | None:
        """The unfinished rest as a last line (the stream ended), or None when empty."""
        rest, self._partial = self._partial, b""
        if not rest:
            return None
        text = _shown(rest)
        return text or None

    @property
    def pending(self) -> bool:
        return bool(self._partial)


def _shown(raw: bytes) -> str:
    """What a terminal shows for one line: the text after its last ``\\r`` (a trailing
    ``\\r``, as in ``\\r\\n`` line ends, does not count)."""
    raw = raw.rstrip(b"\r")
    cut = raw.rfind(b"\r")
    if cut >= 0:
        raw = raw[cut + 1 :]
    return raw.decode(errors="replace")


class Throttle:
    """Which in-place states to write as lines: the first, then one per ``interval``.

    ``clock`` is injectable so that tests decide what time it is.
    """

    __slots__ = ("_clock", "_last", "interval")

    def __init__(self, interval: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last: float | None = None

    def due(self) -> bool:
        """Whether a new state should be written now (and, if so, note that it was)."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval:
            return False
        self._last = now
        return True

    def reset(self) -> None:
        """The bar ended (its line finished): the next bar's first state is shown at once."""
        self._last = None
