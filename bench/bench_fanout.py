"""Broadcast of a large argument to many SSH hosts: 32 MB to 128 hosts against 8 hosts.

Run as root: ``.venv/bin/python bench/bench_fanout.py [--hosts 128] [--mb 32] [--reps 3]``.
Prints a markdown table (medians over the repetitions, min-max, same run): the time of
``checksum(array) @ pool`` on ``--hosts`` hosts and on 8, and their ratio (issue 27's goal
for a broadcast that fans out in a tree: <= 4x). Every node returns the array's checksum,
checked against the client's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _hosts import Lab, lab_unavailable

import flotilla as sky


@sky.function
def checksum(data: Any) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


def broadcast(pool: sky.Compute, data: Any, want: str) -> float:
    t0 = time.perf_counter()
    got = checksum(data) @ pool
    took = time.perf_counter() - t0
    if set(got) != {want}:
        raise SystemExit("bench_fanout: a node got other bytes")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=128)
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    reason = lab_unavailable()
    if reason:
        sys.exit(f"bench_fanout: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data = bytearray(os.urandom(args.mb * 2**20))
    want = hashlib.sha256(data).hexdigest()
    big: list[float] = []
    small: list[float] = []
    with Lab() as lab:
        lab.add_hosts(args.hosts)
        provider = lab.provider(python=sys.executable, connect_timeout=30.0)
        options = sky.Options(start_timeout=600.0)
        with (
            sky.Compute(provider=provider, nodes=args.hosts, options=options) as many,
            sky.Compute(
                provider=lab.provider(lab.hosts[:8], python=sys.executable), nodes=8
            ) as few,
        ):
            for _ in range(args.reps):
                small.append(broadcast(few, data, want))
                big.append(broadcast(many, data, want))
    ratio = statistics.median(big) / statistics.median(small)
    print(f"### Broadcast of {args.mb} MB to {args.hosts} SSH hosts against 8\n")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} "
        f"CPUs, load average {os.getloadavg()[0]:.1f} at the end; {args.reps} repetitions, "
        "medians (min-max).\n"
    )
    print("| measurement | result | goal |")
    print("| --- | --- | --- |")
    for name, values in ((f"{args.hosts} hosts", big), ("8 hosts", small)):
        med = statistics.median(values)
        print(
            f"| {args.mb} MB broadcast, {name} | {med:.2f} s ({min(values):.2f}-{max(values):.2f}) | |"
        )
    print(
        f"| {args.hosts} hosts / 8 hosts | {ratio:.1f}x | <= 4x: "
        f"{'met' if ratio <= 4 else 'NOT met'} |"
    )


if __name__ == "__main__":
    main()
