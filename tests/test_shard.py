"""shard(): modulo striding, shuffling, alignment and type preservation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import flotilla as sky


def test_modulo_striding() -> None:
    data = list(range(10))
    assert [sky.shard(data, node=k, total_nodes=3) for k in range(3)] == [
        [0, 3, 6, 9],
        [1, 4, 7],
        [2, 5, 8],
    ]


def test_outside_a_pool_the_single_node_gets_everything() -> None:
    assert sky.shard([1, 2, 3]) == [1, 2, 3]


def test_shuffle_is_the_same_permutation_on_every_node() -> None:
    data = list(range(100))
    parts = [sky.shard(data, shuffle=True, seed=7, node=k, total_nodes=4) for k in range(4)]
    assert sorted(x for p in parts for x in p) == data  # disjoint and complete
    assert parts[0] != data[0::4]  # really shuffled
    again = sky.shard(data, shuffle=True, seed=7, node=2, total_nodes=4)
    assert again == parts[2]
    assert sky.shard(data, shuffle=True, seed=8, node=2, total_nodes=4) != parts[2]


def test_several_arrays_stay_aligned() -> None:
    x = np.arange(50)
    y = [f"label{i}" for i in range(50)]
    xs, ys = sky.shard(x, y, shuffle=True, seed=42, node=1, total_nodes=3)
    assert isinstance(xs, np.ndarray) and isinstance(ys, list)
    assert ys == [f"label{i}" for i in xs]


def test_lengths_must_match() -> None:
    with pytest.raises(ValueError, match=r"same length.*\[3, 4\]"):
        sky.shard([1, 2, 3], [1, 2, 3, 4])


def test_drop_last_gives_every_node_a_contiguous_block_of_the_same_count() -> None:
    """Skyward's: node k gets items k*m .. (k+1)*m - 1 of m = len // N; the tail is dropped."""
    data = list(range(10))
    parts = [sky.shard(data, drop_last=True, node=k, total_nodes=3) for k in range(3)]
    assert parts == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    shuffled = [
        sky.shard(data, drop_last=True, shuffle=True, seed=5, node=k, total_nodes=3)
        for k in range(3)
    ]
    order = sky.shard(data, shuffle=True, seed=5, node=0, total_nodes=1)
    assert shuffled == [order[0:3], order[3:6], order[6:9]]


@pytest.mark.parametrize(
    "data",
    [
        list(range(9)),
        tuple(range(9)),
        np.arange(18).reshape(9, 2),
        pd.DataFrame({"a": range(9), "b": list("abcdefghi")}),
        pd.Series(range(9)),
        "abcdefghi",
    ],
    ids=["list", "tuple", "ndarray", "dataframe", "series", "str"],
)
def test_type_is_preserved(data: object) -> None:
    part = sky.shard(data, node=1, total_nodes=3)
    assert type(part) is type(data)
    assert len(part) == 3  # type: ignore[arg-type]
    if isinstance(data, pd.DataFrame):
        assert list(part["a"]) == [1, 4, 7]  # type: ignore[index]


def test_torch_tensors_are_preserved() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(12).reshape(6, 2)
    part = sky.shard(t, node=0, total_nodes=2)
    assert isinstance(part, torch.Tensor)
    assert part[:, 0].tolist() == [0, 4, 8]


def test_any_sized_indexable_sequence() -> None:
    assert sky.shard(range(7), node=1, total_nodes=2) == [1, 3, 5]


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="at least one"):
        sky.shard()
    with pytest.raises(TypeError, match="no length"):
        sky.shard(x for x in range(3))
    with pytest.raises(ValueError, match=r"node must be in 0\.\.1"):
        sky.shard([1, 2], node=2, total_nodes=2)
    with pytest.raises(ValueError, match="total_nodes"):
        sky.shard([1, 2], node=0, total_nodes=0)


def test_shard_inside_a_pool_uses_the_node_rank(pool4: sky.Compute) -> None:
    @sky.function
    def mine(data: list[int]) -> list[int]:
        return sky.shard(data)

    assert mine(list(range(8))) @ pool4 == [[0, 4], [1, 5], [2, 6], [3, 7]]
