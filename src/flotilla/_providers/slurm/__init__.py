"""The SLURM provider (see ``provider``); loaded on first use, so that its settings
(``settings``) load alone."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .provider import Slurm as Slurm


def __getattr__(name: str) -> Any:
    if name == "Slurm":
        from .provider import Slurm

        return Slurm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
