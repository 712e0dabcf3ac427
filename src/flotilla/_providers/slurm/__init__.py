"""The SLURM provider: one allocation for a pool, an ``srun`` step per node (see ``provider``)."""

from .provider import Slurm

__all__ = ["Slurm"]
