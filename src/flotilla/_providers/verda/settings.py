"""The Verda provider's settings: one frozen object, checked when made (before anything is
rented). Skyward's ``Verda`` fields (``region``, ``client_id``, ``client_secret``,
``image``, ``cuda``, ``request_timeout``) and what flotilla needs besides."""

from __future__ import annotations

from dataclasses import dataclass

from ..._errors import ConfigurationError
from ..cloud.market import check_self_ending
from ..options import MARKET_OF_TASK, MARKETS, From, option


@dataclass(frozen=True)
class VerdaSettings:
    """How the Verda provider rents a pool's instances.

    Attributes:
        client_id: the API client's id (default: ``VERDA_CLIENT_ID``). A credential: no
            command-line flag, not shown.
        client_secret: its secret (default: ``VERDA_CLIENT_SECRET``). Never shown.
        url: the API's base URL (default: ``VERDA_BASE_URL``, else
            ``https://api.verda.com/v1``).
        region: the location to try first ("FIN-01"); the others with room follow.
            None: every location with room. A task file's ``infra: verda/FIN-01``.
        instance_type: the instance type ("1A100.22V"); None: the cheapest that has the
            pool's accelerator.
        image: the OS image, verbatim; None: ``ubuntu-24.04-cuda-{cuda}-open`` (GPU
            types) or ``ubuntu-24.04``.
        cuda: the CUDA version of the default image.
        allocation: ``"on-demand"``, ``"spot"`` (Verda's spot instances, at the spot price;
            Verda may take them back) or ``"spot-if-available"`` (spot where a location has
            room, else on-demand). A task file's ``use_spot``.
        ssh_user: the image's login user (Verda's images: root).
        ttl: seconds after the last contact from the client when an instance deletes itself
            through Verda's API. Verda has no credential scoped to one instance: the
            instance gets ``ttl_client_id``/``ttl_client_secret`` (default: the pool's) in
            a root-only file, which it uses only to delete itself. An instance whose agent
            never starts does it ``max(ttl, start_timeout)`` s after its boot.
        ttl_client_id: the API client an instance deletes itself with (make a second one
            in Verda's console to revoke it apart).
        ttl_client_secret: its secret. Never shown.
        workdir: folder on the instances for flotilla's files (under the login user's
            home when relative).
        python: interpreter on the instances (default: ``python3``).
        connect_timeout: seconds for one SSH connection attempt.
        request_timeout: seconds for one API request.
    """

    client_id: str | None = option(None, secret=True)
    client_secret: str | None = option(None, secret=True)
    url: str | None = None
    region: str | None = option(None, flag="--verda-region", task=From(("infra", "region")))
    instance_type: str | None = option(None, task="instance_type")
    image: str | None = option(None, task="image_id")
    cuda: str = "13.0"
    allocation: str = option("on-demand", choices=MARKETS, task=MARKET_OF_TASK)
    ssh_user: str = "root"
    ttl: float = 600.0
    ttl_client_id: str | None = option(None, secret=True)
    ttl_client_secret: str | None = option(None, secret=True)
    workdir: str = ".flotilla"
    python: str | None = None
    connect_timeout: float = 10.0
    request_timeout: float = 30.0

    def __post_init__(self) -> None:
        check_self_ending(
            self,
            "Verda",
            ("client_id", "client_secret", "ttl_client_id", "ttl_client_secret"),
            "a location code such as 'FIN-01'",
        )
        if (self.ttl_client_id is None) != (self.ttl_client_secret is None):
            raise ConfigurationError(
                "Verda(ttl_client_id=..., ttl_client_secret=...): give both or neither"
            )
        if self.allocation not in MARKETS:
            raise ConfigurationError(
                f"Verda(allocation={self.allocation!r}): one of {', '.join(MARKETS)}"
            )
