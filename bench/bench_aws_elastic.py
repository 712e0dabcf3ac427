"""Elastic AWS pools on the moto lab (issue 37): wake from zero, grow, shrink, scale to zero.

Run as root: ``.venv/bin/python bench/bench_aws_elastic.py [--reps 3] [--boot-delay 2]``.
Instances are the test fixture's namespace hosts (``tests/_aws.py``), whose sshd starts D
seconds after the launch: D is the floor of anything that launches. Per repetition, in
turn:

* plain: ``Compute(nodes=1)`` from ``open`` to the first result (the provider's plain start);
* wake: a ``Nodes(0, max=4, min=0)`` pool (open, nothing launched) from its first call to
  the result (one instance launched, booted, its agent started);
* grow: a ``Nodes(1, max=4)`` pool's ``resize(4)`` until 4 nodes serve, against a plain
  4-node pool's start to its first broadcast result;
* shrink: the same pool's ``resize(1)`` until EC2 bills 3 instances fewer (terminated);
* to zero: a ``Nodes(1, max=4, min=0)`` pool with ``autoscale_idle_timeout=1``: from its
  last result until no instance is billed, minus the idle timeout;
* burst: 200 calls of 50 ms (``map``) from ``open`` to the last result on a fixed pool of 4,
  against the same on ``Nodes(0, max=4, min=0)`` (launching its instances included).

Prints a markdown table of medians (min-max) and each one less D where it launches.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _aws import AwsLab, aws_unavailable

import flotilla as sky

BILLED = ("pending", "running", "stopping", "stopped")


@sky.function
def node() -> int:
    return sky.instance_info().node


@sky.function
def work(i: int) -> int:
    time.sleep(0.05)
    return i


def billed(lab: AwsLab, pool_id: str) -> int:
    return sum(1 for i in lab.pool_instances(pool_id) if i["State"]["Name"] in BILLED)


def until(predicate: Callable[[], bool], timeout: float = 300.0) -> float:
    """Poll ``predicate`` every 50 ms; the monotonic time it became true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the pool did not get there")
        time.sleep(0.05)
    return time.monotonic()


def one_round(lab: AwsLab) -> dict[str, float]:
    provider = lab.provider(allocation="on-demand")
    out: dict[str, float] = {}
    t0 = time.monotonic()
    with sky.Compute(provider=provider, nodes=1) as pool:
        assert node() >> pool == 0
        out["plain"] = time.monotonic() - t0
    t0 = time.monotonic()
    with sky.Compute(provider=provider, nodes=4) as pool:
        assert node() @ pool == [0, 1, 2, 3]
        out["plain4"] = time.monotonic() - t0
    with sky.Compute(provider=provider, nodes=sky.Nodes(0, max=4, min=0)) as pool:
        t0 = time.monotonic()
        assert node() >> pool == 0
        out["wake"] = time.monotonic() - t0
    options = sky.Options(autoscale_idle_timeout=600, autoscale_cooldown=0)
    with sky.Compute(provider=provider, nodes=sky.Nodes(1, max=4), options=options) as pool:
        t0 = time.monotonic()
        pool.resize(4)
        out["grow"] = until(lambda: pool.current_nodes() == 4) - t0
        pid = pool.pool_id
        t0 = time.monotonic()
        pool.resize(1)
        out["shrink"] = until(lambda: billed(lab, pid) == 1) - t0
    options = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0)
    nodes = sky.Nodes(1, max=4, min=0)
    with sky.Compute(provider=provider, nodes=nodes, options=options) as pool:
        assert node() >> pool == 0
        t0 = time.monotonic()
        pid = pool.pool_id
        out["zero"] = until(lambda: billed(lab, pid) == 0) - t0 - 1.0
    for key, size in (("fixed", 4), ("burst", sky.Nodes(0, max=4, min=0))):
        t0 = time.monotonic()
        with sky.Compute(provider=provider, nodes=size) as pool:
            assert pool.map(work, range(200)) == list(range(200))
            out[key] = time.monotonic() - t0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--boot-delay", type=float, default=2.0)
    args = parser.parse_args()
    reason = aws_unavailable()
    if reason:
        sys.exit(f"bench_aws_elastic: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the lab down on SIGTERM
    with AwsLab(boot_delay=args.boot_delay) as lab:
        one_round(lab)  # warms the instance type catalog
        runs = [one_round(lab) for _ in range(args.reps)]
    report(runs, args.reps, args.boot_delay)


def report(runs: list[dict[str, float]], reps: int, d: float) -> None:
    def spread(key: str, less: float = 0.0) -> str:
        values = [r[key] - less for r in runs]
        return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"

    load = os.getloadavg()[0]
    print(f"### Elastic AWS pools (moto EC2 API, instances boot D = {d:g} s after launch)\n")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {load:.1f} at the end; {reps} repetitions, "
        "medians (min-max).\n"
    )
    print("| measurement | time | less D |")
    print("| --- | --- | --- |")
    rows = [
        ("plain 1-node pool: open to first result", "plain", True),
        ("wake from zero: first call to its result", "wake", True),
        ("plain 4-node pool: open to first broadcast result", "plain4", True),
        ("grow 1 -> 4: resize(4) to 4 nodes serving", "grow", True),
        ("shrink 4 -> 1: resize(1) to 3 instances terminated", "shrink", False),
        ("scale to zero: idle timeout over to no instance billed", "zero", False),
        ("200 x 50 ms, fixed pool of 4: open to last result", "fixed", True),
        ("200 x 50 ms, Nodes(0, max=4, min=0): open to last result", "burst", True),
    ]
    for what, key, launches in rows:
        print(f"| {what} | {spread(key)} | {spread(key, d) if launches else ''} |")
    wake = [r["wake"] / r["plain"] for r in runs]
    grow = [r["grow"] / r["plain4"] for r in runs]
    burst = [r["burst"] / r["fixed"] for r in runs]
    print(
        f"\nWake / plain start: {statistics.median(wake):.2f}x "
        f"({min(wake):.2f}-{max(wake):.2f}); grow 1 -> 4 / plain 4-node start: "
        f"{statistics.median(grow):.2f}x ({min(grow):.2f}-{max(grow):.2f}); burst from zero "
        f"/ fixed 4: {statistics.median(burst):.2f}x ({min(burst):.2f}-{max(burst):.2f})."
    )


if __name__ == "__main__":
    main()
