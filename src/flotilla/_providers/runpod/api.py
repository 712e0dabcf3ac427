"""RunPod's APIs, spoken as the official client ``runpod`` speaks them (standard library
only: no extra dependency), through the cloud kit's JSON client (``cloud/rest.py``).

Followed from ``runpod/runpod-python`` (1.12.0 and the repository's api/rest.py):

* the key: ``RUNPOD_API_KEY`` (the official CLI's ``runpod config`` variable), else the
  ``api_key`` of the ``[default]`` profile of ``~/.runpod/config.toml``
  (cli/groups/config/functions.py); sent as ``Authorization: Bearer``
  (api/graphql.py);
* GraphQL at ``$RUNPOD_API_BASE_URL/graphql`` (default ``https://api.runpod.io``): the
  GPU types and their prices (queries/gpus.py), the account (``myself``); an answer
  with ``errors`` is an error (``run_graphql_query``);
* REST v1 at ``$RUNPOD_REST_API_BASE_URL`` (default: ``$RUNPOD_API_BASE_URL/v1`` when
  that is set, ``https://rest.runpod.io/v1`` otherwise): ``POST /pods`` (the one call
  that takes ``globalNetworking``), ``GET /pods``, ``GET /pods/{id}``,
  ``DELETE /pods/{id}``.
"""

from __future__ import annotations

import os
import tomllib
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError
from ..cloud.rest import ApiError, RestApi, credential, find_key

if TYPE_CHECKING:
    from .settings import RunPodSettings

DEFAULT_URL = "https://api.runpod.io"
DEFAULT_REST_URL = "https://rest.runpod.io/v1"
KEY_ENV = "RUNPOD_API_KEY"
URL_ENV = "RUNPOD_API_BASE_URL"
REST_ENV = "RUNPOD_REST_API_BASE_URL"
CONFIG_FILE = "~/.runpod/config.toml"
NO_CAPACITY = ("no longer any instances available", "not enough free", "no available")
"""Words of RunPod's answers that mean "no capacity there now"."""


def config_key() -> str:
    """The ``[default]`` profile's ``api_key`` of the official CLI's configuration."""
    try:
        with open(os.path.expanduser(CONFIG_FILE), "rb") as f:
            found = tomllib.load(f).get("default", {}).get("api_key", "")
    except (OSError, tomllib.TOMLDecodeError):
        return ""
    return str(found or "")


def find(api_key: str | None) -> tuple[str, str]:
    """(the key, where it came from); ("", what was tried) when there is none."""
    key, source = find_key(api_key, "RunPod(api_key=...)", (KEY_ENV,))
    if key:
        return key, source
    from_file = config_key()
    if from_file:
        return from_file, CONFIG_FILE
    return "", f"{source}, {CONFIG_FILE}"


def urls(url: str | None, rest_url: str | None) -> tuple[str, str]:
    """(GraphQL base, REST v1 base), as the official client finds them."""
    base = (url or os.environ.get(URL_ENV, "").strip() or "").rstrip("/")
    rest = (rest_url or os.environ.get(REST_ENV, "").strip()).rstrip("/")
    if not rest:
        rest = f"{base}/v1" if base else DEFAULT_REST_URL
    return base or DEFAULT_URL, rest


def capacity(status: int, code: str, message: str) -> bool:
    return any(words in message.lower() for words in NO_CAPACITY)


class RunPodApi:
    """Calls to RunPod's GraphQL and REST APIs with one key."""

    def __init__(self, key: str, source: str, url: str, rest_url: str) -> None:
        self.graph = RestApi("RunPod API", url, key, source, capacity=capacity)
        self.rest = RestApi("RunPod REST API", rest_url, key, source, capacity=capacity)

    @property
    def url(self) -> str:
        return self.graph.url

    def __repr__(self) -> str:
        return f"RunPodApi(url={self.graph.url!r}, rest={self.rest.url!r})"

    def query(self, text: str, what: str, variables: dict[str, Any] | None = None) -> Any:
        """The ``data`` of a GraphQL document; ApiError with its first error's message."""
        answer = self.graph.call(
            "POST", "/graphql", what, {"query": text, "variables": variables or {}}
        )
        errors = answer.get("errors") if isinstance(answer, dict) else None
        if errors:
            raise self.graph.error(what, 400, answer)
        return (answer or {}).get("data") or {}

    def call(self, method: str, path: str, what: str, body: Any = None) -> Any:
        return self.rest.call(method, path, what, body)

    def delete(self, path: str, what: str) -> None:
        self.rest.delete(path, what)


__all__ = ["ApiError", "ConfigurationError", "RunPodApi", "find", "urls"]


def connect(settings: RunPodSettings) -> RunPodApi:
    """The API client of ``settings`` (``RunPod.api``); a ConfigurationError when no key
    is found."""
    fix = "pass RunPod(api_key=...), set RUNPOD_API_KEY, or run `runpod config`"
    key, source = credential(find(settings.api_key), "RunPod API key", fix)
    return RunPodApi(key, source, *urls(settings.url, settings.rest_url))
