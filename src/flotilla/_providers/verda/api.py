"""Verda's REST API (``https://api.verda.com/v1``, as its official Python client ``verda``
1.25 calls it), through the cloud kit's JSON client (``cloud/rest.py``).

Credentials: an OAuth2 client id and secret (``VERDA_CLIENT_ID``, ``VERDA_CLIENT_SECRET``,
as Skyward reads them), exchanged at ``POST /oauth2/token`` (JSON ``{"grant_type":
"client_credentials", "client_id", "client_secret"}``) for an access token (``access_token
refresh_token expires_in``) sent as ``Authorization: Bearer``; a token near its end is
fetched again. Errors: ``{"code", "message"}`` (``unauthorized_request`` a 401,
``invalid_request``...); no room for a type in a location is a 400 or 503 whose message
says it is not available (``capacity``).

Calls: ``GET /instance-types`` (``instance_type price_per_hour spot_price
gpu{description number_of_gpus} gpu_memory cpu memory``), ``GET /instance-availability``
(``?isSpot=``; ``[{"location_code", "availabilities": [type...]}]``), ``POST /instances``
(``instance_type image ssh_key_ids startup_script_id hostname description location_code
is_spot``; answers the new id as plain text), ``GET /instances``, ``GET /instances/{id}``
(``id hostname description status ip location is_spot price_per_hour``), ``PUT
/instances`` (``{"id": [...], "action": "delete"}``), ``GET/POST /sshkeys``, ``DELETE
/sshkeys/{id}``, ``POST /scripts``, ``DELETE /scripts/{id}``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError
from ..cloud.rest import RestApi, credential

if TYPE_CHECKING:
    from .settings import VerdaSettings

DEFAULT_URL = "https://api.verda.com/v1"
ID_ENV = "VERDA_CLIENT_ID"
SECRET_ENV = "VERDA_CLIENT_SECRET"
URL_ENV = "VERDA_BASE_URL"
SOURCE = f"{ID_ENV}/{SECRET_ENV}"


def find(client_id: str | None, client_secret: str | None) -> tuple[str, str, str]:
    """(client id, secret, where they came from); empty strings when either is missing."""
    if client_id and client_secret:
        return client_id, client_secret, "Verda(client_id=..., client_secret=...)"
    ident = client_id or os.environ.get(ID_ENV, "").strip()
    secret = client_secret or os.environ.get(SECRET_ENV, "").strip()
    if ident and secret:
        return ident, secret, SOURCE
    return "", "", SOURCE


def base_url(url: str | None) -> str:
    return (url or os.environ.get(URL_ENV, "").strip() or DEFAULT_URL).rstrip("/")


def capacity(status: int, code: str, message: str) -> bool:
    text = message.lower()
    return status in (400, 503) and ("not available" in text or "capacity" in text)


def _error_code(answer: Any) -> tuple[str, str]:
    if isinstance(answer, dict):
        return str(answer.get("code") or ""), str(answer.get("message") or answer)
    return "", str(answer)[:200]


class VerdaApi(RestApi):
    """Calls to Verda's API with one client id and secret (never shown): an access token
    fetched on first use and again before it ends (or once when a call is refused)."""

    def __init__(self, client_id: str, secret: str, source: str, url: str) -> None:
        super().__init__(
            "Verda API", url, secret, source, error_code=_error_code, capacity=capacity
        )
        self._client_id = client_id
        self._token = ""
        self._expires = 0.0
        self._token_lock = threading.Lock()

    def plain(self, text: str) -> str:
        text = super().plain(text)
        return text.replace(self._token, "***") if self._token else text

    def authorization(self) -> str:
        with self._token_lock:
            if not self._token or time.monotonic() > self._expires - 30:
                answer = self.call(
                    "POST",
                    "/oauth2/token",
                    "get an access token",
                    {
                        "grant_type": "client_credentials",
                        "client_id": self._client_id,
                        "client_secret": self._key,
                    },
                    auth=False,
                )
                token = answer.get("access_token") if isinstance(answer, dict) else None
                if not token:
                    raise ConfigurationError(
                        f"Verda API ({self.url}) gave no access token for the client "
                        f"credentials from {self.source}"
                    )
                self._token = str(token)
                self._expires = time.monotonic() + float(answer.get("expires_in") or 3600)
            return f"Bearer {self._token}"

    def renew(self) -> bool:
        """A refused token (revoked, or ended early) is forgotten and fetched once more."""
        if not self._token:
            return False
        with self._token_lock:
            self._token = ""
        return True

    def decode(self, raw: bytes) -> Any:
        """JSON, or the plain text some calls answer (a new instance's, key's or script's
        id, maybe in quotes)."""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace").strip().strip('"')


def connect(settings: VerdaSettings) -> VerdaApi:
    """The API client of ``settings`` (``Verda.api``); a ConfigurationError when no
    client credentials are found."""
    ident, secret, source = find(settings.client_id, settings.client_secret)
    fix = f"pass Verda(client_id=..., client_secret=...) or set {ID_ENV} and {SECRET_ENV}"
    credential((ident, SOURCE), "Verda API credentials", fix)
    return VerdaApi(ident, secret, source, base_url(settings.url))
