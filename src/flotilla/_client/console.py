"""What the client shows on its terminal: start-up rows per node, node output, live bars.

On a terminal (stderr is a tty) a live region at the bottom holds one row per node while
a pool starts, builds environments or recovers (its phase, a timer that ticks, the last
line of a running setup step), and one row per node bar (``\\r`` progress) while calls
run; every row is cut to the terminal's width, and finished lines scroll above the
region. The region is drawn with ``rich``, imported only when there is something to draw
(start-up rows appear after half a second, so a fast start imports nothing).

Anywhere else (a pipe, CI, a log file) output is plain lines with no control characters:
the slow start-up phases as ``flotilla: ...`` lines, and of each bar its first state,
then at most one state every few seconds, then its final line; always with the prefix.

Every node line carries one prefix, the same in the API and on the command line:
``(node-1, rank=1)`` (SkyPilot's form: ``node`` is the machine, ``rank`` the process's
global rank, which differs from the node when a node runs several processes). On a
terminal each node's prefix has its own colour (not with ``NO_COLOR`` set).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TextIO

from .lines import Throttle

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.live import Live

_PALETTE = ("cyan", "magenta", "green", "yellow", "blue", "red")
_ANSI = {"cyan": 36, "magenta": 35, "green": 32, "yellow": 33, "blue": 34, "red": 31}
_LIVE_AFTER = 0.5  # seconds of start-up before the rows appear (fast starts show nothing)
_BAR_INTERVAL = 5.0  # seconds between two states of one bar written as lines (not a tty)
ROWS_AT_MOST = 16
"""Start-up rows drawn one per node up to this many nodes; beyond, one per phase."""


def prefix(node: int, rank: int | None = None) -> str:
    """The prefix of a node's lines: ``(node-1, rank=1) ``."""
    return f"(node-{node}, rank={node if rank is None else rank}) "


def node_color(node: int) -> str:
    """The colour of a node's prefix (a ``rich`` style name)."""
    return _PALETTE[node % len(_PALETTE)]


def redact(text: str, secrets: list[str]) -> str:
    """``text`` without the ``secrets`` (imported when there are some: the command line
    imports this module and stays light)."""
    if not secrets:
        return text
    from .._redaction import redact as redact_values

    return redact_values(text, secrets)


