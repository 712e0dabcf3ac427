"""The client's console: lines as a terminal shows them, start-up rows, bars, colours.

The terminal tests run a real terminal (tmux) and read its screen; a driver script steps
through start-up rows and a node's bar, one step per Enter sent to it.
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _tty import Terminal

from flotilla._client.console import Console, prefix
from flotilla._client.lines import LineAssembler, Throttle

ESC = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # control characters but \t and \n


# -- lines as a terminal shows them --------------------------------------------------------
def test_assembler_keeps_what_a_terminal_shows() -> None:
    a = LineAssembler()
    assert a.feed(b"plain\nhalf") == (["plain"], None)
    assert a.feed(b" line\n") == (["half line"], None)
    assert a.feed(b"\r 10%|#") == ([], " 10%|#")
    assert a.feed(b"\r 50%|#####") == ([], " 50%|#####")
    assert a.feed(b"\r100%|##########|\nnext\n") == (["100%|##########|", "next"], None)
    assert a.feed(b"windows\r\n") == (["windows"], None)
    assert a.feed(b"tail") == ([], None)
    assert a.flush() == "tail"
    assert a.flush() is None


def test_assembler_cuts_an_endless_line() -> None:
    a = LineAssembler()
    lines, state = a.feed(b"x" * 70_000)
    assert lines == ["x" * 70_000] and state is None and not a.pending


def test_throttle_lets_one_state_through_per_interval() -> None:
    now = [100.0]
    t = Throttle(5.0, clock=lambda: now[0])
    assert t.due()  # the first state at once
    now[0] = 104.9
    assert not t.due()
    now[0] = 105.0
    assert t.due()
    assert not t.due()
    t.reset()  # a new bar: its first state at once again
    assert t.due()


def test_one_prefix_format() -> None:
    assert prefix(1) == "(node-1, rank=1) "
    assert prefix(1, 5) == "(node-1, rank=5) "


# -- not a terminal --------------------------------------------------------------------------
def test_piped_output_is_plain_throttled_and_complete() -> None:
    out, err = io.StringIO(), io.StringIO()
    console = Console(out=out, err=err, bar_interval=3600)
    a = LineAssembler()
    for k in range(0, 101, 5):
        lines, state = a.feed(f"\r{k:3d}%|{'#' * (k // 10)}".encode())
        console.lines(1, 1, 2, lines)
        if state is not None:
            console.state(1, 1, 2, state)
        console.lines(0, 0, 1, [f"line {k}"])
    lines, state = a.feed(b"|\nafter\n")
    console.lines(1, 1, 2, lines)
    console.begin(range(2))
    console.build_output(0, b"::step pip\nCollecting x\n::step done\n")
    console.end("2 node(s) ready")
    console.close()
    assert ESC.search(out.getvalue() + err.getvalue()) is None
    assert out.getvalue().splitlines() == [f"(node-0, rank=0) line {k}" for k in range(0, 101, 5)]
    got = err.getvalue().splitlines()
    assert got[:3] == [
        "(node-1, rank=1)   0%|",  # the bar's first state
        "(node-1, rank=1) 100%|##########|",  # its final line
        "(node-1, rank=1) after",
    ]
    assert got[3] == "flotilla: (node-0, rank=0) building environment: pip"
    assert re.fullmatch(r"flotilla: \(node-0, rank=0\) environment built in \d+\.\d s", got[4])
    assert len(got) == 5  # no start-up rows nor summary where nothing was drawn


def test_secrets_are_redacted() -> None:
    err = io.StringIO()
    console = Console(secrets=["hunter2"], out=err, err=err)
    console.lines(0, 0, 2, ["token hunter2"])
    console.say("using hunter2")
    assert "hunter2" not in err.getvalue()


# -- a real terminal -------------------------------------------------------------------------
DRIVER = r"""
import sys, termios
sys.path.insert(0, {src!r})
from flotilla._client.console import Console
from flotilla._client.lines import LineAssembler

if sys.stdin.isatty():  # the test's Enter keys must not echo into the drawing
    mode = termios.tcgetattr(0)
    mode[3] &= ~termios.ECHO
    termios.tcsetattr(0, termios.TCSANOW, mode)
console = Console()
long = "Collecting a-package-with-a-rather-long-name==1.2.3 from https://pypi.org/simple/x"
console.begin(range(6))
for node in range(6):
    console.set_phase(node, "environment (pip)")
    console.build_output(node, (long + "\n").encode())
