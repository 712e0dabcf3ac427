"""The Compute Engine API, through Google's official client ``google-cloud-compute`` (REST
transport; the ``gcp`` extra: ``pip install 'flotilla[gcp]'``), with the credentials, project
and endpoint that Google's own tools use:

* credentials: Application Default Credentials (``google.auth.default``): the file named
  by ``GOOGLE_APPLICATION_CREDENTIALS`` (a service-account key, whose ``token_uri`` is where
  its tokens come from, or gcloud's ADC file), else gcloud's
  ``~/.config/gcloud/application_default_credentials.json``, else the metadata server;
  ``GCP(credentials_file=...)`` names a file instead. The compute scope only.
* the project: ``GCP(project=...)``, ``GOOGLE_CLOUD_PROJECT``, ``CLOUDSDK_CORE_PROJECT``, or
  the credentials' own (a service-account key's ``project_id``);
* the endpoint: ``GCP(api_endpoint=...)``, else gcloud's override
  ``CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE`` (``https://HOST/compute/v1/``: its scheme and
  host are the client's ``api_endpoint``), else Google's.

Inserts and deletes use the ``*_unary`` calls, whose answer is the operation itself, and
wait for it with a ``ZoneOperationsClient`` made with the same client options: the
``ExtendedOperation`` that ``insert()`` returns polls Google's own endpoint whatever
``api_endpoint`` says. Transient errors (5xx, 429, a connection reset) are tried again
(``retry``); refused credentials are a ConfigurationError naming where they came from,
raised by :meth:`GcpApi.check` before anything is rented.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..retry import TRANSIENT_STATUS, retried, transient
from .settings import GCPSettings

T = TypeVar("T")

SCOPE = "https://www.googleapis.com/auth/compute"
CREDENTIALS_ENV = "GOOGLE_APPLICATION_CREDENTIALS"
PROJECT_ENVS = ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT")
ENDPOINT_ENV = "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE"
DEFAULT_ENDPOINT = "https://compute.googleapis.com"
CAPACITY_CODES = frozenset(
    {
        "ZONE_RESOURCE_POOL_EXHAUSTED",
        "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
        "RESOURCE_POOL_EXHAUSTED",
    }
)
"""Operation error codes of a zone out of capacity: the pool moves to the next zone."""
QUOTA_CODES = frozenset({"QUOTA_EXCEEDED", "IP_SPACE_EXHAUSTED"})
"""Operation error codes of a project out of quota in the region: the next candidate."""


def configured() -> bool:
    """Whether this machine has GCP credentials (a key file named by
    ``GOOGLE_APPLICATION_CREDENTIALS``, or gcloud's ADC file) and Google's client: the
    market then asks GCP too. Nothing is sent."""
    import importlib.util

    path = os.environ.get(CREDENTIALS_ENV, "").strip() or os.path.join(
        os.environ.get("CLOUDSDK_CONFIG", "") or os.path.expanduser("~/.config/gcloud"),
        "application_default_credentials.json",
    )
    try:
        found = importlib.util.find_spec("google.cloud.compute_v1") is not None
    except ImportError:
        found = False
    return found and os.path.isfile(path)


def endpoint(settings: GCPSettings) -> str | None:
    """The client's ``api_endpoint`` (scheme and host; None: Google's)."""
    given = settings.api_endpoint or os.environ.get(ENDPOINT_ENV, "").strip()
    if not given:
        return None
    scheme, sep, rest = given.partition("://")
    if not sep:
        return given.rstrip("/")
    return f"{scheme}://{rest.split('/')[0]}"


def base_url(settings: GCPSettings) -> str:
    """Where an instance reaches the Compute API (its self-deletion)."""
    return endpoint(settings) or DEFAULT_ENDPOINT


class GcpApiError(ProvisionError):
    """A Compute API call or operation failed; ``status`` is the HTTP status (0: an
    operation's error), ``codes`` the operation's error codes."""

    def __init__(
        self, message: str, status: int, codes: tuple[str, ...], cause: ProvisionCause | None
    ) -> None:
        super().__init__(message, cause=cause)
        self.status = status
        self.codes = codes


class GcpApi:
    """The official client's calls for one project, credentials and endpoint."""

    def __init__(self, settings: GCPSettings) -> None:
        self.settings = settings
        self.endpoint = endpoint(settings)
        self._credentials: Any = None
        self._project = ""
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.source = (settings.credentials_file and "GCP(credentials_file=...)") or ""

    @property
    def url(self) -> str:
        """The Compute API's endpoint."""
        return base_url(self.settings)

    def __repr__(self) -> str:
        return f"GcpApi(project={self._project or self.settings.project!r})"

    # -- credentials, project, clients ------------------------------------------------
    def _load(self) -> None:
        if self._credentials is not None:
            return
        try:
            import google.auth
            import google.auth.exceptions
        except ImportError:
            raise ConfigurationError(
                "the GCP provider needs Google's client: pip install 'flotilla[gcp]' "
                "(google-cloud-compute)"
            ) from None
        path = self.settings.credentials_file
        file = path or os.environ.get(CREDENTIALS_ENV, "")
        self.source = (
            "GCP(credentials_file=...)"
            if path
            else f"{CREDENTIALS_ENV}={file}"
            if file
            else "Application Default Credentials (gcloud auth application-default login)"
        )
        try:
            if path:
                credentials, found = google.auth.load_credentials_from_file(  # type: ignore[no-untyped-call]
                    path, scopes=[SCOPE]
                )
            else:
                credentials, found = google.auth.default(scopes=[SCOPE])
        except google.auth.exceptions.DefaultCredentialsError as e:
            raise ConfigurationError(
                f"no usable GCP credentials ({self.source}): {e}; set {CREDENTIALS_ENV} to a "
                "service-account key file, run `gcloud auth application-default login`, or "
                "pass GCP(credentials_file=...)"
            ) from None
        project = self.settings.project or next(
            (os.environ[v].strip() for v in PROJECT_ENVS if os.environ.get(v, "").strip()), ""
        )
        project = project or str(found or "")
        if not project:
            raise ConfigurationError(
                f"no GCP project: pass GCP(project=...) or set {' or '.join(PROJECT_ENVS)}"
            )
        self._project, self._credentials = project, credentials

    @property
    def project(self) -> str:
        with self._lock:
            self._load()
        return self._project

    def client(self, kind: str) -> Any:
        """The official client ``compute_v1.{kind}`` (``InstancesClient``...), REST, made
        once, with the credentials and endpoint."""
        with self._lock:
            self._load()
            if kind not in self._clients:
                from google.api_core.client_options import ClientOptions
                from google.cloud import compute_v1

                options = ClientOptions(api_endpoint=self.endpoint) if self.endpoint else None
                self._clients[kind] = getattr(compute_v1, kind)(
                    credentials=self._credentials, client_options=options, transport="rest"
                )
            return self._clients[kind]

    # -- calls ------------------------------------------------------------------------
    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` (one or more of the official client's calls), transient errors tried
        again; ConfigurationError when the credentials are refused, GcpApiError
        (a ProvisionError) saying ``what`` failed otherwise."""
        from google.api_core import exceptions as core
        from google.auth import exceptions as auth

        try:
            return retried(fn, f"GCP: {what}", is_transient=_transient)
        except auth.RefreshError as e:
            raise self._refused(what, str(e)) from None
        except (core.Unauthorized, core.Forbidden) as e:
            raise self._refused(what, _message(e)) from None
        except core.GoogleAPICallError as e:
            status = int(e.code or 0)
            raise GcpApiError(
                f"GCP: cannot {what} ({status}: {_message(e)})",
                status,
                (),
                ProvisionCause.UNREACHABLE if status in TRANSIENT_STATUS else None,
            ) from None
        except (OSError, ValueError) as e:  # no answer (requests' errors are OSErrors)
            raise GcpApiError(
                f"GCP ({self.endpoint or DEFAULT_ENDPOINT}): cannot {what}: {e}",
                0,
                (),
                ProvisionCause.UNREACHABLE,
            ) from None

    def _refused(self, what: str, said: str) -> ConfigurationError:
        return ConfigurationError(
            f"GCP refused the credentials ({self.source}) when asked to {what}: {said}; check "
            f"{CREDENTIALS_ENV} (a service-account key file) or `gcloud auth "
            "application-default login`, and the account's roles in the project"
        )

    def check(self) -> str:
        """Refresh the credentials' token and list the project's zones: a description,
        or ConfigurationError naming where the credentials came from."""
        from google.auth.transport.requests import Request

        project = self.project
        self.call("get an access token", lambda: self._credentials.refresh(Request()))
        zones = self.call(
            "list the project's zones",
            lambda: list(self.client("ZonesClient").list(project=project)),
        )
        return (
            f"credentials accepted ({self.source}); project {project}, {len(zones)} zone(s) at "
            f"{self.endpoint or DEFAULT_ENDPOINT}"
        )

    def wait(self, zone: str, operation: Any, what: str, deadline: float) -> Any:
        """Wait for the zone operation ``operation`` (from a ``*_unary`` call) to be DONE,
        through ``ZoneOperationsClient.wait`` at the same endpoint; GcpApiError with its
        error codes when it failed (cause CAPACITY for a zone or project out of them)."""
        from google.cloud import compute_v1

        ops = self.client("ZoneOperationsClient")
        op = operation
        while op.status != compute_v1.Operation.Status.DONE:
            if time.monotonic() > deadline:
                raise GcpApiError(
                    f"GCP: {what}: operation {op.name} not done in time",
                    0,
                    (),
                    ProvisionCause.TIMEOUT,
                )
            op = self.call(
                f"wait for {what}",
                lambda: ops.wait(project=self.project, zone=zone, operation=operation.name),
            )
        errors = list(op.error.errors) if op.error and op.error.errors else []
        if errors:
            codes = tuple(str(e.code) for e in errors)
            said = "; ".join(f"{e.code}: {e.message}" for e in errors)
            capacity = bool(set(codes) & (CAPACITY_CODES | QUOTA_CODES))
            raise GcpApiError(
                f"GCP: cannot {what} in {zone} ({said})",
                int(op.http_error_status_code or 0),
                codes,
                ProvisionCause.CAPACITY if capacity else None,
            )
        return op


def _transient(e: BaseException) -> bool:
    code = getattr(e, "code", None)
    if isinstance(code, int) and type(e).__module__.startswith("google.api_core"):
        return code in TRANSIENT_STATUS
    return transient(e)


def _message(e: Any) -> str:
    return str(getattr(e, "message", "") or e)
