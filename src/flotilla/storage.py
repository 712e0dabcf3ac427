"""``sky.Storage``: an S3-compatible object store, from the client (Skyward's ``Storage``):
upload a dataset before a pool starts, download what its nodes wrote after.

    with sky.Storage(endpoint="https://s3.us-east-1.amazonaws.com") as s:   # or a preset:
        s.upload("my-bucket", "data/iris.csv", key="iris.csv")             # sky.storage.S3()
        s.ls("my-bucket")                                                  # ["iris.csv"]
        s.download("my-bucket", "model.pkl", "out/model.pkl")
        s.exists("my-bucket", "model.pkl"); s.rm("my-bucket", "old/")      # a key or prefix

Requests are signed with SigV4 by the standard-library client that volumes use on nodes
(``_system/s3.py``); no SDK is needed. Credentials: given (a string, or a callable
returning one, possibly async), else ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
(and ``AWS_SESSION_TOKEN``), else boto3's chain when boto3 is installed. The presets
(``S3``, ``R2``, ``GCS``, ``Wasabi``, ``Backblaze``, ``Hyperstack``) fill in the endpoint;
``Hyperstack()`` without keys creates a short-lived one through Hyperstack's API, as
Skyward's does.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeAlias

from ._errors import ConfigurationError, FlotillaError
from ._system.s3 import S3 as _Client
from ._system.s3 import S3Error

Credential: TypeAlias = str | Callable[[], str | Awaitable[str]]


class StorageError(FlotillaError):
    """An object store request failed (``status``: the HTTP status, 0 when none came)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Storage:
    """An S3-compatible endpoint (see the module docstring).

    Attributes:
        endpoint: the service's URL (None: AWS S3 in ``region``).
        access_key: access key id (a string or a callable giving one; None: from the
            environment).
        secret_key: secret access key, as ``access_key``.
        path_style: Skyward's: path-style addressing. flotilla always addresses a given
            endpoint path-style (``endpoint/bucket/key``), which every S3-compatible
            service accepts.
        region: the signing region.
    """

    endpoint: str | None = None
    access_key: Credential | None = None
    secret_key: Credential | None = None
    path_style: bool = False
    region: str = "us-east-1"
    _open: list[_Client] = field(default_factory=list, init=False, repr=False, compare=False)
    _on_close: list[Callable[[], None]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )  # run when the `with` block ends (a preset's short-lived key is deleted)

    def __post_init__(self) -> None:
        if self.endpoint is not None and not (
            isinstance(self.endpoint, str) and self.endpoint.startswith(("http://", "https://"))
        ):
            raise ConfigurationError(
                f"Storage(endpoint=...) must be an http(s) URL, got {self.endpoint!r}"
            )
        if not isinstance(self.region, str) or not self.region:
            raise ConfigurationError(f"Storage(region=...) must name a region: {self.region!r}")

    def __repr__(self) -> str:  # credentials are never shown
        return f"Storage(endpoint={self.endpoint!r}, region={self.region!r})"

    # -- session ----------------------------------------------------------------------------
    def __enter__(self) -> Storage:
        self._client()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open.clear()
        for close in self._on_close:
            close()

    def _client(self) -> _Client:
        if not self._open:
            key, secret, token = _credentials(self.access_key, self.secret_key)
            creds = {"access_key": key, "secret_key": secret, "token": token}
            self._open.append(_Client(creds, self.region, self.endpoint))
        return self._open[0]

    # -- operations ---------------------------------------------------------------------
    def upload(self, bucket: str, local_path: str | Path, *, key: str | None = None) -> None:
        """Put a file (at ``key``, default its name) or a folder's files (under ``key``,
        default the folder's name) into ``bucket``."""
        path = Path(local_path)
        if not path.exists():
            raise FileNotFoundError(f"Storage.upload: {path} not found")
        s3 = self._client()
        if path.is_file():
            _call(s3.upload, bucket, key or path.name, str(path))
            return
        base = key.rstrip("/") if key else path.name
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            _call(s3.upload, bucket, f"{base}/{file.relative_to(path).as_posix()}", str(file))

    def download(self, bucket: str, key: str, local_path: str | Path) -> None:
        """The object ``key`` into ``local_path`` (its folders made)."""
        path = Path(local_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _call(self._client().download, bucket, key, str(path))

    def ls(self, bucket: str, prefix: str = "") -> list[str]:
        """The keys under ``prefix``."""
        return [k for k, _ in _call(lambda: list(self._client().list(bucket, prefix)))]

    def exists(self, bucket: str, key: str) -> bool:
        """Whether the object ``key`` exists."""
        try:
            self._client().request("HEAD", bucket, key).close()
        except S3Error as e:
            if e.status == 404:
                return False
            raise StorageError(str(e), e.status) from None
        return True

    def rm(self, bucket: str, key: str) -> None:
        """Remove the object ``key``, or every object under the prefix ``key``."""
        s3 = self._client()
        keys = [key] if self.exists(bucket, key) else self.ls(bucket, key)
        for k in keys:
            _call(lambda k=k: s3.request("DELETE", bucket, k).close())


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except S3Error as e:
        raise StorageError(str(e), e.status) from None


def _resolve(value: Credential | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    got = value()
    if inspect.isawaitable(got):
        got = asyncio.run(_await(got))
    if not isinstance(got, str):
        raise ConfigurationError(f"a Storage credential callable returned {type(got).__name__}")
    return got


async def _await(value: Awaitable[str]) -> str:
    return await value


def _credentials(access: Credential | None, secret: Credential | None) -> tuple[str, str, str]:
    key, sec = _resolve(access), _resolve(secret)
    if key and sec:
        return key, sec, ""
    env_key, env_secret = (
        os.environ.get("AWS_ACCESS_KEY_ID"),
        os.environ.get("AWS_SECRET_ACCESS_KEY"),
    )
    if env_key and env_secret:
        return env_key, env_secret, os.environ.get("AWS_SESSION_TOKEN", "")
    try:
        import boto3
    except ImportError:
        boto3 = None
    creds = boto3.Session().get_credentials() if boto3 is not None else None
    if creds is None:
        raise ConfigurationError(
            "Storage needs credentials: give access_key and secret_key, or set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    frozen = creds.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token or ""


# -- presets (Skyward's) ----------------------------------------------------------------------
def S3(
    *,
    region: str = "us-east-1",
    access_key: Credential | None = None,
    secret_key: Credential | None = None,
) -> Storage:
    """Amazon S3 in ``region`` (credentials: from the environment when not given)."""
    return Storage(f"https://s3.{region}.amazonaws.com", access_key, secret_key, region=region)


def R2(*, account_id: str, access_key: Credential, secret_key: Credential) -> Storage:
    """Cloudflare R2."""
    url = f"https://{account_id}.r2.cloudflarestorage.com"
    return Storage(url, access_key, secret_key, region="auto")


def GCS(*, access_key: Credential, secret_key: Credential) -> Storage:
    """Google Cloud Storage's S3 interoperability (HMAC keys)."""
    return Storage("https://storage.googleapis.com", access_key, secret_key, region="auto")


def Wasabi(*, region: str = "us-east-1", access_key: Credential, secret_key: Credential) -> Storage:
    """Wasabi."""
    url = f"https://s3.{region}.wasabisys.com"
    return Storage(url, access_key, secret_key, region=region)


def Backblaze(*, region: str, key_id: Credential, app_key: Credential) -> Storage:
    """Backblaze B2's S3-compatible API (``region`` e.g. "us-west-004")."""
    url = f"https://s3.{region}.backblazeb2.com"
    return Storage(url, key_id, app_key, region=region)


HYPERSTACK_API = "https://infrahub-api.nexgencloud.com/v1"
"""Hyperstack's InfraHub API (where Skyward's preset creates its keys)."""


def Hyperstack(
    *,
    access_key: Credential | None = None,
    secret_key: Credential | None = None,
    api_key: str | None = None,
    region: str = "CANADA-1",
    endpoint: str = "https://ca1.obj.nexgencloud.io",
    api_url: str = HYPERSTACK_API,
) -> Storage:
    """Hyperstack object storage (default: its CANADA-1 endpoint).

    Without ``access_key`` and ``secret_key``, as Skyward's preset: an object storage
    access key for ``region`` is created through Hyperstack's API (``api_key``, else
    ``HYPERSTACK_API_KEY``; ``POST {api_url}/object-storage/access-keys``) the first time
    the storage is used (a ``with`` block, an operation, a pool's volumes), and deleted when
    the storage's ``with`` block ends, or at the latest when this process exits. A pool's
    volumes use it while the pool runs: close the storage after the pool."""
    if (access_key is None) != (secret_key is None):
        raise ConfigurationError(
            "sky.storage.Hyperstack: give access_key and secret_key together, or neither "
            "(then a short-lived key is created with your Hyperstack API key)"
        )
    if access_key is not None:
        return Storage(endpoint, access_key, secret_key, path_style=True)
    key = api_key or os.environ.get("HYPERSTACK_API_KEY", "")
    if not isinstance(key, str) or not key:
        raise ConfigurationError(
            "sky.storage.Hyperstack() needs access_key= and secret_key=, or a Hyperstack API "
            "key to create short-lived ones: api_key= or the HYPERSTACK_API_KEY variable"
        )
    if not isinstance(region, str) or not region:
        raise ConfigurationError(f"sky.storage.Hyperstack(region=...) must name one: {region!r}")
    keys = _HyperstackKeys(key, region, api_url)
    storage = Storage(endpoint, keys.access_key, keys.secret_key, path_style=True)
    storage._on_close.append(keys.delete)
    return storage


class _HyperstackKeys:
    """One short-lived object storage access key, made and deleted through Hyperstack's
    API (its ``api_key`` header); standard library only."""

    def __init__(self, api_key: str, region: str, api_url: str) -> None:
        self._api_key = api_key
        self.region = region
        self.url = api_url.rstrip("/")
        self._made: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the API key
        return f"<Hyperstack access key for {self.region}>"

    def access_key(self) -> str:
        return str(self._key()["access_key"])

    def secret_key(self) -> str:
        return str(self._key()["secret_key"])

    def _key(self) -> dict[str, Any]:
        with self._lock:
            if self._made is None:
                made = self._request(
                    "POST", "/object-storage/access-keys", {"region": self.region}, "create"
                )
                if not (isinstance(made, dict) and {"id", "access_key", "secret_key"} <= set(made)):
                    raise StorageError(
                        "Hyperstack's API answered the access key's creation without "
                        "id, access_key and secret_key"
                    )
                self._made = made
                atexit.register(self.delete)
            return self._made

    def delete(self) -> None:
        """Delete the key, if one was made (once)."""
        with self._lock:
            made, self._made = self._made, None
        if made is None:
            return
        atexit.unregister(self.delete)
        self._request("DELETE", f"/object-storage/access-keys/{made['id']}", None, "delete")

    def _request(self, method: str, path: str, body: Any, what: str) -> Any:
        import json
        import urllib.error
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        headers = {"api_key": self._api_key, "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                text = answer.read()
        except urllib.error.HTTPError as e:
            said = e.read()[:300].decode(errors="replace")
            raise StorageError(
                f"Hyperstack's API refused to {what} an object storage access key "
                f"(HTTP {e.code}): {said}",
                e.code,
            ) from None
        except OSError as e:
            raise StorageError(f"Hyperstack's API at {self.url} cannot be reached: {e}") from None
        return json.loads(text) if text else None


__all__ = [
    "GCS",
    "R2",
    "S3",
    "Backblaze",
    "Credential",
    "Hyperstack",
    "Storage",
    "StorageError",
    "Wasabi",
]
