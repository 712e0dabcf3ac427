"""The Lambda Cloud provider's settings: one frozen object, checked when made (before
anything is rented). Skyward's ``LambdaCloud`` fields (``api_key``, ``region``,
``request_timeout``) and what flotilla needs besides."""

from __future__ import annotations

from dataclasses import dataclass

from ..cloud.market import check_self_ending
from ..options import From, option


@dataclass(frozen=True)
class LambdaSettings:
    """How the Lambda Cloud provider rents a pool's instances.

    Attributes:
        api_key: the account's API key (default: ``LAMBDA_API_KEY``). Never shown.
        url: the API's base URL (default: ``LAMBDA_API_URL``, else
            ``https://cloud.lambda.ai/api/v1``).
        region: the region ("us-east-1"); None: the first (cheapest type first) with
            capacity. A task file's ``infra: lambda/us-east-1`` or ``region``.
        instance_type: the instance type ("gpu_8x_h100_sxm5"); None: the cheapest that
            has the pool's accelerator.
        ssh_user: the image's login user.
        ttl: seconds after the last contact from the client when an instance terminates
            itself through Lambda's API. Lambda has no credential scoped to one instance:
            the instance gets ``ttl_api_key`` (default: the account's key) in a root-only
            file, which it uses only to terminate itself. An instance whose agent never
            starts does it ``max(ttl, start_timeout)`` s after its boot.
        ttl_api_key: the key an instance terminates itself with (create a second key in
            Lambda's console to revoke it apart). Never shown.
        workdir: folder on the instances for flotilla's files (under the login user's
            home when relative).
        python: interpreter on the instances (default: ``python3``).
        connect_timeout: seconds for one SSH connection attempt.
        request_timeout: seconds for one API request.
    """

    api_key: str | None = option(None, secret=True)
    url: str | None = None
    region: str | None = option(None, flag="--lambda-region", task=From(("infra", "region")))
    instance_type: str | None = option(None, task="instance_type")
    ssh_user: str = "ubuntu"
    ttl: float = 600.0
    ttl_api_key: str | None = option(None, secret=True)
    workdir: str = ".flotilla"
    python: str | None = None
    connect_timeout: float = 10.0
    request_timeout: float = 30.0

    def __post_init__(self) -> None:
        check_self_ending(
            self, "LambdaCloud", ("api_key", "ttl_api_key"), "a region name such as 'us-east-1'"
        )
