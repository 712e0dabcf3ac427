"""The AWS provider (see ``provider``); loaded on first use, so that its settings
(``settings``) load alone."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .provider import AWS as AWS


def __getattr__(name: str) -> Any:
    if name == "AWS":
        from .provider import AWS

        return AWS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
