"""The HuggingFace plugin: transformers, datasets, tokenizers and what ``Trainer`` needs,
and the access token."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from .._errors import ConfigurationError
from .._info import InstanceInfo
from ._base import Plugin
from ._env import environ
from ._extend import extend

PACKAGES = ("transformers", "datasets", "tokenizers", "accelerate", "torch")
"""What ``Trainer`` needs (it refuses to start without accelerate and torch); a package the
node already has is not installed again."""


@dataclass(frozen=True)
class HuggingfacePlugin(Plugin):
    """See :func:`flotilla.plugins.huggingface`. Its repr never shows the token."""

    token: str | None = field(default=None, repr=False)

    name = "huggingface"

    def __post_init__(self) -> None:
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ConfigurationError("huggingface token must be a non-empty string or None")

    def __repr__(self) -> str:
        return f"plugins.huggingface(token={'***' if self.token else None})"

    def transform(self, image: Any, cluster: Any) -> Any:
        """Add transformers, datasets and tokenizers to the image."""
        return extend(image, pip=PACKAGES)

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[None] | None:
        """Set ``HF_TOKEN`` in the process environment (if a token was given)."""
        if self.token is None:
            return None
        return environ({"HF_TOKEN": self.token})
