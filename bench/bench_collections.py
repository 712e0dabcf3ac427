"""Distributed collections (issue 30): a dict set+get round trip from a node, and counter
increments per second from 4 nodes, against Dask's ``Variable.set``+``get`` from a Dask
worker and Ray actor method calls per second from 4 Ray tasks, in the same run.

Run: ``.venv/bin/python bench/bench_collections.py [--ops 1000]``. Prints a markdown table.
A system that is not installed is reported as such. Every number is taken inside the
tasks (the pools' start is not timed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import flotilla as sky

NODES = 4


@sky.function
def flotilla_dict_round_trip(ops: int) -> float:
    d = sky.dict("bench")
    key = sky.instance_info().node
    t0 = time.perf_counter()
    for i in range(ops):
        d[key] = i
        assert d[key] == i
    return (time.perf_counter() - t0) / ops


@sky.function
def flotilla_increments(ops: int) -> tuple[float, float]:
    c = sky.counter("bench")
    t0 = time.perf_counter()
    for _ in range(ops):
        c.increment()
    return t0, time.perf_counter()


def flotilla(ops: int) -> dict[str, float]:
    with sky.Compute(nodes=NODES) as pool:
        round_trip = statistics.median(flotilla_dict_round_trip(ops) @ pool)
        spans = flotilla_increments(ops) @ pool
        assert int(pool.counter("bench")) == NODES * ops
    start = min(s for s, _ in spans)
    end = max(e for _, e in spans)
    return {"round_trip": round_trip, "per_s": NODES * ops / (end - start)}


def dask(ops: int) -> dict[str, float] | str:
    try:
        import distributed
    except ImportError:
        return "not installed (distributed)"

    def round_trip(n: int) -> float:
        v = distributed.Variable("bench")
        t0 = time.perf_counter()
        for i in range(n):
            v.set(i)
            assert v.get() == i
        return (time.perf_counter() - t0) / n

    with (
        distributed.LocalCluster(
            n_workers=NODES, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        workers = list(client.scheduler_info()["workers"])
        futures = [client.submit(round_trip, ops, workers=[w], pure=False) for w in workers]
        return {"round_trip": statistics.median(client.gather(futures))}


def ray(ops: int) -> dict[str, float] | str:
    try:
        import ray as ray_module
    except ImportError:
        return "not installed (ray)"
    r: Any = ray_module
    r.init(num_cpus=NODES, include_dashboard=False, log_to_driver=False)
    try:

        @r.remote
        class Counter:
            def __init__(self) -> None:
                self.n = 0

            def incr(self) -> int:
                self.n += 1
                return self.n

        @r.remote
        def hammer(counter: Any, n: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            for _ in range(n):
                r.get(counter.incr.remote())
            return t0, time.perf_counter()

        counter = Counter.remote()  # type: ignore[attr-defined]
        r.get(counter.incr.remote())
        spans = r.get([hammer.remote(counter, ops) for _ in range(NODES)])
        start = min(s for s, _ in spans)
        end = max(e for _, e in spans)
        return {"per_s": NODES * ops / (end - start)}
    finally:
        r.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=1000)
    ops = parser.parse_args().ops
    ours = flotilla(ops)
    theirs_dask = dask(ops)
    theirs_ray = ray(ops)
    print(f"{NODES} local nodes, {ops} operations per node\n")
    print("| what | flotilla | other | flotilla ÷ other |")
    print("| --- | --- | --- | --- |")
    rt = ours["round_trip"] * 1e6
    if isinstance(theirs_dask, dict):
        other = theirs_dask["round_trip"] * 1e6
        print(
            f"| dict set+get from a node (µs) | {rt:.0f} | Dask Variable: {other:.0f} | "
            f"{rt / other:.2f} |"
        )
    else:
        print(f"| dict set+get from a node (µs) | {rt:.0f} | Dask: {theirs_dask} | - |")
    per_s = ours["per_s"]
    if isinstance(theirs_ray, dict):
        other = theirs_ray["per_s"]
        print(
            f"| counter increments/s, 4 nodes | {per_s:.0f} | Ray actor calls/s: {other:.0f} | "
            f"{per_s / other:.2f} |"
        )
    else:
        print(f"| counter increments/s, 4 nodes | {per_s:.0f} | Ray: {theirs_ray} | - |")


if __name__ == "__main__":
    main()
