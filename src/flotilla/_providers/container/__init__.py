"""The Container provider (see ``provider``); loaded on first use, so that its settings
(``settings``) load alone."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .provider import Container as Container


def __getattr__(name: str) -> Any:
    if name == "Container":
        from .provider import Container

        return Container
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
