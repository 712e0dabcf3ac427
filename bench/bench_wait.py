"""A lone call's round trip against ``Pool.apply``, on the machine as it is and with two
busy-loop processes per core added: same run, each system in a fresh process (issue 42).

    .venv/bin/python bench/bench_wait.py [--rounds 5] [--calls 2000]

Each round measures, for each condition (``as is``, then ``busy``: 2 busy loops per core
started for it), flotilla's ``noop() >> pool`` and multiprocessing's ``Pool.apply(noop)``
one after the other (the order alternating between rounds), each in a fresh process
(``bench/trial.py``'s systems, 4 workers): the median of up to ``--calls`` round trips
(3 s at most, after 200 untimed ones), and the CPU seconds per call that the measuring
process and the pool's processes spent (``/proc/PID/stat``: load-independent, unlike the
time). Prints one line per measurement and the same-run ratios as a markdown table with
the load (``/proc/loadavg``: 1-minute average and threads runnable) at each measurement.
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
                    subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(2 * cores)
                ]
                time.sleep(0.5)  # the loops are running
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
                    flush=True,
                )
            print(
                f"round {rnd} {condition}: load {load}: flotilla {fl['median'] * 1e6:.1f} us "
                f"({fl['cpu_per_call'] * 1e6:.0f} us CPU/call), Pool.apply "
                f"{mp['median'] * 1e6:.1f} us ({mp['cpu_per_call'] * 1e6:.0f} us CPU/call): "
                f"{fl['median'] / mp['median']:.2f}x",
                flush=True,
            )
            rows.append((rnd, condition, load, fl, mp, got.get("before", {})))
    print(
        "\n| round | condition | load (1-min, runnable) | flotilla vs `Pool.apply` | ratio "
        "| before: ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for rnd, condition, load, fl, mp, b in rows:
        before = f"{b['median'] * 1e6:.1f} µs: {b['median'] / mp['median']:.2f}×" if b else ""
        print(
            f"| {rnd} | {condition} | {load} | {fl['median'] * 1e6:.1f} vs "
            f"{mp['median'] * 1e6:.1f} µs | {fl['median'] / mp['median']:.2f}× | {before} |"
        )
    for condition in ("as is", "busy"):
        ratios = [r[3]["median"] / r[4]["median"] for r in rows if r[1] == condition]
        olds = [r[5]["median"] / r[4]["median"] for r in rows if r[1] == condition and r[5]]
        old = f"{statistics.median(olds):.2f}× ({min(olds):.2f}-{max(olds):.2f})" if olds else ""
        print(
            f"| median | {condition} | | | **{statistics.median(ratios):.2f}×** "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {old} |"
        )


if __name__ == "__main__":
    main()
