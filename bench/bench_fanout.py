"""Broadcast of a large argument to many SSH hosts: 32 MB to 128 hosts against 8 hosts.

Run as root: ``.venv/bin/python bench/bench_fanout.py [--hosts 128] [--mb 32] [--reps 3]
[--direct]``. Prints a markdown table (medians over the repetitions, min-max, same run):
the time of ``checksum(array) @ pool`` on ``--hosts`` hosts and on 8, and their ratio
(issue 27's goal for a broadcast that fans out in a tree: <= 4x). Every node returns the
array's checksum, checked against the client's.

The broadcasts fan out (``_client/fanout.py``): the client sends one copy, the nodes relay
it. With ``--direct`` the same broadcasts are also made on today's direct path (the client
writes the argument to every node's channel), in alternation, for comparison.

All the test hosts share this machine's CPUs: past a few hosts the broadcast is bound by
the CPU time all of them spend (each receives, checks and relays 32 MB, and the benchmark's
function hashes it again). So the table also gives that time (the CPU seconds of every
process of the hosts and of the client and its ``ssh`` processes, per broadcast), divided
by the number of CPUs: the least any broadcast can take here, whatever the tree.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _hosts import Lab, lab_unavailable

import flotilla as sky
from flotilla._client import fanout

_TICK = os.sysconf("SC_CLK_TCK")


@sky.function
def checksum(data: Any) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) of a live process; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


class Sample:
    """One broadcast: its time, the CPU seconds it cost, the copies the client sent."""

    def __init__(self, took: float, cpu: float, copies: int) -> None:
        self.took, self.cpu, self.copies = took, cpu, copies


def _pids(lab: Lab, pool: sky.Compute) -> list[int]:
    hosts = {n.proc.address for n in pool._nodes}
    pids = [pid for h in lab.hosts if h.addr in hosts for pid in lab.pids(h)]
    return pids + [p.proc.pid for p in pool._procs if hasattr(p, "proc")]  # the ssh clients


def broadcast(lab: Lab, pool: sky.Compute, data: Any, want: str) -> Sample:
    pids = _pids(lab, pool)
    known = {ref for n in pool._nodes for ref in n.have}
    before = sum(_cpu(p) for p in pids)
    mine = time.process_time()
    t0 = time.perf_counter()
    got = checksum(data) @ pool
    took = time.perf_counter() - t0
    cpu = sum(_cpu(p) for p in pids) - before + time.process_time() - mine
    if set(got) != {want}:
        raise SystemExit("bench_fanout: a node got other bytes")
    new = {ref for n in pool._nodes for ref in n.have} - known
    if not new:  # the direct path: a copy to every node
        return Sample(took, cpu, len(pool._nodes))
    (ref,) = new
    return Sample(took, cpu, sum(1 for n in pool._nodes if n.have[ref]["via"] == "client"))


@contextmanager
def direct_path() -> Iterator[None]:
    saved = fanout.MIN_NODES
    fanout.MIN_NODES = 1 << 30
    try:
        yield
    finally:
        fanout.MIN_NODES = saved


def _row(name: str, samples: list[Sample], cpus: int) -> str:
    took = [s.took for s in samples]
    cpu = statistics.median(s.cpu for s in samples)
    return (
        f"| {name} | {statistics.median(took):.2f} s ({min(took):.2f}-{max(took):.2f}) "
        f"| {cpu:.1f} s ({cpu / cpus:.2f} s) | {statistics.median(s.copies for s in samples):g} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=128)
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--direct", action="store_true", help="also today's direct path")
    args = parser.parse_args()
    reason = lab_unavailable()
    if reason:
        sys.exit(f"bench_fanout: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data = bytearray(os.urandom(args.mb * 2**20))
    want = hashlib.sha256(data).hexdigest()
    cpus = os.cpu_count() or 1
    runs: dict[str, list[Sample]] = {}
    load_start = os.getloadavg()[0]
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
            checksum(b"warm") @ many  # every node has the function and a warm process
            checksum(b"warm") @ few
            for _ in range(args.reps):
                runs.setdefault("few", []).append(broadcast(lab, few, data, want))
                runs.setdefault("many", []).append(broadcast(lab, many, data, want))
                if args.direct:
                    with direct_path():
                        runs.setdefault("few direct", []).append(broadcast(lab, few, data, want))
                        runs.setdefault("many direct", []).append(broadcast(lab, many, data, want))
    load_end = os.getloadavg()[0]
    ratio = statistics.median(s.took for s in runs["many"]) / statistics.median(
        s.took for s in runs["few"]
    )
    print(f"### Broadcast of {args.mb} MB to {args.hosts} SSH hosts against 8\n")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, {cpus} CPUs, "
        f"load average {load_start:.1f} at the start and {load_end:.1f} at the end (other "
        f"work shares the machine); {args.reps} repetitions, medians (min-max). CPU: the "
        "seconds every process of the hosts and the client spent on one broadcast (divided "
        "by the CPUs: the least it can take here). Copies: payloads the client sent.\n"
    )
    print("| measurement | time | CPU (÷ CPUs) | copies |")
    print("| --- | --- | --- | --- |")
    names = {
        "many": f"{args.mb} MB broadcast, {args.hosts} hosts, fan-out",
        "few": f"{args.mb} MB broadcast, 8 hosts, fan-out",
        "many direct": f"{args.mb} MB broadcast, {args.hosts} hosts, direct (before)",
        "few direct": f"{args.mb} MB broadcast, 8 hosts, direct (before)",
    }
    for key, name in names.items():
        if key in runs:
            print(_row(name, runs[key], cpus))
    verdict = "met" if ratio <= 4 else "NOT met"
    print(f"| {args.hosts} hosts / 8 hosts, fan-out | {ratio:.1f}x | | <= 4x: {verdict} |")
    if args.direct:
        before = statistics.median(s.took for s in runs["many direct"]) / statistics.median(
            s.took for s in runs["few direct"]
        )
        print(f"| {args.hosts} hosts / 8 hosts, direct (before) | {before:.1f}x | | |")


if __name__ == "__main__":
    main()