input()
console.set_phase(2, "starting")
input()
console.end("6 node(s) ready in 1.0 s")
print("piped-or-not" if sys.stdout.isatty() else "not a tty", flush=True)
a = LineAssembler()
for k in range(0, 60, 10):
    lines, state = a.feed(f"\r{{k:3d}}%|{{'#' * (k // 10)}}".encode())
    console.state(1, 1, 2, state)
    console.lines(0, 0, 1, [f"line {{k}}"])
input()
lines, _ = a.feed(b"\r100%|##########|\n")
console.lines(1, 1, 2, lines)
console.close()
print("END", flush=True)
"""


@pytest.fixture
def driver(tmp_path: Path) -> Path:
    src = str(Path(__file__).resolve().parent.parent / "src")
    path = tmp_path / "driver.py"
    path.write_text(DRIVER.format(src=src))
    return path


@pytest.fixture
def terminals(tmp_path: Path) -> Iterator[list[Terminal]]:
    made: list[Terminal] = []
    yield made
    for t in made:
        t.close()


def _rows(screen: str) -> list[str]:
    return [line for line in screen.splitlines() if line.strip()]


@pytest.mark.parametrize("width", [44, 160])
def test_startup_rows_redraw_in_place(
    width: int, driver: Path, tmp_path: Path, terminals: list[Terminal]
) -> None:
    term = Terminal([sys.executable, str(driver)], width, 30, tmp_path)
    terminals.append(term)
    screen = term.wait_for(lambda s: "(node-5, rank=5)" in s, "the start-up rows")
    rows = _rows(screen)
    assert len(rows) == 7, screen  # a title and one row per node: none wraps
    assert all(len(r) <= width for r in rows)
    assert all(f"(node-{k}, rank={k}) environment (pip)" in rows[k + 1] for k in range(6))
    # the timers tick without any phase changing
    first = re.search(r"environment \(pip\)\s+(\d+\.\d)s", rows[1])
    assert first is not None
    term.wait_for(lambda s: f"(pip) {first.group(1)}s" not in s and "(pip)" in s, "a timer ticking")
    term.keys("Enter")
    screen = term.wait_for(lambda s: "(node-2, rank=2) starting" in s, "a phase change")
    assert len(_rows(screen)) == 7
    term.keys("Enter")
    screen = term.wait_for(lambda s: "line 50" in s, "the job's lines")
    assert "environment" not in screen and "starting 6" not in screen  # no stale rows
    assert "flotilla: 6 node(s) ready in 1.0 s" in screen


def test_bar_stays_on_one_line_with_its_prefix_and_colours(
    driver: Path, tmp_path: Path, terminals: list[Terminal]
) -> None:
    term = Terminal([sys.executable, str(driver)], 80, 30, tmp_path)
    terminals.append(term)
    term.wait_for(lambda s: "(node-5, rank=5)" in s, "the start-up rows")
    term.keys("Enter")
    term.keys("Enter")
    screen = term.wait_for(lambda s: "line 50" in s and " 50%" in s, "the bar")
    bar_rows = [r for r in _rows(screen) if "%|" in r]
    assert bar_rows == ["(node-1, rank=1)  50%|#####"], screen
    assert [r for r in _rows(screen) if "line " in r] == [
        f"(node-0, rank=0) line {k}" for k in range(0, 60, 10)
    ]
    colored = term.screen(colors=True)
    assert "\x1b[36m(node-0, rank=0)" in colored  # node 0 in cyan
    assert "\x1b[35m(node-1, rank=1)" in colored  # node 1 in magenta
    term.keys("Enter")
    screen = term.wait_for(lambda s: "END" in s, "the end")
    assert [r for r in _rows(screen) if "%|" in r] == ["(node-1, rank=1) 100%|##########|"]


def test_piped_through_a_terminal_has_no_escapes(
    driver: Path, tmp_path: Path, terminals: list[Terminal]
) -> None:
    """Run under a terminal but with both streams piped into a file: plain lines."""
    log = tmp_path / "out.log"
    term = Terminal(["sh", "-c", f"{sys.executable} {driver} >{log} 2>&1"], 80, 30, tmp_path)
    terminals.append(term)
    for _ in range(3):
        term.keys("Enter")
    term.wait_for(lambda s: "[exited]" in s, "the driver's end")
    text = log.read_text()
    assert ESC.search(text) is None, repr(text)
    lines = text.splitlines()
    assert [x for x in lines if "line " in x] == [
        f"(node-0, rank=0) line {k}" for k in range(0, 60, 10)
    ]
    assert "(node-1, rank=1)   0%|" in lines  # the bar's first state
    assert lines[-2:] == ["(node-1, rank=1) 100%|##########|", "END"]


# -- a real pool -----------------------------------------------------------------------------
POOL_SCRIPT = r"""
import sys
sys.path.insert(0, {src!r})
import flotilla as sky

