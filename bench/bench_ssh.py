"""SSH provider benchmark on 4 real sshd test hosts (network namespaces on this machine).

Run as root: ``.venv/bin/python bench/bench_ssh.py [--reps 7] [--calls 300]``. Prints a
markdown table (medians over the repetitions, with their spread):

* pool start on 4 hosts with the bootstrap cached (goal: <= 1.5 s), and with an empty work
  directory (the bundle is uploaded);
* a no-op ``>>`` round trip over SSH against the local provider in the same run
  (goal: <= 2x), measured in alternating repetitions so that both see the same load.

The hosts run the client's interpreter (``sys.executable``), as the local provider does.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _hosts import Lab, lab_unavailable

import flotilla as sky

HOSTS = 4


@sky.function
def noop() -> None:
    return None


def timed(action: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    action()
    return time.perf_counter() - t0


def start_time(provider: Any) -> float:
    """Seconds to open a 4-node pool (until every node is ready); the pool is closed after."""
    pool = sky.Compute(provider=provider, nodes=HOSTS)
    try:
        return timed(pool.open)
    finally:
        pool.close()


def round_trip(pool: sky.Compute, calls: int) -> float:
    """Median seconds of a no-op ``>>`` call."""
    for _ in range(20):
        noop() >> pool
    samples = [timed(lambda: noop() >> pool) for _ in range(calls)]
    return statistics.median(samples)


def spread(values: list[float], scale: float, unit: str) -> str:
    """'median unit (min-max)', values multiplied by ``scale``."""
    digits = 0 if scale > 1e3 else 2
    med, low, high = (v * scale for v in (statistics.median(values), min(values), max(values)))
    return f"{med:.{digits}f} {unit} ({low:.{digits}f}-{high:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    reason = lab_unavailable()
    if reason:
        sys.exit(f"bench_ssh: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the lab down on SIGTERM
    with Lab() as lab:
        lab.add_hosts(HOSTS)
        results = measure(lab, args.reps, args.calls)
    report(results, args.reps, args.calls)


def measure(lab: Lab, reps: int, calls: int) -> dict[str, list[float]]:
    """Every measurement, ``reps`` values each."""
    python = sys.executable
    cached = lab.provider(python=python)
    start_time(cached)  # warm: the bundle is on the hosts
    out: dict[str, list[float]] = {"cached": [], "upload": [], "ssh_rt": [], "local_rt": []}
    for rep in range(reps):
        out["cached"].append(start_time(cached))
        fresh = lab.provider(python=python, workdir=str(lab.tmp / f"fresh-{rep}"))
        out["upload"].append(start_time(fresh))
    with (
        sky.Compute(provider=cached, nodes=HOSTS) as ssh_pool,
        sky.Compute(nodes=HOSTS) as local_pool,
    ):
        for _ in range(reps):
            out["ssh_rt"].append(round_trip(ssh_pool, calls))
            out["local_rt"].append(round_trip(local_pool, calls))
    return out


def report(r: dict[str, list[float]], reps: int, calls: int) -> None:
    ratio = statistics.median(r["ssh_rt"]) / statistics.median(r["local_rt"])
    ratios = [s / loc for s, loc in zip(r["ssh_rt"], r["local_rt"], strict=True)]
    start = statistics.median(r["cached"])
    load = os.getloadavg()[0]
    print(f"### SSH provider ({HOSTS} sshd test hosts in network namespaces on this machine)\n")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {load:.1f} at the end; {reps} repetitions, "
        f"medians (min-max); round trips: median of {calls} calls per repetition.\n"
    )
    print("| measurement | result | goal |")
    print("| --- | --- | --- |")
    print(
        f"| pool start, 4 hosts, bootstrap cached | {spread(r['cached'], 1, 's')} | "
        f"<= 1.5 s: {'met' if start <= 1.5 else 'NOT met'} |"
    )
    print(f"| pool start, 4 hosts, empty workdir (upload) | {spread(r['upload'], 1, 's')} | |")
    print(f"| no-op `>>` round trip, SSH | {spread(r['ssh_rt'], 1e6, 'us')} | |")
    print(f"| no-op `>>` round trip, Local (same run) | {spread(r['local_rt'], 1e6, 'us')} | |")
    print(
        f"| SSH / Local round trip | {ratio:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
        f"<= 2x: {'met' if ratio <= 2 else 'NOT met'} |"
    )


if __name__ == "__main__":
    main()
