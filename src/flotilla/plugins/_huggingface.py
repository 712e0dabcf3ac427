"""The HuggingFace plugin: transformers, datasets, tokenizers and what ``Trainer`` needs,
the access token, and (as Skyward's) models fetched into the node's cache while its
environment is built."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Sequence
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

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
"""A hub repository id: ``name`` or ``owner/name`` (the hub's own rule, shortened)."""

DOWNLOAD = (
    "from huggingface_hub import snapshot_download\n"
    "for repo in {repos}:\n"
    '    print("cached", repo, "->", snapshot_download(repo), flush=True)\n'
)
"""The environment build's step that fetches the models (Skyward's ``hf-download``): into
the hub's cache (``HF_HOME``, default ``~/.cache/huggingface``), where ``from_pretrained``
then finds them; the hub is ``HF_ENDPOINT`` when set."""


@dataclass(frozen=True)
class HuggingfacePlugin(Plugin):
    """See :func:`flotilla.plugins.huggingface`. Its repr never shows the token."""

    token: str | None = field(default=None, repr=False)
    models: tuple[str, ...] = ()

    name = "huggingface"

    def __post_init__(self) -> None:
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ConfigurationError("huggingface token must be a non-empty string or None")
        for model in self.models:
            if not isinstance(model, str) or not _REPO_ID.fullmatch(model):
                raise ConfigurationError(
                    f"plugins.huggingface(models=...): {model!r} is not a hub repository id "
                    '(e.g. "meta-llama/Llama-3.1-8B")'
                )

    def __repr__(self) -> str:
        token = "***" if self.token else None
        if not self.models:
            return f"plugins.huggingface(token={token})"
        return f"plugins.huggingface(models={list(self.models)!r}, token={token})"

    def transform(self, image: Any, cluster: Any) -> Any:
        """Add transformers, datasets and tokenizers to the image; with models, a setup
        step of the environment build that fetches them (with the token, if given)."""
        if not self.models:
            return extend(image, pip=PACKAGES)
        from .._redaction import Secret  # (client side: the node's plugin never needs it)

        env: dict[str, Any] = {"HF_XET_HIGH_PERFORMANCE": "1"}
        if self.token is not None:  # the build's download needs it (never shown)
            env["HF_TOKEN"] = Secret(self.token)
        image = extend(image, pip=(*PACKAGES, "huggingface_hub"), env=env)
        code = DOWNLOAD.format(repos=json.dumps(list(self.models)))
        fetch = f'"${{FLOTILLA_PYTHON:-python3}}" -c {shlex.quote(code)}'
        return dataclasses.replace(image, setup=(*image.setup, fetch))

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[None] | None:
        """Set ``HF_TOKEN`` in the process environment (if a token was given)."""
        if self.token is None:
            return None
        return environ({"HF_TOKEN": self.token})


def make(models: Sequence[str] | None, token: str | None) -> HuggingfacePlugin:
    """The plugin for :func:`flotilla.plugins.huggingface`'s arguments (checked)."""
    if isinstance(models, str):
        raise ConfigurationError(
            "plugins.huggingface(models=...) takes a list of repository ids, got the string "
            f"{'(a token?) ' if models.startswith('hf_') else ''}{models[:3]!r}...: pass "
            "models=[...], and the access token as token=..."
        )
    try:
        listed = tuple(models or ())
    except TypeError:
        raise ConfigurationError(
            f"plugins.huggingface(models=...) takes a list of repository ids, got {models!r}"
        ) from None
    return HuggingfacePlugin(token, listed)
