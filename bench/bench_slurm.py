"""SLURM provider benchmark on a real 3-node SLURM cluster (slurmd in network namespaces).

Run as root: ``.venv/bin/python bench/bench_slurm.py [--reps 7] [--calls 300]``. Prints a
markdown table (medians over the repetitions, with their spread), each measured in
alternating repetitions so that both sides see the same load:

* pool start to the first broadcast result (``noop() @ pool``) on 3 idle nodes, against
  ``salloc --nodes=3 srun python -c pass`` on the same nodes
  (goal: <= 1.5x + 0.3 s); the local provider's 3-node start in the same run, for scale;
* a no-op ``>>`` round trip over srun against the local provider (goal: <= 2x);
* teardown: leaving the ``with`` block until ``squeue`` lists no job (goal: <= 2 s).

Nodes run the client's interpreter (``sys.executable``), in the pools and the baseline.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _slurm import SlurmCluster, cluster_unavailable

import flotilla as sky

NODES = 3


@sky.function
def noop() -> None:
    return None


def baseline(cluster: SlurmCluster) -> float:
    """Seconds of ``salloc -N3 srun python -c pass`` (allocation, one step, release)."""
    t0 = time.perf_counter()
    subprocess.run(
        ["salloc", f"--nodes={NODES}", "--exclusive", "srun", sys.executable, "-c", "pass"],
        env=cluster.env,
        capture_output=True,
        check=True,
    )
    return time.perf_counter() - t0


def first_result(provider: sky.Provider | None) -> tuple[float, float]:
    """(seconds from pool start to the first broadcast result, seconds of teardown)."""
    t0 = time.perf_counter()
    pool = sky.Compute(provider=provider, nodes=NODES)
    try:
        pool.open()
        noop() @ pool
        start = time.perf_counter() - t0
    finally:
        t1 = time.perf_counter()
        pool.close()
    return start, time.perf_counter() - t1


def queue_empty_after(cluster: SlurmCluster, closed: float) -> float:
    """Teardown time until squeue is empty (close() returns once the job is gone)."""
    t0 = time.perf_counter()
    left = cluster.wait_queue_empty(10.0)
    if left:
        raise RuntimeError(f"jobs left after the pool closed: {left}")
    return closed + (time.perf_counter() - t0)


def round_trip(pool: sky.Compute, calls: int) -> float:
    """Median seconds of a no-op ``>>`` call."""
    for _ in range(20):
        noop() >> pool
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        noop() >> pool
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(cluster: SlurmCluster, reps: int, calls: int) -> dict[str, list[float]]:
    provider = sky.Slurm(time="30:00")
    first_result(provider)  # warm the page cache for both sides
    baseline(cluster)
    out: dict[str, list[float]] = {k: [] for k in ("base", "slurm", "local", "down", "rt", "lrt")}
    for _ in range(reps):
        out["base"].append(baseline(cluster))
        start, closed = first_result(provider)
        out["slurm"].append(start)
        out["down"].append(queue_empty_after(cluster, closed))
        out["local"].append(first_result(None)[0])
    with (
        sky.Compute(provider=provider, nodes=NODES) as slurm_pool,
        sky.Compute(nodes=NODES) as local_pool,
    ):
        for _ in range(reps):
            out["rt"].append(round_trip(slurm_pool, calls))
            out["lrt"].append(round_trip(local_pool, calls))
    return out


def spread(values: list[float], scale: float, unit: str) -> str:
    """'median unit (min-max)', values multiplied by ``scale``."""
    digits = 0 if scale > 1e3 else 2
    med, low, high = (v * scale for v in (statistics.median(values), min(values), max(values)))
    return f"{med:.{digits}f} {unit} ({low:.{digits}f}-{high:.{digits}f})"


def report(r: dict[str, list[float]], reps: int, calls: int, version: str) -> None:
    med = {k: statistics.median(v) for k, v in r.items()}
    start_goal = 1.5 * med["base"] + 0.3
    rt_ratio = med["rt"] / med["lrt"]
    rt_ratios = [s / loc for s, loc in zip(r["rt"], r["lrt"], strict=True)]
    start_ratio = med["slurm"] / med["base"]
    load = os.getloadavg()[0]
    print(f"### SLURM provider ({NODES} slurmd test hosts in network namespaces on this machine)\n")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{version}, {os.cpu_count()} CPUs, load average {load:.1f} at the end; "
        f"{reps} repetitions, medians (min-max); round trips: median of {calls} calls per "
        "repetition.\n"
    )
    print("| measurement | result | goal |")
    print("| --- | --- | --- |")
    print(f"| `salloc -N3 srun python -c pass` | {spread(r['base'], 1, 's')} | |")
    print(
        f"| pool start to first `@` result, 3 nodes | {spread(r['slurm'], 1, 's')} "
        f"({start_ratio:.2f}x salloc+srun) | <= 1.5x + 0.3 s = {start_goal:.2f} s: "
        f"{'met' if med['slurm'] <= start_goal else 'NOT met'} |"
    )
    print(f"| same, local provider (same run) | {spread(r['local'], 1, 's')} | |")
    print(f"| no-op `>>` round trip over srun | {spread(r['rt'], 1e6, 'us')} | |")
    print(f"| no-op `>>` round trip, Local (same run) | {spread(r['lrt'], 1e6, 'us')} | |")
    print(
        f"| SLURM / Local round trip | {rt_ratio:.2f}x ({min(rt_ratios):.2f}-"
        f"{max(rt_ratios):.2f}) | <= 2x: {'met' if rt_ratio <= 2 else 'NOT met'} |"
    )
    print(
        f"| teardown to an empty queue | {spread(r['down'], 1, 's')} | <= 2 s: "
        f"{'met' if med['down'] <= 2 else 'NOT met'} |"
    )


def _slurm_version(cluster: SlurmCluster) -> str:
    return cluster.slurm("sinfo", "--version", check=False).stdout.strip() or "slurm ?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    reason = cluster_unavailable()
    if reason:
        sys.exit(f"bench_slurm: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the cluster down on SIGTERM
    with SlurmCluster(NODES) as cluster:
        os.environ["SLURM_CONF"] = str(cluster.conf)
        for name in [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del os.environ[name]
        version = _slurm_version(cluster)
        results = measure(cluster, args.reps, args.calls)
    report(results, args.reps, args.calls, version)


if __name__ == "__main__":
    main()
