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

The key is never shown: not in ``repr``, not in errors.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..retry import retried

DEFAULT_URL = "https://console.vast.ai"
KEY_ENV = "VAST_API_KEY"
URL_ENV = "VAST_URL"
TIMEOUT = 30.0


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


class VastApiError(ProvisionError):
    """An API call failed; ``status`` is the HTTP status (0: no answer), ``error`` Vast's
    error code (``no_such_ask``...)."""

    def __init__(self, message: str, status: int, error: str, cause: ProvisionCause | None) -> None:
        super().__init__(message, cause=cause)
        self.status = status
        self.error = error


class VastApi:
    """Calls to one Vast API with one key."""

    def __init__(self, key: str, url: str) -> None:
        self._key = key
        self.url = url
        self.calls = 0

    def __repr__(self) -> str:
        return f"VastApi(url={self.url!r})"

    def call(self, method: str, path: str, what: str, body: Any = None, **query: str) -> Any:
        """``method`` ``/api/v0{path}`` with the JSON ``body``; the decoded answer.
        VastApiError (a ProvisionError) saying ``what`` failed; ConfigurationError when
        the key is refused."""
        url = f"{self.url}/api/v0{path}"
        if query:
            url += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self._key}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"

        def once() -> Any:
            self.calls += 1
            req = urllib.request.Request(url, data=data, method=method, headers=headers)
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                raw = resp.read()
            return json.loads(raw) if raw else {}

        try:  # 5xx, 429, timeouts and resets: tried again (``retry``)
            return retried(once, f"Vast API ({self.url}): {what}")
        except urllib.error.HTTPError as e:
            raise self._error(what, e.code, e.read()) from None
        except (OSError, ValueError) as e:
            raise VastApiError(
                f"Vast API ({self.url}): cannot {what}: {_plain(str(e), self._key)}",
                0,
                "",
                ProvisionCause.UNREACHABLE,
            ) from None

    def _error(self, what: str, status: int, raw: bytes) -> Exception:
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        error = str(answer.get("error", "") or "")
        msg = str(
            answer.get("msg", "") or answer.get("error", "") or raw[:200].decode(errors="replace")
        )
        msg = _plain(msg, self._key)
        if status in (401, 403):
            return ConfigurationError(
                f"Vast API ({self.url}) refused the API key ({status}: {msg}) when asked to "
                f"{what}: check VastAI(api_key=...), {KEY_ENV} or `vastai set api-key`"
            )
        return VastApiError(
            f"Vast API: cannot {what} ({status}{', ' + error if error else ''}: {msg})",
            status,
            error,
            None,
        )


def _plain(text: str, key: str) -> str:
    """``text`` without the key in it."""
    return text.replace(key, "***") if key else text
