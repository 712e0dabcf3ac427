"""Worker slots and streaming (issue 30): 4 nodes x Worker(concurrency=8) run 64 calls
that each sleep 0.5 s (goal: <= 1.5 s), and the time from a node's first ``yield`` to the
client having the value (goal: <= 50 ms), and the client's peak memory while 1 GiB streams
in 1 MiB values (goal: within 64 MiB of its start).

Run: ``.venv/bin/python bench/bench_slots.py``. Prints a markdown table.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Iterator

import flotilla as sky


@sky.function
def nap(_: int) -> None:
    time.sleep(0.5)


@sky.function
def mebibytes(n: int) -> Iterator[bytes]:
    block = b"x" * (1 << 20)
    for _ in range(n):
        yield block


@sky.function
def stamped(n: int) -> Iterator[float]:
    for _ in range(n):
        yield time.time()  # the nodes are processes of this machine: one clock


def main() -> None:
    with sky.Compute(nodes=4, worker=sky.Worker(concurrency=8)) as pool:
        pool.map(nap, range(32))  # every slot's process has run once
        t0 = time.perf_counter()
        pool.map(nap, range(64))
        slots = time.perf_counter() - t0
    with sky.Compute(nodes=1) as pool:
        lags = []
        for _ in range(20):
            it = stamped(1) >> pool
            sent = next(it)
            lags.append(time.time() - sent)
            list(it)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        total = sum(len(b) for b in mebibytes(1024) >> pool)
        took = time.perf_counter() - t0
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert total == 1 << 30
    print("| what | measured | goal |")
    print("| --- | --- | --- |")
    print(f"| 64 calls of 0.5 s on 4 nodes x 8 slots (s) | {slots:.2f} | <= 1.5 |")
    print(
        f"| yield -> value at the client, median of 20 (ms) | "
        f"{statistics.median(lags) * 1000:.1f} | <= 50 |"
    )
    print(
        f"| 1 GiB streamed in 1 MiB values: client peak memory growth (MiB) | {grown:.0f} "
        f"({took:.1f} s, {1024 / took:.0f} MiB/s) | <= 64 |"
    )


if __name__ == "__main__":
    main()
