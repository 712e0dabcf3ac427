"""What ``torchrun`` runs in the cold-start benchmark: join the group, pass one barrier."""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    print("barrier", flush=True)
dist.destroy_process_group()