def summary(rows: dict[int, list[Any]], now: float) -> list[str]:
    """One line per phase of the start-up ``rows`` (node -> [phase, since, last line]):
    how many nodes are in it, and the one longest in it (where to look when a phase
    drags), phases in the order their longest node entered them."""
    phases: dict[str, list[int]] = {}
    for node, (phase, _since, _last) in sorted(rows.items(), key=lambda r: r[1][1]):
        phases.setdefault(phase, []).append(node)
    total = len(rows)
    out = []
    for phase, nodes in phases.items():
        first = nodes[0]
        out.append(
            f"  {phase} {len(nodes)}/{total} (longest: node-{first}, {now - rows[first][1]:.1f}s)"
        )
    return out


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Console:
    """The client's terminal: start-up rows, node lines and bars. Thread-safe.

    ``out``/``err`` default to ``sys.stdout``/``sys.stderr`` at the time of each write
    (so that redirections made later, as pytest's, are followed).
    """

    def __init__(
        self,
        secrets: Iterable[str] = (),
        out: TextIO | None = None,
        err: TextIO | None = None,
        bar_interval: float = _BAR_INTERVAL,
    ) -> None:
        self._out = out
        self._err = err
        self.secrets = list(secrets)
        self.bar_interval = bar_interval
        self.color = not os.environ.get("NO_COLOR")
        self.lock = threading.RLock()
        # start-up rows: node -> [phase, since, last setup line]
        self.rows: dict[int, list[Any]] = {}
        self.title = ""
        self.started = 0.0
        self.built: dict[int, float] = {}
        self._timer: threading.Timer | None = None
        # bars: (node, rank, stream) -> current state; throttles for the plain case
        self.bars: dict[tuple[int, int, int], str] = {}
        self.throttles: dict[tuple[int, int, int], Throttle] = {}
        self._live: Live | None = None
        # while calls run: a row per node with its metrics (node -> its text), see stats()
        self.stat_rows: dict[int, str] = {}

    # -- where things go -----------------------------------------------------------------
    @property
    def out(self) -> TextIO:
        return self._out if self._out is not None else sys.stdout

    @property
    def err(self) -> TextIO:
        return self._err if self._err is not None else sys.stderr

    @property
    def live(self) -> bool:
        """Whether a live region can be drawn (stderr is a terminal)."""
        return _is_tty(self.err)

    def target(self, stream: int) -> TextIO:
        return self.out if stream == 1 else self.err

    # -- start-up, environment builds, recoveries ------------------------------------------
    def begin(self, nodes: Iterable[int], title: str = "starting") -> None:
        """Show a row per node in ``nodes`` from now on (after a moment, on a terminal)."""
        with self.lock:
            now = time.monotonic()
            self.started = now
            self.title = title
            self.rows = {n: ["provisioning", now, ""] for n in nodes}
            self.built.clear()
            if self.live and self._timer is None:
                self._timer = threading.Timer(_LIVE_AFTER, self._rows_due)
                self._timer.daemon = True
                self._timer.start()

    def set_phase(self, node: int, phase: str) -> None:
        with self.lock:
            row = self.rows.get(node)
            if row is not None:
                row[0], row[1], row[2] = phase, time.monotonic(), ""

    def build_output(self, node: int, data: bytes) -> None:
        """Output of a node's environment build: ``::step NAME`` lines start a step."""
        for line in data.decode(errors="replace").replace("\r", "\n").splitlines():
            if line.startswith("::step "):
                name = line[7:].strip()
                if name == "done":
                    took = time.monotonic() - self.built.get(node, self.started)
                    self.say(f"{prefix(node)}environment built in {took:.1f} s")
                    continue
                with self.lock:
                    self.built.setdefault(node, time.monotonic())
                self.set_phase(node, f"environment ({name})")
                if not self.live:
                    self.say(f"{prefix(node)}building environment: {name}")
            elif line.strip() and not line.startswith("::"):
                with self.lock:
                    row = self.rows.get(node)
                    if row is not None:
                        row[2] = line.strip()

    def end(self, summary: str | None = None) -> None:
        """The rows are done: remove them; ``summary`` is said when rows were shown."""
        with self.lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            shown = self._live is not None and bool(self.rows)
            self.rows = {}
            self._refresh()
        if summary and shown:
            self.say(summary)

    def _rows_due(self) -> None:
        with self.lock:
            self._timer = None
            if self.rows:
                self._ensure_live()

    # -- node output -----------------------------------------------------------------------
    def lines(self, node: int, rank: int, stream: int, lines: list[str]) -> None:
        """Finished lines of a node (each ends a bar of the same node and stream)."""
        if not lines:
            return
        key = (node, rank, stream)
        with self.lock:
            if self.bars.pop(key, None) is not None:
                self._refresh()
            throttle = self.throttles.get(key)
            if throttle is not None:
                throttle.reset()
            self._emit(stream, prefix(node, rank), node, lines)

    def state(self, node: int, rank: int, stream: int, text: str) -> None:
        """A node redrew its unfinished line with ``\\r`` (a progress bar)."""
        key = (node, rank, stream)
        with self.lock:
            if self.live and _is_tty(self.target(stream)):
                self.bars[key] = text
                self._ensure_live()
                return
            throttle = self.throttles.get(key)
            if throttle is None:
                throttle = self.throttles[key] = Throttle(self.bar_interval)
            if throttle.due():
                self._emit(stream, prefix(node, rank), node, [text])

    def stats(self, rows: dict[int, str]) -> None:
        """While calls run (on a terminal): a row per node with its phase and latest
        metrics (``rows``: node -> text, ``observe.stat_row``); ``{}`` removes them."""
        with self.lock:
            if not self.live:
                return
            had = bool(self.stat_rows)
            self.stat_rows = rows
            if rows:
                self._ensure_live()
            elif had:
                self._refresh()

    def say(self, text: str) -> None:
        """A message of flotilla's own: ``flotilla: text`` on stderr."""
        with self.lock:
            self._emit(2, "flotilla: ", None, [text])

    def close(self) -> None:
        """Stop drawing (the pool ended): rows and bars are removed."""
        with self.lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.rows, self.bars, self.stat_rows = {}, {}, {}
            self._stop_live()

    # -- drawing ---------------------------------------------------------------------------
    def _emit(self, stream: int, head: str, node: int | None, lines: list[str]) -> None:
        target = self.target(stream)
        text = [redact(line, self.secrets) for line in lines]
        live = self._live
        if live is not None and _is_tty(target):
            from rich.text import Text

            style = node_color(node) if node is not None and self.color else ""
            for line in text:
                shown = Text(head, style=style)
                shown.append_text(Text.from_ansi(line))
                live.console.print(shown, soft_wrap=True)
            return
        if node is not None and self.color and _is_tty(target):
            head = f"\x1b[{_ANSI[node_color(node)]}m{head}\x1b[0m"
        try:
            target.write("".join(f"{head}{line}\n" for line in text))
            target.flush()
        except (OSError, ValueError):
            pass

    def _ensure_live(self) -> None:
        if self._live is not None:
            return
        from rich.console import Console as RichConsole
        from rich.live import Live

        console = RichConsole(file=self.err, highlight=False, soft_wrap=False)
        self._live = Live(
            get_renderable=self._render,
            console=console,
            refresh_per_second=8,
            transient=True,
            # while rows are drawn, what the program prints goes above them
            redirect_stdout=_is_tty(self.out) and self.out is sys.stdout,
            redirect_stderr=False,
        )
        self._live.start()

    def _stop_live(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()

    def _refresh(self) -> None:
        """Redraw now, or stop drawing when there is nothing left to show."""
        if self._live is None:
            return
        if not self.rows and not self.bars and not self.stat_rows:
            self._stop_live()
        else:
            self._live.refresh()

    def _render(self) -> RenderableType:
        from rich.console import Group
        from rich.text import Text

        # no lock here: Live calls this from its thread while another may hold the lock
        # and wait for that thread to stop; copies of the dicts are consistent enough
        rows, bars = self.rows.copy(), self.bars.copy()
        stat_rows = {} if rows else self.stat_rows.copy()
        now = time.monotonic()
        out: list[Text] = []
        if len(stat_rows) > ROWS_AT_MOST + 1:  # many nodes: the summary row instead
            stat_rows = {-1: stat_rows[-1]} if -1 in stat_rows else {}
        else:
            stat_rows.pop(-1, None)
        for node, text in sorted(stat_rows.items()):
            row = Text(no_wrap=True, overflow="ellipsis")
            if node >= 0:
                row.append(prefix(node), style=node_color(node) if self.color else None)
            row.append(text, style="dim")
            out.append(row)
        if rows:
            elapsed = now - self.started
            out.append(Text(f"flotilla: {self.title} {len(rows)} node(s) {elapsed:4.1f}s"))
        if len(rows) > ROWS_AT_MOST:  # a summary row per phase instead of a row per node
            out += [Text(line, no_wrap=True, overflow="ellipsis") for line in summary(rows, now)]
            rows = {}
        for node, (phase, since, last) in sorted(rows.items()):
            row = Text(no_wrap=True, overflow="ellipsis")
            row.append(prefix(node), style=node_color(node) if self.color else None)
            row.append(f"{phase} {now - since:4.1f}s")
            if last:
                row.append(f"  {redact(last, self.secrets)}", style="dim")
            out.append(row)
        for (node, rank, _), text in sorted(bars.items()):
            row = Text(no_wrap=True, overflow="ellipsis")
            row.append(prefix(node, rank), style=node_color(node) if self.color else None)
            row.append_text(Text.from_ansi(redact(text, self.secrets)))
            out.append(row)
        return Group(*out)
