"""Providers: where nodes come from (local processes, SSH hosts, ...), behind one interface."""

import importlib
from collections.abc import Callable
from typing import Any


def provider_loader(package: str, name: str) -> Callable[[str], Any]:
    """A provider package's ``__getattr__``: ``name`` (the provider's class) is imported
    from the package's ``provider`` module on first use, so that its ``settings`` load
    alone."""

    def __getattr__(attribute: str) -> Any:
        if attribute == name:
            return getattr(importlib.import_module(".provider", package), name)
        raise AttributeError(f"module {package!r} has no attribute {attribute!r}")

    return __getattr__
