"""Vast.ai's REST API, spoken as the official client ``vastai`` speaks it (standard library
only: no extra dependency).

Followed from ``vast-ai/vast-python``'s ``vast.py`` (commit b25bd95):

* the base URL: ``server_url_default = "https://console.vast.ai"`` (line 59), and every
  endpoint is ``{url}/api/v0{path}`` (``apiurl``, 367-409);
* the key: sent as ``Authorization: Bearer KEY`` (``apiheaders``, 411-420; this client
  never puts it in the URL, where proxies and logs would keep it); read from
  ``VAST_API_KEY`` or the CLI's key file ``$XDG_CONFIG_HOME/vastai/vast_api_key``
  (``APIKEY_FILE``, 101), or the legacy ``~/.vast_api_key`` (102);
* JSON bodies on GET/POST/PUT/DELETE (``http_get``/``http_put``/``http_post``/
  ``http_del``, 173-218); the official client retries a 429, flotilla every transient
  error (5xx, 429, timeouts, resets: ``_providers/retry.py``, as every provider).

Spoken by the cloud kit's ``cloud/rest.py`` (as RunPod's and Lambda's APIs): the key is
never shown (not in ``repr``, not in errors).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..cloud.rest import ApiError, RestApi, credential

if TYPE_CHECKING:
    from .settings import VastSettings

DEFAULT_URL = "https://console.vast.ai"
KEY_ENV = "VAST_API_KEY"
URL_ENV = "VAST_URL"


def key_files() -> list[str]:
    """Where the official CLI keeps the key, in the order it reads them."""
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return [os.path.join(config, "vastai", "vast_api_key"), os.path.expanduser("~/.vast_api_key")]


def find_key(api_key: str | None) -> tuple[str, str]:
    """(the key, where it came from): ``api_key``, else ``VAST_API_KEY``, else the CLI's
    key file; ("", what was tried) when there is none."""
    if api_key:
        return api_key, "VastAI(api_key=...)"
    env = os.environ.get(KEY_ENV, "").strip()
    if env:
        return env, KEY_ENV
    for path in key_files():
        try:
            with open(path) as f:
                key = f.read().strip()
        except OSError:
            continue
        if key:
            return key, path
    return "", f"VastAI(api_key=...), {KEY_ENV}, {', '.join(key_files())}"


def find_url(url: str | None) -> str:
    return (url or os.environ.get(URL_ENV, "").strip() or DEFAULT_URL).rstrip("/")


class VastApiError(ApiError):
    """An API call failed; ``status`` is the HTTP status (0: no answer), ``error`` (also
    ``code``) Vast's error code (``no_such_ask``...)."""

    @property
    def error(self) -> str:
        return self.code


def _error_code(answer: Any) -> tuple[str, str]:
    """(code, message) of a Vast error answer: ``{"error": "no_such_ask", "msg": ...}``."""
    if not isinstance(answer, dict):
        return "", str(answer)[:200]
    error = str(answer.get("error", "") or "")
    return error, str(answer.get("msg", "") or answer.get("message", "") or error)


class VastApi:
    """Calls to one Vast API (``url``, without ``/api/v0``) with one key (from
    ``source``)."""

    def __init__(self, key: str, url: str, source: str = "VastAI(api_key=...)") -> None:
        self.rest = RestApi("Vast API", url, key, source, _error_code, error_type=VastApiError)

    @property
    def url(self) -> str:
        return self.rest.url

    def __repr__(self) -> str:
        return f"VastApi(url={self.url!r})"

    def call(self, method: str, path: str, what: str, body: Any = None, **query: str) -> Any:
        """``method`` ``/api/v0{path}`` with the JSON ``body`` and the ``query``; the
        decoded answer. VastApiError (a ProvisionError) saying ``what`` failed;
        ConfigurationError when the key is refused."""
        return self.rest.call(method, f"/api/v0{path}", what, body, query or None)

    def delete(self, path: str, what: str, body: Any = None) -> None:
        """``DELETE`` ``/api/v0{path}``; one already gone (404) is no error."""
        self.rest.delete(f"/api/v0{path}", what, body)


def connect(settings: VastSettings) -> VastApi:
    """The API client of ``settings`` (``VastAI.api``); a ConfigurationError when no key is
    found."""
    fix = "pass VastAI(api_key=...), set VAST_API_KEY, or run `vastai set api-key KEY`"
    key, source = credential(find_key(settings.api_key), "Vast API key", fix)
    return VastApi(key, find_url(settings.url), source)
