"""The one timing and statistics helper every measurement of the suite uses."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Summary:
    """Median and spread of a list of samples (seconds, bytes or calls/s)."""

    median: float
    p10: float
    p90: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Summary:
        if not samples:
            raise ValueError("no samples to summarize")
        ordered = sorted(samples)
        return cls(
            median=statistics.median(ordered),
            p10=_percentile(ordered, 0.10),
            p90=_percentile(ordered, 0.90),
            n=len(ordered),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def sample(
    fn: Callable[[], object],
    *,
    count: int,
    budget: float,
    warmup: int = 0,
    min_count: int = 3,
) -> list[float]:
    """Seconds each of up to ``count`` calls of ``fn`` took, after ``warmup`` untimed calls.

    Stops early once ``budget`` seconds have gone by (after at least ``min_count`` samples),
    so every loop of the suite is bounded in count and in time.
    """
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + budget
    while len(samples) < count:
        start = time.perf_counter()
        fn()
        end = time.perf_counter()
        samples.append(end - start)
        if end >= deadline and len(samples) >= min_count:
            break
    return samples


class Stopwatch:
    """Seconds from creation to named points: ``watch.lap("first result")``."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        self.laps[name] = time.perf_counter() - self._start
