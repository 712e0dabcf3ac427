"""The training loop every system of the DDP benchmark runs: a small MLP on CPU.

Under torchrun: ``torchrun --nproc-per-node=2 bench/ddp_loop.py OUT.json STEPS`` (the
script initialises the process group itself). Under flotilla: ``train(steps)`` is called in
each node's process, where the torch plugin has already initialised the group.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def train(steps: int = 100) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(64, 256)
    y = torch.randint(0, 10, (64,))
    stamps = []
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        stamps.append(time.time())
    return {"rank": dist.get_rank(), "stamps": stamps}


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = train(int(sys.argv[2]))
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
