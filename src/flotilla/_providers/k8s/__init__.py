"""The Kubernetes provider (see ``provider``); loaded on first use, so that its settings
(``settings``) load alone."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .provider import Kubernetes as Kubernetes


def __getattr__(name: str) -> Any:
    if name == "Kubernetes":
        from .provider import Kubernetes

        return Kubernetes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
