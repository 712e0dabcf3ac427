"""AWS provider benchmark: moto's EC2 API and instances that boot after a fixed delay D.

Run as root: ``.venv/bin/python bench/bench_aws.py [--reps 3] [--boot-delay 2]``. The
instances are network-namespace hosts that the test fixture (``tests/_aws.py``) boots D
seconds after it sees them launched, with sshd configured from their user-data. Prints a
markdown table (medians over the repetitions, with their spread):

* pool start to the first broadcast result, 3 nodes (goal: <= D + 3 s), split into the API
  part (until RunInstances returned), the boot as the emulator did it (D plus the
  fixture's own work: namespace, metadata stand-in, sshd), and what follows the last boot;
* the same for 8 nodes against 1 node (goal: <= 1.3x: all waits run in parallel);
* the API calls a pool makes, by operation, per pool and per extra node.

The instance type catalog is warm (cached) in the measured repetitions; the first, cold
pool is reported on its own row.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _aws import AwsLab, aws_unavailable

import flotilla as sky
from flotilla._providers.aws import api as aws_api


@sky.function
def node() -> int:
    return sky.instance_info().node


def busy_cpu() -> float:
    """CPU seconds this machine has spent busy (all processes, all cores) since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def one_pool(lab: AwsLab, nodes: int) -> dict[str, Any]:
    """Start a pool, broadcast once, close it: its timings (s), the machine's busy CPU
    seconds from the pool's start to the first result, and the API calls."""
    before = Counter(aws_api.calls)
    seen_before = set(lab.boot_times)
    t0 = time.monotonic()
    cpu0 = busy_cpu()
    with sky.Compute(provider=lab.provider(), nodes=nodes) as pool:
        result = node() @ pool
        t1 = time.monotonic()
        cpu = busy_cpu() - cpu0
    assert result == list(range(nodes)), result
    calls = Counter(aws_api.calls)
    calls.subtract(before)
    boots = [v for k, v in lab.boot_times.items() if k not in seen_before]
    launched = min(seen for seen, _ in boots)
    booted = max(up for _, up in boots)
    return {
        "total": t1 - t0,
        "api": launched - t0,
        "boot": booted - launched,
        "after_boot": t1 - booted,
        "cpu": cpu,
        "calls": +calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--boot-delay", type=float, default=2.0)
    args = parser.parse_args()
    reason = aws_unavailable()
    if reason:
        sys.exit(f"bench_aws: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the lab down on SIGTERM
    with AwsLab(boot_delay=args.boot_delay) as lab:
        cold = one_pool(lab, 3)
        runs: dict[int, list[dict[str, Any]]] = {1: [], 3: [], 8: []}
        for _ in range(args.reps):
            for n in runs:
                runs[n].append(one_pool(lab, n))
    report(cold, runs, args.reps, args.boot_delay)


def spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.2f} s ({min(values):.2f}-{max(values):.2f})"


def report(
    cold: dict[str, Any], runs: dict[int, list[dict[str, Any]]], reps: int, d: float
) -> None:
    def col(n: int, key: str) -> list[float]:
        return [r[key] for r in runs[n]]

    three = statistics.median(col(3, "total"))
    ratio = statistics.median(col(8, "total")) / statistics.median(col(1, "total"))
    ratios = [a["total"] / b["total"] for a, b in zip(runs[8], runs[1], strict=True)]
    load = os.getloadavg()[0]
    print(f"### AWS provider (moto EC2 API, instances boot D = {d:g} s after launch)\n")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {load:.1f} at the end; {reps} repetitions, "
        "medians (min-max). 'boot' is the emulator's: D plus its own work per instance "
        "(namespace, metadata stand-in, sshd), all instances in parallel.\n"
    )
    print("| measurement | result | goal |")
    print("| --- | --- | --- |")
    goal = d + 3
    print(
        f"| 3 nodes: pool start to first broadcast result | {spread(col(3, 'total'))} | "
        f"<= D + 3 s = {goal:g} s: {'met' if three <= goal else 'NOT met'} |"
    )
    for key, what in (
        ("api", "API calls until launch"),
        ("boot", "boot (emulator)"),
        ("after_boot", "last boot to first result"),
    ):
        print(f"| 3 nodes: {what} | {spread(col(3, key))} | |")
    print(f"| 3 nodes, first pool (cold instance type catalog) | {cold['total']:.2f} s | |")
    for n in (1, 8):
        print(
            f"| {n} node(s): pool start to first broadcast result | {spread(col(n, 'total'))} | |"
        )
        print(f"| {n} node(s): last boot to first result | {spread(col(n, 'after_boot'))} | |")
    cpus = os.cpu_count() or 1
    for n in (1, 3, 8):
        busy = statistics.median(col(n, "cpu"))
        print(
            f"| {n} node(s): busy CPU, whole machine, start to result | {busy:.2f} CPU-s "
            f"(>= {busy / cpus:.2f} s of wall time on {cpus} cores) | |"
        )
    print(
        f"| 8 nodes / 1 node | {ratio:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
        f"<= 1.3x: {'met' if ratio <= 1.3 else 'NOT met'} |"
    )
    one, eight = runs[1][-1]["calls"], runs[8][-1]["calls"]
    per_node = {k: (eight.get(k, 0) - one.get(k, 0)) / 7 for k in set(one) | set(eight)}
    per_node = {k: v for k, v in per_node.items() if v}
    print()
    print("API calls per pool (warm catalog), by operation:\n")
    print("| operation | 1 node | 3 nodes | 8 nodes | cold 3-node pool |")
    print("| --- | --- | --- | --- | --- |")
    three_calls = runs[3][-1]["calls"]
    names = sorted(set(one) | set(eight) | set(three_calls) | set(cold["calls"]))
    for name in names:
        print(
            f"| {name} | {one.get(name, 0)} | {three_calls.get(name, 0)} | "
            f"{eight.get(name, 0)} | {cold['calls'].get(name, 0)} |"
        )
    print(
        f"| total | {sum(one.values())} | {sum(three_calls.values())} | "
        f"{sum(eight.values())} | {sum(cold['calls'].values())} |"
    )
    extra = ", ".join(f"{k} {v:g}" for k, v in sorted(per_node.items())) or "none"
    print(f"\nAPI calls per extra node: {extra}.")


if __name__ == "__main__":
    main()
