"""AWS pools of many instances: 64 instances of the AWS lab against 8 (issue 27).

Run as root: ``.venv/bin/python bench/bench_aws_scale.py [--nodes 64] [--reps 3]
[--boot-delay 2]``. The lab is ``tests/_aws.py``: moto's EC2 API in server mode, and
instances that are network-namespace hosts with their own sshd, booted D seconds after the
emulator saw them launched. Prints a markdown table, medians over the repetitions (min-max),
every figure from the same run, the 8- and the N-instance pools alternating:

* pool start to the first no-op result (``with sky.Compute(provider=AWS, nodes=N) as
  pool: noop() @ pool``) for 8 and N instances, and their ratio (goal: <= 1.5x);
* that time split into the API part (until the emulator saw the first instance), the boots
  (first seen to last sshd started: D plus the lab's own work per instance) and the last
  boot to the result (SSH, agents, the call);
* the CPU the start used: the whole machine's (every user's; the machine is shared), this
  run's own (a cgroup with every process it started: moto, the lab's hosts, sshd, the
  agents, the client and its ``ssh``), and that divided by the cores, the CPU floor: the
  least wall time the start can take on this machine, whoever's code burnt the CPU (the
  64 instances' own work shares these cores too; on EC2 each has cores of its own);
* the client's open files at their peak during the start (the waits for port 22 hold a
  few sockets per instance, the agents' channels three pipes);
* the API calls per pool, and the pool's close;
* the load average when the run started and when it ended (the machine is shared).

The instance type catalog is warm (cached): a first, unmeasured pool fills it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _aws import AwsLab, aws_unavailable

import flotilla as sky
from flotilla._providers.aws import api as aws_api


@sky.function
def noop() -> None:
    return None


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def lab_files(lab: AwsLab, ids: set[str]) -> int:
    """The files the lab itself holds open in this process for the instances ``ids`` (each
    host's sshd log, each metadata stand-in's pipe): not the client's."""
    held = 0
    for ident in ids:
        inst = lab.instances.get(ident)
        if inst is None:
            continue
        held += inst.host is not None and inst.host._log is not None
        held += (
            inst.imds is not None and inst.imds.stdout is not None and not inst.imds.stdout.closed
        )
    return held


def process_cpu() -> float:
    """CPU seconds of this process: flotilla's client, moto's server and the lab's
    threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def busy_cpu() -> float:
    """CPU seconds this machine has spent busy (all processes, all cores) since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuAccount:
    """The CPU seconds this process and everything it starts (the lab's moto, hosts, sshd,
    agents; flotilla's ssh clients) use: a cgroup (v1 ``cpuacct``) of their own, made at
    the start and removed at the end. ``seconds()`` is None where none can be made."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self) -> None:
        self.group = self.ROOT / f"flotilla-bench-{os.getpid()}"
        self.home: Path | None = None

    def __enter__(self) -> CpuAccount:
        try:
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                _, names, path = line.split(":", 2)
                if "cpuacct" in names.split(","):
                    self.home = self.ROOT / path.lstrip("/")
            self.group.mkdir()
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self.home = None
        return self

    def seconds(self) -> float | None:
        try:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        except OSError:
            return None

    def __exit__(self, *exc: object) -> None:
        if self.home is not None:
            with contextlib.suppress(OSError):
                (self.home / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(50):  # the lab's last processes may still be exiting
            try:
                self.group.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        print(f"bench_aws_scale: could not remove {self.group}", file=sys.stderr)


def one_pool(lab: AwsLab, nodes: int, ours: CpuAccount) -> dict[str, Any]:
    """Start a pool of ``nodes`` instances, broadcast a no-op, close it: its timings (s),
    the machine's busy CPU seconds from the start to the result, the API calls."""
    before = Counter(aws_api.calls)
    seen_before = set(lab.boot_times)
    base_fds, peak, done = fds(), [0], threading.Event()

    def sample() -> None:  # the client's open files while the pool starts
        while not done.wait(0.01):
            peak[0] = max(peak[0], fds())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    cpu0, own0, self0 = busy_cpu(), ours.seconds(), process_cpu()
    with sky.Compute(provider=lab.provider(), nodes=nodes) as pool:
        result = noop() @ pool
        t1 = time.monotonic()
        cpu, own, inproc = busy_cpu() - cpu0, ours.seconds(), process_cpu() - self0
        done.set()
        sampler.join()
        lab_fds = lab_files(lab, set(lab.boot_times) - seen_before)
    closed = time.monotonic() - t1
    assert result == [None] * nodes, result
    calls = Counter(aws_api.calls)
    calls.subtract(before)
    boots = [v for k, v in lab.boot_times.items() if k not in seen_before]
    assert len(boots) == nodes, f"{len(boots)} instances booted for {nodes} nodes"
    for ident in set(lab.boot_times) - seen_before:  # the next start on an idle lab
        if not lab.wait_ended(ident, 120):
            raise SystemExit(f"bench_aws_scale: the lab did not stop {ident}'s host")
    launched = min(seen for seen, _ in boots)
    booted = max(up for _, up in boots)
    return {
        "seen": max(seen for seen, _ in boots) - launched,
        "one_boot": statistics.median(up - seen for seen, up in boots),
        "total": t1 - t0,
        "api": launched - t0,
        "boot": booted - launched,
        "after_boot": t1 - booted,
        "cpu": cpu,
        "fds": peak[0] - base_fds - lab_fds,
        "self": inproc,
        "own": own - own0 if own is not None and own0 is not None else float("nan"),
        "close": closed,
        "calls": +calls,
    }


