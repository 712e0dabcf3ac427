"""Broadcast of a large argument to many SSH hosts: 32 MB to 128 hosts against 8 hosts.

Run as root: ``.venv/bin/python bench/bench_fanout.py [--hosts 128] [--mb 32] [--reps 3]
[--direct] [--payload numpy]``. Prints a markdown table (medians over the repetitions, min-max, same run):
the time of ``checksum(array) @ pool`` on ``--hosts`` hosts and on 8, and their ratio
(issue 27's goal for a broadcast that fans out in a tree: <= 4x). Every node returns the
array's checksum, checked against the client's, and the CPU time the function spent on it
(its thread's), which the table subtracts from each host's CPU: the broadcast's own cost.

The broadcasts fan out (``_client/fanout.py``): the client sends one copy, the nodes relay
it. With ``--direct`` the same broadcasts are also made on today's direct path (the client
writes the argument to every node's channel), in alternation, for comparison.

All the test hosts share this machine's CPUs: past a few hosts the broadcast is bound by
the CPU time all of them spend (each receives, checks and relays 32 MB, and the benchmark's
function hashes it again). So the table also gives that time (the CPU seconds of every
process of the hosts and of the client and its ``ssh`` processes, per broadcast), divided
by the number of CPUs: the least any broadcast can take here, whatever the tree, and
each broadcast's time divided by that floor (issue 42's goal: <= 1.2x).
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
def checksum(data: Any) -> tuple[str, float]:
    """The received array's sha256 (what proves every host got the right bytes) and the
    CPU seconds this function itself spent on it (its thread's: the user's work, not the
    broadcast's)."""
    start = time.thread_time()
    digest = hashlib.sha256(memoryview(data)).hexdigest()
    return digest, time.thread_time() - start


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) of a live process; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def _proc(pid: int) -> tuple[str, int, bytes]:
    """A process's name (comm), parent and command line; ("", 0, b"") if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            head, tail = f.read().rsplit(")", 1)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return head.split("(", 1)[1], int(tail.split()[1]), f.read()
    except (OSError, IndexError, ValueError):
        return "", 0, b""


def _idle() -> float:
    """Seconds all CPUs of the machine have been idle (idle + iowait) since boot."""
    with open("/proc/stat") as f:
        fields = f.readline().split()  # "cpu user nice system idle iowait ..."
    return (int(fields[4]) + int(fields[5])) / _TICK


def _role(pid: int) -> str:
    """What a host's process is: sshd, the start command's shell, the agent (the first
    Python process of the start command) or an executor (forked from the agent)."""
    name, ppid, cmd = _proc(pid)
    if b"flotilla.agent" not in cmd:
        return "sshd" if "sshd" in name else "other"
    if not name.startswith("python"):
        return "shell"
    parent, _, parent_cmd = _proc(ppid)
    return (
        "executor" if parent.startswith("python") and b"flotilla.agent" in parent_cmd else "agent"
    )


class Sample:
    """One broadcast: its time, the CPU seconds it cost, the copies the client sent, the
    CPU seconds per host (its processes by role, see :func:`_role`), of those the
    seconds the broadcast's function itself spent per host (its hash of the array), and
    the seconds the machine's CPUs were idle meanwhile."""

    def __init__(
        self,
        took: float,
        cpu: float,
        copies: int,
        per_host: dict[str, float],
        own: float,
        idle: float,
    ) -> None:
        self.took, self.cpu, self.copies, self.per_host = took, cpu, copies, per_host
        self.own, self.idle = own, idle

    @property
    def host(self) -> float:
        """CPU seconds per host, all its processes."""
        return sum(self.per_host.values())

    @property
    def relay(self) -> float:
        """CPU seconds per host of the broadcast itself: the host's total less the
        function's own work."""
        return self.host - self.own


def _host_pids(lab: Lab, pool: sky.Compute) -> list[int]:
    hosts = {n.proc.address for n in pool._nodes}
    return [pid for h in lab.hosts if h.addr in hosts for pid in lab.pids(h)]


