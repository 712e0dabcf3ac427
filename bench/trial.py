"""One trial of one system, in a fresh process (bench.py starts it).

    python bench/trial.py cold SYSTEM OUT.json [--quick]   # start → first result → stopped
    python bench/trial.py warm SYSTEM OUT.json [--quick]   # every warm metric on one pool

The system's library is imported before any clock starts (the process is fresh, the
files are in the page cache: "warm but fresh"). The result is written as JSON to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stats import Stopwatch, sample
from systems import NODES, SYSTEMS, System

BROADCAST_BYTES = 100_000_000  # 100 MB of float64
THROUGHPUT_CALLS = 10_000


@dataclass(frozen=True)
class Plan:
    """How many samples each warm metric takes, at most, and for how long (seconds)."""

    round_trip: tuple[int, float, int]  # count, budget, warm-up calls
    throughput: tuple[int, float, int]
    broadcast: tuple[int, float, int]


FULL = Plan(round_trip=(2000, 3.0, 200), throughput=(5, 25.0, 1), broadcast=(7, 15.0, 1))
QUICK = Plan(round_trip=(200, 0.5, 20), throughput=(3, 5.0, 1), broadcast=(3, 5.0, 1))


def cold(system: System) -> dict[str, Any]:
    watch = Stopwatch()
    system.start()
    system.first()
    watch.lap("first")
    system.stop()
    watch.lap("total")
    return watch.laps


def warm(system: System, plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    system.start()
    try:
        system.first()
        if "memory" in system.measures:
            out["memory"] = _guarded(lambda: node_memory(system.node_pids()))
        if "round_trip" in system.measures:
            out["round_trip"] = _guarded(lambda: _timed(system.round_trip, plan.round_trip))
        if "throughput" in system.measures:
            out["throughput"] = _guarded(lambda: throughput(system, plan))
        if "broadcast" in system.measures:
            out["broadcast"] = _guarded(lambda: broadcast(system, plan))
    finally:
        system.stop()
    return out


def throughput(system: System, plan: Plan) -> list[float]:
    times = _timed(lambda: system.many(THROUGHPUT_CALLS), plan.throughput)
    return [THROUGHPUT_CALLS / t for t in times]


def broadcast(system: System, plan: Plan) -> list[float]:
    import numpy as np

    arr = np.arange(BROADCAST_BYTES // 8, dtype=np.float64)
    expected = float(arr.sum())

    def once() -> None:
        sums = system.broadcast(arr)
        if len(sums) != NODES or any(abs(s - expected) > 1e-6 * expected for s in sums):
            raise RuntimeError(f"wrong sums {sums}, expected {NODES} x {expected}")

    return _timed(once, plan.broadcast)


def node_memory(nodes: list[list[int]]) -> list[dict[str, list[int]]]:
    """Per node: the pids of its processes, their RSS and their PSS (bytes)."""
    return [
        {
            "pids": pids,
            "rss": [_proc_kb(f"/proc/{pid}/status", "VmRSS:") * 1024 for pid in pids],
            "pss": [_proc_kb(f"/proc/{pid}/smaps_rollup", "Pss:") * 1024 for pid in pids],
        }
        for pids in nodes
    ]


def _proc_kb(path: str, key: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in {path}")


def _timed(fn: Callable[[], object], limits: tuple[int, float, int]) -> list[float]:
    count, budget, warmup = limits
    return sample(fn, count=count, budget=budget, warmup=warmup)


def _guarded(measure: Callable[[], Any]) -> Any:
    """The measurement, or {"error": ...} so that one failure does not lose the others."""
    try:
        return measure()
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["cold", "warm"])
    parser.add_argument("system", choices=sorted(SYSTEMS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    system = SYSTEMS[args.system]()
    result = cold(system) if args.mode == "cold" else warm(system, QUICK if args.quick else FULL)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
