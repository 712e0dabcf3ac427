"""Examples of the reference documents (000-002) that need no plugin, run unchanged apart
from the import (``import flotilla as sky``) and the provider (the local default)."""

from __future__ import annotations

import pytest

import flotilla as sky


def test_distributed_task_runtime_context(capsys: pytest.CaptureFixture[str]) -> None:
    coordinated = []

    def coordinate_others() -> None:
        coordinated.append(True)

    def process(data: list[int]) -> int:
        return sum(data)

    @sky.function
    def distributed_task(data):  # type: ignore[no-untyped-def]
        info = sky.instance_info()
        print(f"Node {info.node} of {info.total_nodes}")

        if info.is_head:
            coordinate_others()

        return process(data)

    with sky.Compute(nodes=4) as compute:
        results = distributed_task([1, 2, 3]) @ compute
    assert results == [6, 6, 6, 6]
    out = capsys.readouterr().out
    assert sorted(line for line in out.splitlines() if "Node" in line) == [
        f"(node-{k}, rank={k}) Node {k} of 4" for k in range(4)
    ]


def test_shard_with_shuffle_keeps_pairs_aligned() -> None:
    def fit(x, y):  # type: ignore[no-untyped-def]
        assert all(yi == 2 * xi for xi, yi in zip(x, y, strict=True))
        return len(x)

    @sky.function
    def train(x_full, y_full):  # type: ignore[no-untyped-def]
        x, y = sky.shard(x_full, y_full, shuffle=True, seed=42)
        # x[i] still corresponds to y[i]
        return fit(x, y)

    x_full = list(range(100))
    y_full = [2 * v for v in x_full]
    with sky.Compute(nodes=4) as compute:
        assert train(x_full, y_full) @ compute == [25, 25, 25, 25]


def test_head_only_output(capsys: pytest.CaptureFixture[str]) -> None:
    @sky.function
    @sky.stdout(only="head")
    def train():  # type: ignore[no-untyped-def]
        for epoch, loss in enumerate([0.9, 0.5]):
            print(f"Epoch {epoch}: loss={loss:.4f}")  # only head node prints

    with sky.Compute(nodes=4) as compute:
        train() @ compute  # runs on all 4 nodes
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "Epoch" in line] == [
        "(node-0, rank=0) Epoch 0: loss=0.9000",
        "(node-0, rank=0) Epoch 1: loss=0.5000",
    ]


def test_standalone_workers_for_embarrassingly_parallel_work() -> None:
    @sky.function
    def work(i):  # type: ignore[no-untyped-def]
        return i * i

    with sky.Compute(nodes=2, options=sky.Options(cluster=False)) as compute:
        assert compute.map(work, range(6)) == [0, 1, 4, 9, 16, 25]
        assert (work(2) & work(3)) >> compute == (4, 9)
