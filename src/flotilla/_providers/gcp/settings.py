"""The GCP provider's settings: one frozen object, checked when made (before anything is
rented), that the provider and its allocations read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..._errors import ConfigurationError, check_number
from ..options import MARKET_OF_TASK, MARKETS, From, option

ZONE = re.compile(r"[a-z]+-[a-z]+[0-9]+-[a-z]")
REGION = re.compile(r"[a-z]+-[a-z]+[0-9]+")


def _infra_region(text: Any) -> str:
    """``us-central1`` of a task file's ``gcp/us-central1[/us-central1-a]``."""
    return str(text).split("/")[0]


def _infra_zone(text: Any) -> str | None:
    """``us-central1-a`` of a task file's ``gcp/us-central1/us-central1-a`` (a zone given
    alone, ``gcp/us-central1-a``, too); None when it names a region only."""
    parts = str(text).split("/")
    if len(parts) > 1:
        return parts[1] or None
    return parts[0] if ZONE.fullmatch(parts[0]) else None


@dataclass(frozen=True)
class GCPSettings:
    """How the GCP provider rents a pool's Compute Engine instances.

    Attributes:
        project: the project (default: ``GOOGLE_CLOUD_PROJECT``, else
            ``CLOUDSDK_CORE_PROJECT``, else the credentials' own project).
        zone: the one zone to use (default: every zone of ``region`` that has the machine
            type, in turn: a zone out of capacity moves the pool to the next).
        region: the region whose zones are tried when no ``zone`` is given.
        network: the VPC network the instances share (their internal addresses reach each
            other there; the network's firewall must let the client reach port 22 and the
            instances each other, as the default network's rules do).
        subnet: the subnetwork (default: the network's own in the region, auto mode).
        machine_type: the machine type (default: the one that carries the pool's
            accelerators: a2/a3/g2 families, n1 with attached T4/V100/P100/P4; for no
            accelerator the smallest n2-standard that fits vcpus and memory).
        allocation: ``"on-demand"``, ``"spot"`` (SPOT instances: cheaper, deleted when
            preempted, which the node notices and the pool replaces) or
            ``"spot-if-available"`` (SPOT in every zone first, then on-demand).
        disk_size_gb: boot disk size in GB.
        disk_type: boot disk type (``pd-balanced``, ``pd-ssd``, ``pd-standard``).
        image: the boot image (default: a Deep Learning VM image with CUDA for a GPU pool,
            Ubuntu 24.04 otherwise).
        service_account: the instances' service account (default: the project's default
            compute service account), with the compute scope: the instance deletes itself
            with it (its ``ttl``).
        credentials_file: a service-account key file or gcloud's ADC file (default:
            Application Default Credentials, ``GOOGLE_APPLICATION_CREDENTIALS`` first).
        api_endpoint: the Compute API's base URL (default:
            ``CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE``, gcloud's override, else Google's).
        ssh_user: the login the pool's SSH key is given to (through the ``ssh-keys``
            metadata, which the guest agent turns into a sudoer).
        ttl: seconds after the last contact from the client when an instance deletes
            itself (through the Compute API with its service account's token): the bound
            on what a dead client costs. An instance whose agent never starts does it
            ``max(ttl, start_timeout)`` s after its boot (the startup script's guard).
        workdir: folder on the instances for flotilla's files.
        python: interpreter on the instances (default: ``python3``, or one of the client's
            minor version found there).
        connect_timeout: seconds for one SSH connection attempt.
    """

    project: str | None = None
    zone: str | None = option(None, task=From(("infra", "zone"), _infra_zone))
    region: str = option("us-central1", task=From(("infra", "region"), _infra_region))
    network: str = "default"
    subnet: str | None = None
    machine_type: str | None = option(None, task="instance_type")
    allocation: str = option("on-demand", choices=MARKETS, task=MARKET_OF_TASK)
    disk_size_gb: float = option(200.0, task="disk_size")
    disk_type: str = "pd-balanced"
    image: str | None = option(None, task="image_id")
    service_account: str | None = None
    credentials_file: str | None = None
    api_endpoint: str | None = None
    ssh_user: str = "flotilla"
    ttl: float = 600.0
    workdir: str = "~/.flotilla"
    python: str | None = None
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.zone is not None and not ZONE.fullmatch(str(self.zone)):
            raise ConfigurationError(
                f"GCP(zone={self.zone!r}): a Compute Engine zone such as 'us-central1-a'"
            )
        if not REGION.fullmatch(str(self.region)):
            raise ConfigurationError(
                f"GCP(region={self.region!r}): a Compute Engine region such as 'us-central1'"
            )
        if self.zone is not None and not str(self.zone).startswith(self.region + "-"):
            object.__setattr__(self, "region", str(self.zone).rsplit("-", 1)[0])
        if self.allocation not in MARKETS:
            raise ConfigurationError(
                f"GCP(allocation={self.allocation!r}): one of {', '.join(MARKETS)}"
            )
        disk, ttl = self.disk_size_gb, self.ttl
        check_number(disk, f"GCP(disk_size_gb={disk!r}): a positive number of GB", above=0)
        check_number(ttl, f"GCP(ttl={ttl!r}): a positive number of seconds", above=0)
        if not re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}", str(self.ssh_user)):
            raise ConfigurationError(f"GCP(ssh_user={self.ssh_user!r}): a login name")
        if not isinstance(self.workdir, str) or not self.workdir.startswith(("/", "~")):
            raise ConfigurationError(
                f"GCP(workdir={self.workdir!r}): an absolute folder, or one under ~"
            )
        endpoint = self.api_endpoint
        if endpoint is not None and not re.fullmatch(r"https?://[^/\s]+(/.*)?", endpoint):
            raise ConfigurationError(
                f"GCP(api_endpoint={endpoint!r}): a URL such as https://compute.googleapis.com"
            )
        object.__setattr__(self, "ttl", float(ttl))
        object.__setattr__(self, "disk_size_gb", float(disk))
        object.__setattr__(self, "connect_timeout", float(self.connect_timeout))
