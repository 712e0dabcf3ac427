"""The AWS provider's access to the EC2, SSM and Price List APIs: clients, error translation,
call counts.

boto3 is an optional extra (``pip install flotilla[aws]``): it is imported here only, when
an AWS pool is validated or started, so ``import flotilla`` stays light. Every call goes
through :class:`Api`, which counts calls per operation (the benchmark reports them), tries
transient errors again (``_providers/retry.py``, as every provider) and translates
botocore's errors into flotilla's, root cause first.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from ..._errors import ConfigurationError, ProvisionError
from ..retry import retried

CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
        "SpotMaxPriceTooLow",
        "Unsupported",  # the type is not offered in this zone (now)
    }
)
"""RunInstances errors that another zone (or market) may not have."""
SPOT_QUOTA_CODES = frozenset({"MaxSpotInstanceCountExceeded"})
"""Spot-only limits: on-demand may still work (``allocation="spot-if-available"``)."""
QUOTA_CODES = frozenset(
    {"VcpuLimitExceeded", "InstanceLimitExceeded", "InsufficientAddressCapacity"}
)
CREDENTIAL_CODES = frozenset(
    {
        "AuthFailure",
        "UnauthorizedOperation",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "RequestExpired",
        "UnrecognizedClientException",
        "OptInRequired",
    }
)
CONFIGURE_CREDENTIALS = (
    "configure them with `aws configure` (or `aws sso login`), set AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass AWS(profile=...)"
)

INFORMATIVE = frozenset({"pricing"})
"""Services whose answers are shown but not needed (prices): no retries, short timeouts."""

calls: Counter[str] = Counter()
"""API calls this process made, by operation name (e.g. ``ec2.RunInstances``)."""
_calls_lock = threading.Lock()


def boto3_module() -> Any:
    """The boto3 module, or a ConfigurationError saying how to install it."""
    try:
        import boto3
    except ImportError:
        raise ConfigurationError(
            "the AWS provider needs boto3, which is not installed: pip install 'flotilla[aws]'"
        ) from None
    return boto3


def error_code(e: BaseException) -> str:
    """The AWS error code of a botocore ClientError ("" for anything else)."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def error_message(e: BaseException) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Message", "")) or str(e)
    return str(e)


def translate(e: BaseException, what: str) -> Exception:
    """A flotilla error for a boto3/botocore error raised while doing ``what``."""
    from botocore import exceptions as bx

    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return ConfigurationError(f"no AWS credentials found ({e}): {CONFIGURE_CREDENTIALS}")
    if isinstance(e, bx.ProfileNotFound):
        return ConfigurationError(f"{e}: pass AWS(profile=...) naming a profile of ~/.aws/config")
    if isinstance(e, bx.EndpointConnectionError | bx.ConnectTimeoutError):
        return ProvisionError(f"cannot reach the AWS API while trying to {what}: {e}")
    code, message = error_code(e), error_message(e)
    if code in CREDENTIAL_CODES:
        return ConfigurationError(
            f"AWS refused the credentials or their permissions ({code}: {message}) while "
            f"trying to {what}: check them, or {CONFIGURE_CREDENTIALS}"
        )
    if code in QUOTA_CODES:
        return ProvisionError(
            f"AWS quota reached ({code}: {message}) while trying to {what}: lower nodes=, "
            "choose a smaller instance type, or ask for a higher limit in the Service Quotas "
            "console (EC2: 'Running On-Demand ... instances' / 'All ... Spot Instance Requests')"
        )
    if code.startswith("InvalidAMIID"):
        return ConfigurationError(f"bad AMI ({code}: {message}): pass AWS(ami=...) naming an AMI")
    if code:
        return ProvisionError(f"AWS error {code} while trying to {what}: {message}")
    return ProvisionError(f"AWS error while trying to {what}: {type(e).__name__}: {e}")


class Api:
    """The clients (EC2, SSM, Price List) of one region and profile, created on first use.

    Attributes:
        region: the region every call goes to.
        profile: the AWS profile (None: the default credential chain).
    """

    def __init__(self, region: str | None, profile: str | None) -> None:
        boto3 = boto3_module()
        from botocore import exceptions as bx

        try:
            self.session = boto3.Session(profile_name=profile, region_name=region)
        except bx.ProfileNotFound as e:
            raise translate(e, "open the AWS profile") from None
        self.profile = profile
        self.region: str = region or self.session.region_name or ""
        self._clients: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def check(self) -> None:
        """Refuse a missing region or credentials, without any network call."""
        if not self.region:
            raise ConfigurationError(
                "no AWS region given: pass AWS(region='us-east-1'), set AWS_DEFAULT_REGION, "
                "or set a region in ~/.aws/config"
            )
        known = set(self.session.get_available_regions("ec2"))
        for partition in ("aws-us-gov", "aws-cn"):
            known |= set(self.session.get_available_regions("ec2", partition))
        if known and self.region not in known:
            raise ConfigurationError(
                f"AWS region {self.region!r} does not exist: pass one of "
                f"{', '.join(sorted(known))} (a region newer than this botocore needs "
                "`pip install -U boto3`)"
            )
        if self.session.get_credentials() is None:
            raise ConfigurationError(f"no AWS credentials found: {CONFIGURE_CREDENTIALS}")

    @property
    def place(self) -> str:
        """Where this API's instances live: the region and the EC2 endpoint (another
        account's or emulator's endpoint is another place; see ``orphans.remove_orphans``)."""
        return f"{self.region} {self.client('ec2').meta.endpoint_url}"

    def client(self, service: str, region: str | None = None) -> Any:
        """The ``service`` client of the pool's region (or of ``region``), made once."""
        region = region or self.region
        with self._lock:
            client = self._clients.get((service, region))
            if client is None:
                from botocore.config import Config

                if service in INFORMATIVE:  # one quick try: nothing waits on a retry
                    config = Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=3)
                else:  # transient errors are retried by call() and raw() (``retry``)
                    config = Config(retries={"max_attempts": 1})
                client = self.session.client(service, region_name=region, config=config)
                client.meta.events.register("before-call", _count)
                self._clients[(service, region)] = client
            return client

    def call(self, service: str, operation: str, what: str, **params: Any) -> Any:
        """``client.operation(**params)``; errors translated (see :func:`translate`)."""
        try:
            return self.raw(service, operation, **params)
        except Exception as e:
            if _is_boto_error(e):
                raise translate(e, what) from e
            raise

    def raw(self, service: str, operation: str, region: str | None = None, **params: Any) -> Any:
        """``client.operation(**params)`` with botocore's errors as they are (callers that
        branch on the error code); ``region``: another region's endpoint. Transient errors
        (throttling, 5xx, timeouts, dropped connections) are tried again with backoff
        (``retry``), except for informative services (prices), tried once; a create
        tried again carries the same idempotency token (``ClientToken``)."""
        client = self.client(service, region)
        if service in INFORMATIVE:
            return getattr(client, operation)(**params)
        return retried(lambda: getattr(client, operation)(**params), f"AWS {operation}")


def _count(model: Any, **_: Any) -> None:
    name = f"{model.service_model.endpoint_prefix}.{model.name}"
    with _calls_lock:
        calls[name] += 1


def _is_boto_error(e: BaseException) -> bool:
    module = type(e).__module__
    return module.startswith(("botocore", "boto3"))
