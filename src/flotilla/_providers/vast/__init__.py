"""The Vast.ai provider (see ``provider``); loaded on first use, so that its settings
(``settings``) load alone."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .provider import VastAI as VastAI


def __getattr__(name: str) -> Any:
    if name == "VastAI":
        from .provider import VastAI

        return VastAI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
