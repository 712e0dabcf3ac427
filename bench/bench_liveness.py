"""Detection of a frozen node: from SIGSTOP of one agent (a frozen process or VM) to the
client declaring the node lost (issue 13's goal: at most the heartbeat timeout + 1 s).

Run: ``.venv/bin/python bench/bench_liveness.py [--reps 5] [--heartbeat 2 10]``. Prints a
markdown table: median, 10th and 90th percentiles over the repetitions, per heartbeat
timeout.

Each repetition stops node 1's agent of a running 3-node local pool with SIGSTOP, times
until the client has taken the node out of service (it is then replaced: the frozen agent
is killed), and waits for the next broadcast to answer on every node before the next
repetition. Detection is the provider-independent part (agents BEAT every quarter of the
timeout; the client checks as often): the same on SSH, SLURM or cloud nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import time

import flotilla as sky


@sky.function
def noop() -> int:
    return sky.instance_info().node


def freeze_and_time(pool: sky.Compute) -> float:
    """Seconds from node 1's agent stopped to the client declaring it lost."""
    node = pool._nodes[1]
    pid = int(node.hello_info["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        while pool._nodes[1] is node and node.state.value == "ready":
            time.sleep(0.005)
        elapsed = time.perf_counter() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert noop() @ pool == [0, 1, 2]
    return elapsed


def measure(heartbeat: float, reps: int) -> list[float]:
    options = sky.Options(heartbeat_timeout=heartbeat)
    with sky.Compute(nodes=3, options=options) as pool:
        noop() @ pool
        return [freeze_and_time(pool) for _ in range(reps)]


def row(what: str, samples: list[float], goal: float) -> str:
    ordered = sorted(samples)
    p10 = ordered[int(0.1 * (len(ordered) - 1))]
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    median = statistics.median(samples)
    verdict = "PASS" if max(samples) <= goal else "**FAIL**"
    return (
        f"| {what} | {median:.2f} s | {p10:.2f} s | {p90:.2f} s | {len(samples)} "
        f"| ≤ {goal:g} s | {verdict} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--heartbeat", type=float, nargs="+", default=[2.0, 10.0])
    args = parser.parse_args()
    print("| frozen node (SIGSTOP) declared lost | median | p10 | p90 | n | goal | result |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for heartbeat in args.heartbeat:
        samples = measure(heartbeat, args.reps)
        print(row(f"local, 3 nodes, heartbeat_timeout={heartbeat:g} s", samples, heartbeat + 1))


if __name__ == "__main__":
    main()
