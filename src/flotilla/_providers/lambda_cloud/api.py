"""Lambda Cloud's REST API (``https://cloud.lambda.ai/api/v1``, its published OpenAPI
specification), through the cloud kit's JSON client (``cloud/rest.py``): the key from
``LAMBDA_API_KEY`` (as Lambda's documentation and Skyward read it) sent as
``Authorization: Bearer``; answers ``{"data": ...}``, errors ``{"error": {"code",
"message", "suggestion"}}`` (``global/invalid-api-key`` a 401;
``instance-operations/launch/insufficient-capacity`` when a region has no room).

Calls: ``GET /instance-types`` (each type's ``instance_type`` {``name``,
``description``, ``gpu_description``, ``price_cents_per_hour``, ``specs``} and its
``regions_with_capacity_available``), ``POST /instance-operations/launch`` (``region_name
instance_type_name ssh_key_names quantity name user_data``), ``GET /instances``,
``GET /instances/{id}`` (``id name ip private_ip status region``),
``POST /instance-operations/terminate`` (``instance_ids``), ``GET/POST /ssh-keys``,
``DELETE /ssh-keys/{id}``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..cloud.rest import RestApi, credential, find_key

if TYPE_CHECKING:
    from .settings import LambdaSettings

DEFAULT_URL = "https://cloud.lambda.ai/api/v1"
KEY_ENV = "LAMBDA_API_KEY"
URL_ENV = "LAMBDA_API_URL"


def find(api_key: str | None) -> tuple[str, str]:
    return find_key(api_key, "LambdaCloud(api_key=...)", (KEY_ENV,))


def base_url(url: str | None) -> str:
    return (url or os.environ.get(URL_ENV, "").strip() or DEFAULT_URL).rstrip("/")


def capacity(status: int, code: str, message: str) -> bool:
    return "insufficient-capacity" in code or "capacity" in message.lower()


def connect(settings: LambdaSettings) -> RestApi:
    """The API client of ``settings`` (``LambdaCloud.api``); a ConfigurationError when no
    key is found."""
    fix = "pass LambdaCloud(api_key=...) or set LAMBDA_API_KEY"
    key, source = credential(find(settings.api_key), "Lambda Cloud API key", fix)
    return RestApi("Lambda Cloud API", base_url(settings.url), key, source, capacity=capacity)


def data(answer: Any) -> Any:
    return answer.get("data") if isinstance(answer, dict) else None
