"""Pools of many SSH hosts: 128 sshd test hosts (network namespaces on this machine).

Run as root: ``.venv/bin/python bench/bench_scale.py [--hosts 128] [--reps 3]``. Prints a
markdown table, medians over the repetitions (min-max), every figure from the same run:

* the floor: ``python3 -c pass`` on every host at once over parallel OpenSSH (one ``ssh``
  per host, the provider's own options), start to last exit;
* pool start to the first no-op result (``open()`` then ``noop() >> pool``) on every host
  (goal: <= 2x the floor), and a no-op broadcast (``noop() @ pool``);
* the client's open files and threads with the pool open, and after it closed (goal: open
  files <= 3 per node + 64, back to the baseline after close);
* the same pool start on 8 hosts, for the slope.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _hosts import Lab, lab_unavailable

import flotilla as sky


@sky.function
def noop() -> None:
    return None


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def floor(provider: Any, hosts: int) -> float:
    """Seconds to run ``python -c pass`` on ``hosts`` hosts at once over OpenSSH."""
    shell = provider.shell(lambda m: provider.target(provider.hosts[int(m)]))
    argvs = [
        shell.ssh_argv(provider.target(h), f"{sys.executable} -c pass")
        for h in provider.hosts[:hosts]
    ]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(a, stdin=subprocess.DEVNULL) for a in argvs]
    codes = [p.wait() for p in procs]
    took = time.perf_counter() - t0
    if any(codes):
        raise SystemExit(f"bench_scale: ssh failed on {sum(1 for c in codes if c)} host(s)")
    return took


def start(provider: Any, hosts: int, out: dict[str, list[float]], key: str) -> None:
    """Pool start to the first no-op result; then a broadcast, and the client's files."""
    base_fds, base_threads = fds(), threading.active_count()
    pool = sky.Compute(provider=provider, nodes=hosts)
    t0 = time.perf_counter()
    try:
        pool.open()
        noop() >> pool
        out[key].append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        noop() @ pool
        out[f"{key}_bcast"].append(time.perf_counter() - t1)
        out[f"{key}_fds"].append(fds() - base_fds)
        out[f"{key}_threads"].append(threading.active_count() - base_threads)
    finally:
        pool.close()
    deadline = time.monotonic() + 10
    while fds() > base_fds and time.monotonic() < deadline:
        time.sleep(0.05)
    out[f"{key}_fds_after"].append(fds() - base_fds)


def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float], unit: str = "s") -> str:
    return f"{med(values):.2f} {unit} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    reason = lab_unavailable()
    if reason:
        sys.exit(f"bench_scale: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the lab down on SIGTERM
    n = args.hosts
    out: dict[str, list[float]] = {
        k: []
        for k in (
            "floor",
            "big",
            "big_bcast",
            "big_fds",
            "big_threads",
            "big_fds_after",
            "small",
            "small_bcast",
            "small_fds",
            "small_threads",
            "small_fds_after",
        )
    }
    t0 = time.perf_counter()
    with Lab() as lab:
        lab.add_hosts(n)
        made = time.perf_counter() - t0
        provider = lab.provider(python=sys.executable, connect_timeout=30.0)
        pool = sky.Compute(provider=provider, nodes=n)  # warm: the bundle on every host
        with pool:
            pass
        for _ in range(args.reps):
            out["floor"].append(floor(provider, n))
            start(provider, n, out, "big")
            start(provider, 8, out, "small")
    ratio = med(out["big"]) / med(out["floor"])
    fd_goal = 3 * n + 64
    print(f"### Pools of {n} SSH hosts (sshd test hosts in network namespaces)\n")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
        f"{args.reps} repetitions, medians (min-max); the lab took {made:.0f} s to build.\n"
    )
    print("| measurement | result | goal |")
    print("| --- | --- | --- |")
    print(f"| floor: `python3 -c pass` on {n} hosts, parallel OpenSSH | {spread(out['floor'])} | |")
    print(
        f"| pool start to first no-op result, {n} hosts | {spread(out['big'])} | "
        f"<= 2x floor: {ratio:.2f}x, {'met' if ratio <= 2 else 'NOT met'} |"
    )
    print(f"| no-op broadcast, {n} hosts | {spread(out['big_bcast'])} | |")
    print(f"| pool start to first no-op result, 8 hosts | {spread(out['small'])} | |")
    print(f"| no-op broadcast, 8 hosts | {spread(out['small_bcast'])} | |")
    big_fds = max(out["big_fds"])
    print(
        f"| client open files, {n}-node pool open (above baseline) | {big_fds:.0f} | "
        f"<= {fd_goal}: {'met' if big_fds <= fd_goal else 'NOT met'} |"
    )
    after = max(out["big_fds_after"])
    print(
        f"| client open files after close (above baseline) | {after:.0f} | "
        f"0: {'met' if after <= 0 else 'NOT met'} |"
    )
    print(
        f"| client threads, {n}-node pool open (above baseline) | {max(out['big_threads']):.0f} | |"
    )


if __name__ == "__main__":
    main()
