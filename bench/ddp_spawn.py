"""The hand-written peer of the DDP benchmark: ``torch.multiprocessing.spawn``, 2 processes.

``python bench/ddp_spawn.py OUT.json STEPS`` starts 2 processes with the spawn start method
(the standard way); each sets ``MASTER_ADDR``/``MASTER_PORT`` (a free port the parent picked),
initialises a gloo group and runs the same ``train()`` as the other systems
(``ddp_loop.py``). Rank 0 writes the result to OUT.json, with ``parent_ready``: the time
at which the parent had imported torch and was about to spawn (the "after import torch"
launch of the benchmark).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(rank: int, world: int, port: int, out: str, steps: int, parent_ready: float) -> None:
    import torch.distributed as dist
    from ddp_loop import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = train(steps)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({**result, "parent_ready": parent_ready}, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    import torch.multiprocessing as mp

    parent_ready = time.time()
    mp.spawn(
        worker,
        args=(2, free_port(), sys.argv[1], int(sys.argv[2]), parent_ready),
        nprocs=2,
        start_method="spawn",
    )
