"""A DDP check the providers' tests run on their pools: a tiny model trained with gloo across
the pool's nodes (test hosts in network namespaces, SLURM nodes...)."""

from __future__ import annotations

import flotilla as sky


@sky.function
def ddp_train(steps: int) -> list[float]:
    """Train a tiny model with DDP; return its parameters."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(1234 + dist.get_rank())  # different data on every rank
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    return [float(x) for p in model.module.parameters() for x in p.detach().flatten()]


def assert_ddp_averages(pool: sky.Compute, nodes: int) -> None:
    """Train on every node of ``pool`` (opened with the torch plugin) with different data:
    DDP averaged the gradients when every node ends with the same parameters."""
    params = ddp_train(5) @ pool
    assert len(params) == nodes
    assert all(p == params[0] for p in params), params
