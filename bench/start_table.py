"""The report of the GPU markets' start benchmarks (bench_runpod, bench_gcp, bench_lambda,
bench_verda): a pool's start against its floor, alternating in each repetition."""

from __future__ import annotations

import statistics


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
