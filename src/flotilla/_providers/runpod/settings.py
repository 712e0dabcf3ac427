"""The RunPod provider's settings: one frozen object, checked when made (before anything is
rented), that the provider and its allocations read. Skyward's ``RunPod`` fields, where
they mean something to flotilla (``cloud_type``, ``data_center_ids`` as
``data_centers``, ``container_disk_gb`` as ``disk_gb``, ``container_image`` as ``image``,
``global_networking``, ``request_timeout``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..._errors import ConfigurationError, check_number
from ..options import MARKET_OF_TASK, MARKETS, From, check_rented, option

CLOUD_TYPES = ("secure", "community", "all")


def _centers(text: str) -> tuple[str, ...]:
    """A task file's ``infra: runpod/EU-RO-1,US-TX-3`` or ``region`` as data center ids."""
    return tuple(c.strip().upper() for c in str(text).split(",") if c.strip())


@dataclass(frozen=True)
class RunPodSettings:
    """How the RunPod provider rents a pool's pods.

    Attributes:
        api_key: the account's API key (default: ``RUNPOD_API_KEY``, else the official
            client's ``~/.runpod/config.toml``). Never shown.
        url: the API's base URL (default: ``RUNPOD_API_BASE_URL``, else
            ``https://api.runpod.io``): GraphQL at ``{url}/graphql``.
        rest_url: REST API v1's base URL (default: ``RUNPOD_REST_API_BASE_URL``, else
            ``{url}/v1`` when ``url`` is given, else ``https://rest.runpod.io/v1``).
        image: the container image (it needs sshd and Python >= 3.11; RunPod's
            ``runpod/pytorch`` images have both).
        cloud_type: ``"secure"`` (RunPod's data centers), ``"community"`` (hosts of the
            community, cheaper) or ``"all"`` (secure first, then community).
        allocation: ``"on-demand"``, ``"spot"`` (interruptible pods, at the bid price:
            RunPod stops them when outbid; flotilla replaces the node) or
            ``"spot-if-available"``. A task file follows SkyPilot: ``use_spot: true``.
        data_centers: data center ids to try, in order (``"EU-RO-1"``); a capacity error
            moves to the next; empty: RunPod chooses. A task file's ``infra:
            runpod/EU-RO-1`` or ``region``.
        disk_gb: the container disk per pod in GB (wiped when a pod stops).
        volume_gb: a volume disk per pod in GB (0: none), at ``volume_mount_path``: what
            a stopped pod keeps (``flotilla stop``), billed while it is stopped.
        volume_mount_path: where the volume disk is in the pods.
        global_networking: put the pods on RunPod's global network, where they reach
            each other at ``{pod id}.runpod.internal`` (the nodes' addresses); a pool of
            several nodes needs it.
        ttl: seconds after the last contact from the client when a pod terminates itself
            (through RunPod's API, with the key RunPod gives that pod only): the bound on
            what a dead client costs. A pod whose agent never starts does it
            ``max(ttl, start_timeout)`` s after its start.
        workdir: folder in the pods for flotilla's files.
        python: interpreter in the pods (default: ``python3``).
        connect_timeout: seconds for one SSH connection attempt.
        request_timeout: seconds for one API request.
    """

    api_key: str | None = option(None, secret=True)
    url: str | None = None
    rest_url: str | None = None
    image: str = option("runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04", task="image_id")
    cloud_type: str = option("secure", choices=CLOUD_TYPES)
    allocation: str = option("on-demand", choices=MARKETS, task=MARKET_OF_TASK)
    data_centers: Sequence[str] = option((), task=From(("infra", "region"), _centers))
    disk_gb: float = option(50.0, task="disk_size")
    volume_gb: float = 0.0
    volume_mount_path: str = "/workspace"
    global_networking: bool = True
    ttl: float = 600.0
    workdir: str = "/root/.flotilla"
    python: str | None = None
    connect_timeout: float = 10.0
    request_timeout: float = 30.0

    def __post_init__(self) -> None:
        check_rented(self, "RunPod", "a container image name")
        if self.cloud_type not in CLOUD_TYPES:
            raise ConfigurationError(
                f"RunPod(cloud_type={self.cloud_type!r}): one of {', '.join(CLOUD_TYPES)}"
            )
        if self.allocation not in MARKETS:
            raise ConfigurationError(
                f"RunPod(allocation={self.allocation!r}): one of {', '.join(MARKETS)}"
            )
        disk = self.disk_gb
        check_number(disk, f"RunPod(disk_gb={disk!r}): a positive number of GB", above=0)
        volume = self.volume_gb
        check_number(volume, f"RunPod(volume_gb={volume!r}): a number of GB >= 0", at_least=0)
        if not isinstance(self.volume_mount_path, str) or not self.volume_mount_path.startswith(
            "/"
        ):
            raise ConfigurationError(
                f"RunPod(volume_mount_path={self.volume_mount_path!r}): an absolute folder"
            )
        centers = self.data_centers
        centers = _centers(centers) if isinstance(centers, str) else tuple(centers)
        for c in centers:
            if not isinstance(c, str) or not c.replace("-", "").isalnum():
                raise ConfigurationError(
                    f"RunPod(data_centers=[{c!r}]): data center ids such as 'EU-RO-1'"
                )
        object.__setattr__(self, "data_centers", tuple(c.upper() for c in centers))
        object.__setattr__(self, "disk_gb", float(disk))