@sky.function
def bar(steps: int) -> int:
    node = sky.instance_info().node
    print(f"before {{node}}", flush=True)
    for k in range(steps + 1):
        sys.stderr.write(f"\r{{k * 100 // steps:3d}}%|{{'#' * (k * 10 // steps):10s}}|")
        sys.stderr.flush()
    sys.stderr.write("\n")
    print(f"after {{node}}", flush=True)
    return node

with sky.Compute(nodes=2) as pool:
    assert bar(50) @ pool == [0, 1]
print("END", flush=True)
"""


def _pool_script(tmp_path: Path) -> Path:
    path = tmp_path / "pool.py"
    path.write_text(POOL_SCRIPT.format(src=str(Path(__file__).resolve().parent.parent / "src")))
    return path


def test_a_node_bar_keeps_its_prefix_on_a_terminal(
    tmp_path: Path, terminals: list[Terminal]
) -> None:
    term = Terminal([sys.executable, str(_pool_script(tmp_path))], 100, 30, tmp_path)
    terminals.append(term)
    screen = term.wait_for(lambda s: "END" in s, "the pool's end")
    rows = _rows(screen)
    assert sorted(r for r in rows if "%|" in r) == [
        f"(node-{k}, rank={k}) 100%|##########|" for k in range(2)
    ], screen  # one line per bar: its final state, with its prefix
    assert sorted(r for r in rows if "before" in r or "after" in r) == sorted(
        f"(node-{k}, rank={k}) {w} {k}" for k in range(2) for w in ("before", "after")
    )


def test_a_node_bar_piped_is_throttled_and_complete(tmp_path: Path) -> None:
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(_pool_script(tmp_path))], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert ESC.search(proc.stdout + proc.stderr) is None
    for k in range(2):
        bars = [x for x in proc.stderr.splitlines() if x.startswith(f"(node-{k}, rank={k}) ")]
        assert bars[-1] == f"(node-{k}, rank={k}) 100%|##########|"
        assert len(bars) <= 2  # the first state (unless it came with the end), then the end
    assert sorted(x for x in proc.stdout.splitlines() if "before" in x or "after" in x) == sorted(
        f"(node-{k}, rank={k}) {w} {k}" for k in range(2) for w in ("before", "after")
    )


MANY = r"""
import sys, termios
sys.path.insert(0, {src!r})
from flotilla._client.console import Console

if sys.stdin.isatty():
    mode = termios.tcgetattr(0)
    mode[3] &= ~termios.ECHO
    termios.tcsetattr(0, termios.TCSANOW, mode)
console = Console()
console.begin(range(128))
for node in range(97):
    console.set_phase(node, "environment (pip)")
input()
console.end("128 node(s) ready in 1.0 s")
print("END", flush=True)
"""


def test_a_large_pool_starts_with_one_row_per_phase(
    tmp_path: Path, terminals: list[Terminal]
) -> None:
    src = str(Path(__file__).resolve().parent.parent / "src")
    path = tmp_path / "many.py"
    path.write_text(MANY.format(src=src))
    term = Terminal([sys.executable, str(path)], 100, 30, tmp_path)
    terminals.append(term)
    screen = term.wait_for(lambda s: "environment (pip) 97/128" in s, "the summary rows")
    rows = _rows(screen)
    assert len(rows) == 3, screen  # a title, then one row per phase: not 128 rows
    assert "starting 128 node(s)" in rows[0]
    assert "provisioning 31/128 (longest: node-97" in screen
    assert "environment (pip) 97/128 (longest: node-0" in screen
    assert "(node-5, rank=5)" not in screen
    term.keys("Enter")
    screen = term.wait_for(lambda s: "END" in s, "the end")
    assert "97/128" not in screen
