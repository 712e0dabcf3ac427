"""The Vast.ai provider's settings: one frozen object, checked when made (before anything
is rented), that the provider and its allocations read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..._errors import ConfigurationError, check_number
from ..options import From, check_rented, option


def _countries(text: str) -> tuple[str, ...]:
    """A task file's ``region`` (``"US,CA"``) as country codes."""
    return tuple(r.strip().upper() for r in text.split(",") if r.strip())


@dataclass(frozen=True)
class VastSettings:
    """How the Vast.ai provider rents a pool's instances.

    Attributes:
        api_key: the account's API key (default: ``VAST_API_KEY``, else the official
            CLI's key file, ``~/.config/vastai/vast_api_key``). Never shown.
        url: the API's base URL (default: ``VAST_URL``, else ``https://console.vast.ai``).
        image: the Docker image the instances run (it needs sshd, which Vast's ssh launch
            mode provides, and Python >= 3.11 for the agent).
        disk_gb: disk per instance in GB.
        min_reliability: offers of machines less reliable than this (0-1) are ignored.
        regions: two-letter country codes the machines must be in (Vast's
            ``geolocation``); empty: anywhere.
        ttl: seconds after the last contact from the client when an instance destroys
            itself (through Vast's API, with the key Vast gives that instance only): the
            bound on what a dead client costs. An instance whose agent never starts does
            it ``max(ttl, start_timeout)`` s after its start (the guard of its on-start
            script).
        workdir: folder on the instances for flotilla's files.
        python: interpreter on the instances (default: ``python3``, or one of the client's
            minor version found there).
        connect_timeout: seconds for one SSH connection attempt.
    """

    api_key: str | None = option(None, secret=True)
    url: str | None = None
    image: str = option("pytorch/pytorch:latest", task="image_id")
    disk_gb: float = option(20.0, task="disk_size")
    min_reliability: float = 0.9
    regions: Sequence[str] = option((), task=From(("infra", "region"), _countries))
    ttl: float = 600.0
    workdir: str = "/root/.flotilla"
    python: str | None = None
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        check_rented(self, "VastAI", "a Docker image name")
        disk, rel = self.disk_gb, self.min_reliability
        check_number(disk, f"VastAI(disk_gb={disk!r}): a positive number of GB", above=0)
        check_number(
            rel, f"VastAI(min_reliability={rel!r}): a number in 0-1", at_least=0, at_most=1
        )
        regions = (self.regions,) if isinstance(self.regions, str) else tuple(self.regions)
        for r in regions:
            if not isinstance(r, str) or len(r) != 2 or not r.isalpha():
                raise ConfigurationError(
                    f"VastAI(regions=[{r!r}]): two-letter country codes such as 'US', 'SE'"
                )
        object.__setattr__(self, "regions", tuple(r.upper() for r in regions))
        object.__setattr__(self, "disk_gb", float(disk))
        object.__setattr__(self, "min_reliability", float(rel))
