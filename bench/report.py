"""BENCHMARKS.md from the raw results of one run of bench.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stats import Summary
from systems import SYSTEMS

FLOTILLA = "flotilla"
FLOOR = "raw pipes (floor)"
PINNED = "raw pipes, pinned to 2 CPUs"
RELAYED = "raw pipes, relayed like flotilla"
PEERS = ("Ray", "Dask", "multiprocessing", "torchrun")

# the goals for flotilla
COLD_START_MAX = 0.25  # s, start → first result
ROUND_TRIP_MAX = 250e-6  # s
ROUND_TRIP_FLOOR_RATIO = 3.0
THROUGHPUT_MIN = 10_000.0  # calls/s
MEMORY_MAX = 60e6  # bytes, agent + executor RSS

TIMES = "\N{MULTIPLICATION SIGN}"


@dataclass(frozen=True)
class Row:
    system: str
    what: str
    summary: Summary | None  # None: not measured
    note: str = ""  # why there is no summary
    goal: str = ""
    passed: bool | None = None


Unit = Callable[[float], str]


def seconds(v: float) -> str:
    return f"{v:.3f} s"


def milliseconds(v: float) -> str:
    return f"{v * 1e3:.1f} ms"


def microseconds(v: float) -> str:
    return f"{v * 1e6:.1f} µs"


def per_second(v: float) -> str:
    return f"{v:,.0f} /s"


def megabytes(v: float) -> str:
    return f"{v / 1e6:.1f} MB"


def render(results: dict[str, Any]) -> str:
    meta, warm = results["meta"], results["warm"]
    sections = [
        _cold_start(results["cold"], meta),
        _round_trip(warm),
        _throughput(warm),
        _broadcast(warm),
        _memory(warm),
    ]
    parts = [_header(meta), _goals(sections), *(s.markdown() for s in sections), _method()]
    return "\n\n".join(p.strip() for p in parts) + "\n"


@dataclass(frozen=True)
class Section:
    title: str
    text: str
    rows: list[Row]
    unit: Unit

    def markdown(self) -> str:
        return f"## {self.title}\n\n{self.text}\n\n{_table(self.rows, self.unit)}"


def _goals(sections: list[Section]) -> str:
    lines = ["## flotilla's goals", "", "| metric | goal | flotilla (median) | result |"]
    lines.append("| --- | --- | ---: | --- |")
    for section in sections:
        for row in section.rows:
            if row.passed is not None and row.summary is not None:
                measured = section.unit(row.summary.median)
                lines.append(
                    f"| {section.title} | {row.goal} | {measured} | {_verdict(row.passed)} |"
                )
    lines += _peer_ratios(sections)
    return "\n".join(lines)


PEER_GOALS = (  # issue 22: flotilla's median against a peer's, both of this run
    ("Warm no-op round trip", "multiprocessing", "≤", 0.7),
    ("Throughput", "multiprocessing", "≥", 3.0),
    ("Broadcast of a 100 MB array", "Ray", "≤", 1.0),
)


def _peer_ratios(sections: list[Section]) -> list[str]:
    """The goals rows of the same-run ratios (the peer's median in the same run)."""
    lines = []
    by_title = {s.title: s for s in sections}
    for title, peer, sign, limit in PEER_GOALS:
        section = by_title.get(title)
        if section is None:
            continue
        mine, theirs = _median_of(section.rows, FLOTILLA), _median_of(section.rows, peer)
        if mine is None or theirs is None:
            continue
        ratio = mine / theirs
        passed = ratio <= limit if sign == "≤" else ratio >= limit
        measured = f"{ratio:.2f}{TIMES} ({section.unit(mine)} vs {section.unit(theirs)})"
        goal = f"{sign} {limit:g}{TIMES} {peer}'s, same run"
        lines.append(f"| {title} | {goal} | {measured} | {_verdict(passed)} |")
    return lines


def _verdict(passed: bool | None) -> str:
    return "" if passed is None else ("**PASS**" if passed else "**FAIL**")


# -- the metrics -------------------------------------------------------------------------


def _cold_start(cold: dict[str, Any], meta: dict[str, Any]) -> Section:
    rows: list[Row] = []
    for name in (FLOTILLA, *PEERS):
        what = _what(name, "cold_start")
        if name not in cold:
            note = meta.get("skipped", {}).get(name, "not measured")
            rows.append(Row(name, what, None, note))
            continue
        trials, errors = cold[name]["trials"], cold[name]["errors"]
        failed = errors[0] if errors else None
        first = _summary(trials or failed, lambda ts: [t["first"] for t in ts])
        total = _summary(trials or failed, lambda ts: [t["total"] for t in ts])
        goal, passed = "", None
        if name == FLOTILLA and isinstance(first, Summary):
            goal, passed = f"≤ {COLD_START_MAX} s", first.median <= COLD_START_MAX
        rows.append(_row(name, f"{what}: start → first result", first, goal, passed))
        rows.append(_row(name, "… including teardown", total))
    return Section(
        "Cold start",
        "From starting the pool (entering `Compute(nodes=4)`) to the results of a no-op on "
        "its 4 workers, then the same including teardown. Each trial runs in a fresh process "
        "whose imports are done before the clock starts (the files are in the page cache: "
        "warm but fresh); one untimed trial per system comes first, and the trials of the "
        "systems are interleaved.",
        rows,
        seconds,
    )


def _round_trip(warm: dict[str, Any]) -> Section:
    rows = _warm_rows(warm, "round_trip", (FLOTILLA, *PEERS, FLOOR, PINNED, RELAYED))
    floor = _median_of(rows, FLOOR)
    rows = [_judge_round_trip(r, floor) if r.system == FLOTILLA else r for r in rows]
    return Section(
        "Warm no-op round trip",
        "One no-op call on a warm pool, sent and waited for, one at a time (after a warm-up). "
        "The floor is a 16-byte ping-pong between two Python processes over plain pipes. A "
        "pipe round trip costs a few µs when the kernel keeps both processes on one CPU "
        "and tens of µs across CPUs, hence the spread (and the pinned row, for orientation). "
        "The relayed row sends the same ping-pong along flotilla's path with no other work: "
        "client → relay process (the agent) → echo process (the executor) and back, the "
        "reply read by an asyncio loop thread that wakes the caller through a Future (the "
        "client's loop thread): the floor of that design. The goal compares flotilla with "
        "the first floor row (unpinned, as the kernel schedules it).",
        rows,
        microseconds,
    )


def _judge_round_trip(row: Row, floor: float | None) -> Row:
    if row.summary is None or floor is None:
        return row
    median = row.summary.median
    ratio = median / floor
    fast, close = median <= ROUND_TRIP_MAX, ratio <= ROUND_TRIP_FLOOR_RATIO
    limit = microseconds(floor * ROUND_TRIP_FLOOR_RATIO)
    goal = (
        f"≤ {microseconds(ROUND_TRIP_MAX)} ({_met(fast)}) and ≤ "
        f"{ROUND_TRIP_FLOOR_RATIO:.0f}{TIMES} floor = {limit} ({_met(close)}: {ratio:.1f}{TIMES})"
    )
    return Row(row.system, row.what, row.summary, row.note, goal, fast and close)


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _throughput(warm: dict[str, Any]) -> Section:
    rows = _warm_rows(warm, "throughput", (FLOTILLA, *PEERS))
    rows = [
        _with_goal(r, f"≥ {THROUGHPUT_MIN:,.0f} /s", lambda s: s.median >= THROUGHPUT_MIN)
        for r in rows
    ]
    return Section(
        "Throughput",
        "10,000 no-op calls submitted at once to 4 workers, until every result is back; "
        "calls per second (higher is better, so a ratio above 1 means faster than flotilla).",
        rows,
        per_second,
    )


def _broadcast(warm: dict[str, Any]) -> Section:
    rows = _warm_rows(warm, "broadcast", (FLOTILLA, *PEERS, FLOOR))
    floor = _median_of(rows, FLOOR)
    if floor is not None:
        goal = f"≤ floor ({milliseconds(floor)})"
        rows = [_with_goal(r, goal, lambda s: s.median <= floor) for r in rows]
    return Section(
        "Broadcast of a 100 MB array",
        "A 100 MB float64 numpy array sent to 4 workers, each returning its sum, on a warm "
        "pool. The floor writes the array into the stdin pipes of 4 waiting child processes, "
        "one after the other; each reads all of it (into a buffer it reuses) and replies "
        "with the sum.",
        rows,
        milliseconds,
    )


def _memory(warm: dict[str, Any]) -> Section:
    rows: list[Row] = []
    for name in (FLOTILLA, *PEERS):
        rows.extend(_memory_rows(name, warm.get(name, {}).get("memory")))
    return Section(
        "Idle node memory",
        "What one node costs in memory on a pool that has just run a no-op (before numpy is "
        "ever imported there), over the 4 nodes. flotilla's pids come from a task: "
        "`os.getpid()` is the executor and `os.getppid()` its agent. RSS is VmRSS from "
        "`/proc/PID/status`; PSS (from `/proc/PID/smaps_rollup`) splits the pages a "
        "process shares (the executor is forked from its agent) among their users.",
        rows,
        megabytes,
    )


def _memory_rows(name: str, memory: Any) -> list[Row]:
    what = _what(name, "memory")
    if not what:
        return []
    if not isinstance(memory, list):
        return [Row(name, what, None, _failure(memory))]
    rows = []
    for key in ("rss", "pss"):
        summary = Summary.of([float(sum(node[key])) for node in memory])
        goal, passed = "", None
        if name == FLOTILLA and key == "rss":
            goal, passed = f"≤ {MEMORY_MAX / 1e6:.0f} MB", summary.median <= MEMORY_MAX
        rows.append(Row(name, f"{what}: {key.upper()}", summary, "", goal, passed))
    if name == FLOTILLA:  # each process alone
        for i, process in enumerate(SYSTEMS[name].node_processes):
            summary = Summary.of([float(node["rss"][i]) for node in memory])
            rows.append(Row(name, f"{process} alone: RSS", summary))
    return rows


# -- rows and tables ---------------------------------------------------------------------


def _warm_rows(warm: dict[str, Any], metric: str, names: tuple[str, ...]) -> list[Row]:
    rows = []
    for name in names:
        if metric not in SYSTEMS[name].measures:
            continue
        measured = warm.get(name, {}).get(metric) if name in warm else None
        if measured is None and name not in warm:
            continue  # a system this run left out (torchrun: cold start only)
        rows.append(_row(name, _what(name, metric), _summary(measured, lambda xs: xs)))
    return rows


def _summary(measured: Any, values: Callable[[list[Any]], list[float]]) -> Summary | str:
    """The summary of what was measured, or why there is none."""
    if isinstance(measured, list) and measured:
        return Summary.of(values(measured))
    return _failure(measured)


def _failure(measured: Any) -> str:
    if isinstance(measured, dict) and "error" in measured:
        return f"failed: {measured['error']}"
    return "not measured"


def _row(
    name: str, what: str, summary: Summary | str, goal: str = "", passed: bool | None = None
) -> Row:
    if isinstance(summary, str):
        return Row(name, what, None, summary, goal, None)
    return Row(name, what, summary, "", goal, passed)


def _with_goal(row: Row, goal: str, check: Callable[[Summary], bool]) -> Row:
    if row.system != FLOTILLA or row.summary is None:
        return row
    return Row(row.system, row.what, row.summary, row.note, goal, check(row.summary))


def _median_of(rows: list[Row], name: str) -> float | None:
    for row in rows:
        if row.system == name and row.summary is not None:
            return row.summary.median
    return None


def _what(name: str, metric: str) -> str:
    return SYSTEMS[name].measures.get(metric, "") if name in SYSTEMS else ""


def _table(rows: list[Row], unit: Unit) -> str:
    reference = _median_of(rows, FLOTILLA)
    lines = [
        "| system | what | median | p10 | p90 | n | ÷ flotilla | goal | result |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for row in rows:
        s = row.summary
        if s is None:
            cells = [row.note, "", "", "", ""]
        else:
            ratio = f"{s.median / reference:.2f}{TIMES}" if reference else ""
            cells = [unit(s.median), unit(s.p10), unit(s.p90), str(s.n), ratio]
        verdict = _verdict(row.passed)
        lines.append("| " + " | ".join([row.system, row.what, *cells, row.goal, verdict]) + " |")
    return "\n".join(lines)


# -- header and footer -------------------------------------------------------------------


def _header(meta: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    quick = "; a `--quick` smoke run with few samples" if meta.get("quick") else ""
    return f"""
# flotilla benchmarks

* Run: {meta["date"]}, commit `{meta["commit"]}`{meta["tree"]}, `./dev bench`,
  {meta["duration"]:.0f} s in all{quick}.
* Machine: {meta["cpus"]} CPUs ({meta["cpu_model"]}), {meta["memory_gb"]:.0f} GB of memory,
  Linux {meta["kernel"]}, Python {meta["python"]}.
* Versions: {versions}.
* Other work on the machine: processes outside the benchmark used
  {meta["other_cpu"]:.0%} of the CPU time during the run (1-minute load average at the start:
  {meta["load"]:.2f}); anything else running skews the numbers.

flotilla and its peers (Ray, Dask, multiprocessing; torchrun for the cold start when torch
is installed) are measured in the same run, each with 4 workers on this 2-CPU machine, so
every system is oversubscribed the same way. Each table gives the median, the 10th and
90th percentiles and the number of samples `n`; `÷ flotilla` is the row's median divided by
flotilla's. The goals are the project's, for flotilla; the peers are there for orientation.
The raw JSON of the run is in `bench/results/` (not committed).

How to rerun: `./dev bench` (it installs the peers once into `.venv-bench`, runs
`bench/bench.py` and the other benchmarks, and rewrites the sections they produce: a
section written by hand for an issue stays, see `bench/sections.py`); `./dev bench --quick`
for a fast smoke run (its report goes to `bench/results/BENCHMARKS-quick.md`).
"""


def _method() -> str:
    return """
## How the numbers are taken

* Cold start: `bench/trial.py cold SYSTEM` in a fresh process per trial; the library is
  imported, then a stopwatch runs around start → first no-op result → teardown.
* Warm metrics: `bench/trial.py warm SYSTEM` starts one pool per system in a fresh process,
  runs a no-op on it, reads the idle memory, then measures the round trip (200 untimed
  calls first, then up to 2,000 timed ones or 3 s), the throughput (one untimed batch, then
  up to 5 batches or 25 s) and the broadcast (one untimed, then up to 7 or 15 s). Results
  are checked (count of results, sums of the array).
* Every loop is bounded in count and in time (`bench/stats.py: sample`); a system that
  fails or hangs (2 min per cold trial, 5 min per warm one) is reported as failed, and the
  others are still measured.
* Ray is started with `ray.init(num_cpus=4, include_dashboard=False)` and stopped with
  `ray.shutdown()`; Dask with `LocalCluster(n_workers=4, threads_per_worker=1,
  processes=True)` (dashboard off, logs silenced); multiprocessing uses the spawn context.
* The functions every system runs are the same plain functions (`bench/tasks.py`).
"""
