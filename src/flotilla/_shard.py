"""``shard()``: split data across nodes (modulo striding; contiguous blocks with drop_last)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ._errors import ConfigurationError
from ._info import instance_info


def shard(
    *data: Any,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    node: int | None = None,
    total_nodes: int | None = None,
) -> Any:
    """This node's part of ``data``: node k of N gets items k, k+N, k+2N, ... (with
    ``drop_last``: the k-th contiguous block of ``len(data) // N`` items).

    * ``shuffle``: every node applies the same permutation (from ``seed``) first, so the
      parts stay disjoint and together cover the data.
    * Several arrays stay aligned (``x, y = shard(x, y)``); their lengths must match.
    * ``drop_last``: every node gets exactly ``len(data) // N`` items, a contiguous block
      (of the shuffled order, with ``shuffle``): node k gets items ``k*m .. (k+1)*m - 1``
      of ``m = len(data) // N``; the last ``len(data) % N`` items go to no node.
    * ``node``/``total_nodes`` default to this process's global rank and the world size
      (``instance_info()``: the node's rank, or ``node * procs_per_node + local_rank``
      when a plugin runs several processes per node).
    * Type preserving: lists, tuples, numpy arrays, torch tensors, pandas DataFrames and
      Series (rows), and any sized indexable sequence (returned as a list).

    Returns one shard for one argument, a tuple of shards for several.
    """
    if not data:
        raise ConfigurationError("shard() needs at least one sequence to split")
    info = instance_info()  # with several processes per node, shard by global rank
    k = info.node * info.procs_per_node + info.local_rank if node is None else node
    n = info.total_nodes * info.procs_per_node if total_nodes is None else total_nodes
    if not isinstance(n, int) or n < 1:
        raise ConfigurationError(f"total_nodes must be a positive integer, got {n!r}")
    if not isinstance(k, int) or not 0 <= k < n:
        raise ConfigurationError(f"node must be in 0..{n - 1}, got {k!r}")
    lengths = [_length(d, i) for i, d in enumerate(data)]
    if len(set(lengths)) > 1:
        raise ConfigurationError(
            f"shard() arrays must have the same length to stay aligned, got lengths {lengths}"
        )
    length = lengths[0]
    order: Sequence[int] = range(length)
    if shuffle:
        perm = list(range(length))
        random.Random(seed).shuffle(perm)
        order = perm
    if drop_last:  # Skyward's: contiguous blocks of equal size, the tail dropped
        size = length // n
        indices = list(order[k * size : (k + 1) * size])
    else:
        indices = list(order[k::n])
    parts = tuple(_take(d, indices) for d in data)
    return parts[0] if len(parts) == 1 else parts


def _length(d: Any, i: int) -> int:
    try:
        return len(d)
    except TypeError:
        raise ConfigurationError(
            f"shard() argument {i} ({type(d).__name__}) has no length; pass a sized sequence"
        ) from None


def _take(d: Any, indices: list[int]) -> Any:
    module = type(d).__module__.split(".")[0]
    if module == "pandas":
        return d.iloc[indices]
    if module in ("numpy", "torch", "jax", "jaxlib", "cupy"):
        if module == "torch":
            import torch

            return d[torch.as_tensor(indices, dtype=torch.long)]
        import numpy as np

        return d[np.asarray(indices, dtype=np.intp)]
    if isinstance(d, list):
        return [d[i] for i in indices]
    if isinstance(d, tuple):
        return tuple(d[i] for i in indices)
    if isinstance(d, str):
        return "".join(d[i] for i in indices)
    if isinstance(d, bytes):
        return bytes(d[i] for i in indices)
    return [d[i] for i in indices]
