"""The report of the GPU markets' start benchmarks (bench_runpod, bench_gcp, bench_lambda,
bench_verda): a pool's start against its floor, alternating in each repetition; and the
floor's last step, ``ssh true`` into each instance."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Iterable


def print_start_table(
    what: str, floor: str, starts: list[float], floors: list[float], d: float
) -> None:
    """Print the markdown table (medians, with their range) of ``starts`` against
    ``floors`` (``floor``: how the floor was taken) and whether the goal (<= D + 3 s) is met."""

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    ratios = [s / f for s, f in zip(starts, floors, strict=True)]
    print(f"| {what}, D = {d:g} s | median (range) |")
    print("| --- | --- |")
    print(f"| pool start to first result, s (goal <= D + 3 = {d + 3:g}) | {cell(starts)} |")
    print(f"| floor: {floor}, s | {cell(floors)} |")
    print(f"| ratio to the same repetition's floor | {cell(ratios)} |")
    ok = statistics.median(starts) <= d + 3
    print(f"\ngoal {'met' if ok else 'NOT met'}")


def ssh_true(key: str, hosts: Iterable[tuple[str, int]]) -> None:
    """``ssh true`` as root with ``key`` into each ``(address, port)``, all at once, each
    tried again until it answers (its sshd may not listen yet)."""
    options = ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "BatchMode=yes"]

    def ssh(host: tuple[str, int]) -> subprocess.Popen[bytes]:
        argv = ["ssh", "-i", key, "-o", "LogLevel=ERROR", "-p", str(host[1])]
        for option in options:
            argv += ["-o", option]
        return subprocess.Popen([*argv, f"root@{host[0]}", "true"])

    targets = list(hosts)
    pending = {i: ssh(host) for i, host in enumerate(targets)}
    while pending:
        for i, proc in list(pending.items()):
            if proc.poll() is None:
                continue
            pending.pop(i)
            if proc.returncode != 0:
                time.sleep(0.05)
                pending[i] = ssh(targets[i])
        time.sleep(0.01)
