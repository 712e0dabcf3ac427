"""A lone call's round trip against ``Pool.apply``, on the machine as it is and with two
busy-loop processes per core added: same run, each system in a fresh process (issue 42).

    .venv/bin/python bench/bench_wait.py [--rounds 5] [--calls 2000] [--before SRC]

Each round measures, for each condition (``as is``, then ``busy``: 2 busy loops per core
that this script starts for the condition and ends after it), flotilla's ``noop() >> pool``
and multiprocessing's ``Pool.apply(noop)`` one after the other (the order rotating between
rounds), each in a fresh process (``bench/trial.py``'s systems, 4 workers): the median of up
to ``--calls`` round trips (3 s at most, after 200 untimed ones), and the CPU seconds per
call that the measuring process and the pool's processes spent (``/proc/PID/stat``:
load-independent, unlike the time). ``--before SRC`` adds flotilla from another source
folder (the code before a change) to every measurement set.

Progress goes to stderr, one line per measurement; stdout gets the report: a markdown table
of every round (the same-run ratio, the load before and after it: ``/proc/loadavg``'s
1-minute average and the threads runnable) and the medians per condition with their spread,
as ``./dev bench`` puts it in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def _tree(pid: int) -> list[int]:
    """``pid``'s descendants (its pool's processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def measure(system_name: str, calls: int) -> dict[str, Any]:
    """In this (fresh) process: the round trips of ``system_name``."""
    sys.path.insert(0, str(HERE))
    from stats import sample
    from systems import SYSTEMS

    system = SYSTEMS[system_name]()
    system.start()
    try:
        system.first()
        for _ in range(200):
            system.round_trip()
        pids = _tree(os.getpid())
        cpu0 = sum(_cpu(p) for p in pids) + time.process_time()
        times = sample(system.round_trip, count=calls, budget=3.0)
        cpu = sum(_cpu(p) for p in pids) + time.process_time() - cpu0
    finally:
        system.stop()
    return {"median": statistics.median(times), "n": len(times), "cpu_per_call": cpu / len(times)}


def _load() -> str:
    fields = Path("/proc/loadavg").read_text().split()
    return f"{fields[0]} ({fields[3].split('/')[0]} runnable)"


def _running(loops: int) -> None:
    """Wait (3 s at most) until the kernel counts ``loops`` more threads runnable."""
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) > loops:
            return
        time.sleep(0.01)


def run(system_name: str, calls: int, src: str = "") -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=src) if src else None
    out = subprocess.run(
        [sys.executable, __file__, "--one", system_name, "--calls", str(calls)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--before", default="", help="also flotilla from this src folder")
    parser.add_argument(
        "--loops-apart",
        action="store_true",
        help="start the busy loops in sessions of their own (as other users' programs are), "
        "not in this script's (as a program's own busy processes are)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.calls)))
        return
    cores = os.cpu_count() or 1
    rows: list[tuple[int, str, str, dict[str, Any], dict[str, Any], dict[str, Any]]] = []
    for rnd in range(1, args.rounds + 1):
        for condition in ("as is", "busy"):
            loops = []
            if condition == "busy":
                loops = [
                    subprocess.Popen(
                        [sys.executable, "-c", "while True: pass"],
                        start_new_session=args.loops_apart,
                    )
                    for _ in range(2 * cores)
                ]
                _running(2 * cores)
            try:
                order = ["flotilla", "multiprocessing"] + (["before"] if args.before else [])
                order = order[rnd % len(order) :] + order[: rnd % len(order)]
                load = _load()
                got = {
                    name: run(
                        "flotilla" if name == "before" else name,
                        args.calls,
                        args.before if name == "before" else "",
                    )
                    for name in order
                }
                load += f" - {_load()}"
            finally:
                for p in loops:
                    p.kill()
                    p.wait()
            fl, mp = got["flotilla"], got["multiprocessing"]
            if "before" in got:
                b = got["before"]
                print(
                    f"round {rnd} {condition}: before {b['median'] * 1e6:.1f} us "
                    f"({b['cpu_per_call'] * 1e6:.0f} us CPU/call): "
                    f"{b['median'] / mp['median']:.2f}x",
                    file=sys.stderr,
                    flush=True,
                )
            print(
                f"round {rnd} {condition}: load {load}: flotilla {fl['median'] * 1e6:.1f} us "
                f"({fl['cpu_per_call'] * 1e6:.0f} us CPU/call), Pool.apply "
                f"{mp['median'] * 1e6:.1f} us ({mp['cpu_per_call'] * 1e6:.0f} us CPU/call): "
                f"{fl['median'] / mp['median']:.2f}x",
                file=sys.stderr,
                flush=True,
            )
            rows.append((rnd, condition, load, fl, mp, got.get("before", {})))
    report(rows, args.rounds, cores, args.loops_apart)


def report(rows: list[Any], rounds: int, cores: int, apart: bool = False) -> None:
    """The markdown report of :func:`main`'s rows (see the module docstring)."""
    before = any(r[5] for r in rows)
    print(
        f"`bench/bench_wait.py --rounds {rounds}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        f', {cores} CPUs; "busy" = {2 * cores} busy-loop processes added for the condition'
        + (" (each in a session of its own):" if apart else " (in the benchmark's session):")
    )
    print()
    print(
        "| round | condition | load (1-min, runnable) | flotilla vs `Pool.apply` | ratio "
        "| CPU per call: flotilla / `Pool.apply` |" + (" before: ratio |" if before else "")
    )
    print("| --- | --- | --- | --- | --- | --- |" + (" --- |" if before else ""))
    for rnd, condition, load, fl, mp, b in rows:
        old = f" {b['median'] * 1e6:.1f} µs: {b['median'] / mp['median']:.2f}× |" if b else ""
        print(
            f"| {rnd} | {condition} | {load} | {fl['median'] * 1e6:.1f} vs "
            f"{mp['median'] * 1e6:.1f} µs | {fl['median'] / mp['median']:.2f}× | "
            f"{fl['cpu_per_call'] * 1e6:.0f} / {mp['cpu_per_call'] * 1e6:.0f} µs |"
            + (old or (" |" if before else ""))
        )
    for condition in ("as is", "busy"):
        mine = [r for r in rows if r[1] == condition]
        ratios = [r[3]["median"] / r[4]["median"] for r in mine]
        olds = [r[5]["median"] / r[4]["median"] for r in mine if r[5]]
        old = f" {statistics.median(olds):.2f}× ({min(olds):.2f}-{max(olds):.2f}) |" if olds else ""
        cpu = statistics.median(r[3]["cpu_per_call"] for r in mine) * 1e6
        mp_cpu = statistics.median(r[4]["cpu_per_call"] for r in mine) * 1e6
        print(
            f"| median | {condition} | | | **{statistics.median(ratios):.2f}×** "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {cpu:.0f} / {mp_cpu:.0f} µs |"
            + (old or (" |" if before else ""))
        )


if __name__ == "__main__":
    main()