def spread(values: list[float], unit: str = "s") -> str:
    return f"{statistics.median(values):.2f} {unit} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--boot-delay", type=float, default=2.0)
    args = parser.parse_args()
    reason = aws_unavailable()
    if reason:
        sys.exit(f"bench_aws_scale: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the lab down on SIGTERM
    load0 = os.getloadavg()
    sizes = (8, args.nodes)
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    with CpuAccount() as ours, AwsLab(boot_delay=args.boot_delay) as lab:
        one_pool(lab, 8, ours)  # the instance type catalog, cold
        for _ in range(args.reps):
            for n in sizes:
                runs[n].append(one_pool(lab, n, ours))
    report(runs, args, load0, os.getloadavg())


def report(
    runs: dict[int, list[dict[str, Any]]],
    args: argparse.Namespace,
    load0: tuple[float, float, float],
    load1: tuple[float, float, float],
) -> None:
    big = args.nodes

    def col(n: int, key: str) -> list[float]:
        return [r[key] for r in runs[n]]

    ratio = statistics.median(col(big, "total")) / statistics.median(col(8, "total"))
    ratios = [a["total"] / b["total"] for a, b in zip(runs[big], runs[8], strict=True)]
    cpus = os.cpu_count() or 1
    d = args.boot_delay
    print(f"### AWS pools of {big} instances (moto EC2 API, instances boot D = {d:g} s)\n")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, {cpus} CPUs, "
        f"load average {load0[0]:.1f} when the run started, {load1[0]:.1f} at its end; "
        f"{args.reps} repetitions, 8 and {big} instances alternating, medians (min-max). "
        "'boots' is the emulator's: first instance seen to last sshd started (D plus the "
        "lab's own work per instance: namespace, metadata stand-in, bootcmd, sshd). "
        "The run's own CPU is its cgroup's (every process it started, the lab's "
        "included); 'CPU floor' is that divided by the cores: the least wall time that much "
        "work takes on this machine, even alone on it.\n"
    )
    print("| measurement | 8 instances | " + f"{big} instances |")
    print("| --- | --- | --- |")
    for key, what in (
        ("total", "pool start to first no-op result"),
        ("api", "API calls until the first launch was seen"),
        ("boot", "boots (emulator)"),
        ("seen", "of which: first to last instance seen by the emulator"),
        ("one_boot", "of which: one instance's boot, seen to sshd started (median)"),
        ("after_boot", "last boot to first result"),
        ("close", "pool close (terminate, wait, delete the group)"),
    ):
        print(f"| {what} | {spread(col(8, key))} | {spread(col(big, key))} |")

    def cpu_row(what: str, key: str, scale: float = 1.0, unit: str = "CPU-s") -> None:
        cells = [spread([v / scale for v in col(n, key)], unit) for n in (8, big)]
        print(f"| {what} | {cells[0]} | {cells[1]} |")

    cpu_row("busy CPU, whole machine (every user), start to result", "cpu")
    cpu_row("CPU used by this run (lab, moto, sshd, agents, client), start to result", "own")
    cpu_row("of which: this process (flotilla's client, moto, the lab's threads)", "self")
    cpu_row(f"CPU floor: this run's CPU / {cpus} cores", "own", cpus, "s")
    print(
        "| client open files, peak during the start (above baseline; the lab's own files "
        "in this process, 2 per instance, left out) | "
        f"{max(col(8, 'fds')):.0f} | {max(col(big, 'fds')):.0f} |"
    )
    small, large = runs[8][-1]["calls"], runs[big][-1]["calls"]
    print(
        f"| API calls per pool | {sum(small.values())} | {sum(large.values())} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(large.items()))}) |"
    )
    print()
    print("| goal | result |")
    print("| --- | --- |")
    print(
        f"| {big} instances <= 1.5x the 8-instance start | {ratio:.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f} per repetition): "
        f"{'met' if ratio <= 1.5 else 'NOT met'} |"
    )


if __name__ == "__main__":
    main()
