"""What the per-node metrics cost (issue 38): an idle agent's CPU and memory with metrics on
(``metrics.Default()``, sampled every 2-5 s) and off (``metrics=None``), and the hot path's
round trip and throughput, in the same run, rounds alternating on/off; and the CPU time
the client and the agents spend per call of the throughput run (less sensitive than wall
time to a busy machine).

Run: ``.venv/bin/python bench/bench_metrics.py [--rounds 3] [--idle 20] [--nodes 4]``.
Prints a markdown table (medians over the rounds; the CPU of an agent is its own user +
system time over the idle window, from ``/proc/PID/stat``, over the window's length).
Goal: an idle agent under 1% CPU with metrics on; round trip and throughput unchanged
(ratios on/off near 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import flotilla as sky

TICK = os.sysconf("SC_CLK_TCK")


@sky.function
def noop(x: int = 0) -> int:
    return x


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def one_round(metrics_on: bool, nodes: int, idle: float, calls: int) -> dict[str, float]:
    kwargs: dict[str, Any] = {} if metrics_on else {"metrics": None}
    with sky.Compute(nodes=nodes, **kwargs) as pool:
        noop() @ pool
        pids = [int(n.hello_info["pid"]) for n in pool._nodes]
        time.sleep(1.0)  # the first samples (and their imports) are past
        before = [cpu_seconds(p) for p in pids]
        t0 = time.monotonic()
        time.sleep(idle)
        elapsed = time.monotonic() - t0
        cpu = [100 * (cpu_seconds(p) - b) / elapsed for p, b in zip(pids, before, strict=True)]
        rss = [rss_mb(p) for p in pids]
        for _ in range(50):
            noop() >> pool
        trips = []
        for _ in range(calls):
            t = time.perf_counter()
            noop() >> pool
            trips.append(time.perf_counter() - t)
        spent = [cpu_seconds(p) for p in pids] + [cpu_seconds(os.getpid())]
        t = time.perf_counter()
        pool.map(noop, range(calls * 5))
        throughput = calls * 5 / (time.perf_counter() - t)
        after = [cpu_seconds(p) for p in pids] + [cpu_seconds(os.getpid())]
        per_call = (sum(after) - sum(spent)) / (calls * 5)  # agents' and client's CPU
    return {
        "cpu": statistics.mean(cpu),
        "cpu_max": max(cpu),
        "rss": statistics.mean(rss),
        "trip_us": statistics.median(trips) * 1e6,
        "per_s": throughput,
        "cpu_us": per_call * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for i in range(args.rounds):
        for on in (False, True) if i % 2 == 0 else (True, False):  # each goes first in turn
            results[on].append(one_round(on, args.nodes, args.idle, args.calls))

    def med(on: bool, key: str) -> float:
        return statistics.median(r[key] for r in results[on])

    print(f"{args.nodes} idle local agents for {args.idle:g} s, {args.rounds} round(s), medians\n")
    print(
        "| metrics | agent CPU (mean / max) | agent RSS | round trip | throughput "
        "| CPU per call (client + agents) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for on in (False, True):
        print(
            f"| {'on (Default)' if on else 'off (None)'} "
            f"| {med(on, 'cpu'):.2f}% / {med(on, 'cpu_max'):.2f}% "
            f"| {med(on, 'rss'):.1f} MB | {med(on, 'trip_us'):.0f} µs "
            f"| {med(on, 'per_s'):.0f} calls/s | {med(on, 'cpu_us'):.0f} µs |"
        )
    ratios = [
        on["trip_us"] / off["trip_us"]
        for on, off in zip(results[True], results[False], strict=True)
    ]
    tput = [
        on["per_s"] / off["per_s"] for on, off in zip(results[True], results[False], strict=True)
    ]
    print(
        f"\nsame-round ratios on/off: round trip {statistics.median(ratios):.2f}x "
        f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}), throughput "
        f"{statistics.median(tput):.2f}x (rounds: {', '.join(f'{r:.2f}' for r in tput)})"
    )


if __name__ == "__main__":
    main()