def broadcast(lab: Lab, pool: sky.Compute, data: Any, want: str) -> Sample:
    host_pids = _host_pids(lab, pool)
    roles = {pid: _role(pid) for pid in host_pids}
    pids = host_pids + [p.proc.pid for p in pool._procs if hasattr(p, "proc")]  # + ssh clients
    known = {ref for n in pool._nodes for ref in n.have}
    before = {p: _cpu(p) for p in pids}
    mine = time.process_time()
    idle = _idle()
    t0 = time.perf_counter()
    got = checksum(data) @ pool
    took = time.perf_counter() - t0
    idle = _idle() - idle
    after = {p: _cpu(p) for p in pids}
    cpu = sum(after.values()) - sum(before.values()) + time.process_time() - mine
    per_host: dict[str, float] = {}
    for pid, role in roles.items():
        per_host[role] = per_host.get(role, 0.0) + (after[pid] - before[pid]) / len(pool._nodes)
    if {digest for digest, _ in got} != {want}:
        raise SystemExit("bench_fanout: a node got other bytes")
    own = sum(spent for _, spent in got) / len(pool._nodes)
    new = {ref for n in pool._nodes for ref in n.have} - known
    if not new:  # the direct path: a copy to every node
        return Sample(took, cpu, len(pool._nodes), per_host, own, idle)
    (ref,) = new
    copies = sum(1 for n in pool._nodes if n.have[ref]["via"] == "client")
    return Sample(took, cpu, copies, per_host, own, idle)


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
    host = [s.host for s in samples]
    relay = [s.relay for s in samples]
    own = statistics.median(s.own for s in samples)
    roles = sorted({r for s in samples for r in s.per_host})
    split = ", ".join(
        f"{r} {statistics.median(s.per_host.get(r, 0.0) for s in samples) * 1e3:.0f}" for r in roles
    )
    floor = [s.took / (s.cpu / cpus) for s in samples]  # each broadcast's own floor
    # time x CPUs = the lab's CPU + the CPUs' idle time + what else ran: the last two make
    # the time exceed the floor (shares of time x CPUs)
    idle = statistics.median(s.idle / (s.took * cpus) for s in samples)
    other = statistics.median(max(0.0, 1 - (s.cpu + s.idle) / (s.took * cpus)) for s in samples)
    return (
        f"| {name} | {statistics.median(took):.2f} s ({min(took):.2f}-{max(took):.2f}) "
        f"| {cpu:.1f} s ({cpu / cpus:.2f} s) | {statistics.median(floor):.2f}x "
        f"({min(floor):.2f}-{max(floor):.2f}) | {idle:.0%}, {other:.0%} "
        f"| {statistics.median(host) * 1e3:.0f} ms "
        f"({min(host) * 1e3:.0f}-{max(host) * 1e3:.0f}; {split}) "
        f"| {own * 1e3:.0f} ms | **{statistics.median(relay) * 1e3:.0f} ms** "
        f"({min(relay) * 1e3:.0f}-{max(relay) * 1e3:.0f}) "
        f"| {statistics.median(s.copies for s in samples):g} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=128)
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--direct", action="store_true", help="also today's direct path")
    parser.add_argument(
        "--payload",
        choices=["bytearray", "numpy"],
        default="bytearray",
        help="what is broadcast: a bytearray (unpickled as a copy, its type owns its "
        "memory) or a numpy array of the same bytes (unpickled in place: a view of the "
        "received memory)",
    )
    args = parser.parse_args()
    reason = lab_unavailable()
    if reason:
        sys.exit(f"bench_fanout: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data: Any = bytearray(os.urandom(args.mb * 2**20))
    want = hashlib.sha256(data).hexdigest()
    if args.payload == "numpy":
        import numpy as np

        data = np.frombuffer(data, dtype=np.uint8).copy()
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
    print(f"### Broadcast of {args.mb} MB ({args.payload}) to {args.hosts} SSH hosts against 8\n")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, {cpus} CPUs, "
        f"load average {load_start:.1f} at the start and {load_end:.1f} at the end (other "
        f"work shares the machine); {args.reps} repetitions, medians (min-max). CPU: the "
        "seconds every process of the hosts and the client spent on one broadcast (divided "
        "by the CPUs: the least it can take here; time ÷ floor: each broadcast's time over "
        "its own floor). CPU per host: the seconds of a host's "
        "processes (sshd, agent, executor), per broadcast; function: of those, the "
        "seconds the broadcast's function spent itself (its thread's CPU time around its "
        "sha256 of the array, which proves the host got the right bytes: the user's work); "
        "broadcast: the CPU per host less the function's (issue 42's goal: <= 70 ms). "
        "Idle, other: of the CPUs' time during a broadcast (its time x CPUs), the shares "
        "they sat idle and ran something else than the lab's processes and the client "
        "(other work on the machine, the hypervisor's steal): what makes the time exceed "
        "the floor. Copies: payloads the client sent.\n"
    )
    print(
        "| measurement | time | CPU (÷ CPUs) | time ÷ floor | idle, other "
        "| CPU per host (ms, by role) | function | broadcast | copies |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    names = {
        "many": f"{args.mb} MB broadcast, {args.hosts} hosts, fan-out",
        "few": f"{args.mb} MB broadcast, 8 hosts, fan-out"
        + (" (a second pool on the same hosts)" if args.hosts == 8 else ""),
        "many direct": f"{args.mb} MB broadcast, {args.hosts} hosts, direct (before)",
        "few direct": f"{args.mb} MB broadcast, 8 hosts, direct (before)",
    }
    for key, name in names.items():
        if key in runs:
            print(_row(name, runs[key], cpus))
    verdict = "met" if ratio <= 4 else "NOT met"
    print(
        f"| {args.hosts} hosts / 8 hosts, fan-out | {ratio:.1f}x | | | | | | | <= 4x: {verdict} |"
    )
    if args.direct:
        before = statistics.median(s.took for s in runs["many direct"]) / statistics.median(
            s.took for s in runs["few direct"]
        )
        print(f"| {args.hosts} hosts / 8 hosts, direct (before) | {before:.1f}x | | | | | | | |")


if __name__ == "__main__":
    main()
