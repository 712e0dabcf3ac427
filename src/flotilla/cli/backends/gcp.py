"""``--provider gcp``: Compute Engine instances created for the cluster and deleted by
``flotilla down`` (see ``flotilla._providers.gcp``).

A task file chooses it with ``resources: infra: gcp``, ``gcp/<region>`` or
``gcp/<region>/<zone>``; its ``accelerators``, ``cpus`` and ``memory`` choose the machine,
``instance_type`` names one, ``use_spot`` asks for SPOT instances, ``disk_size`` and
``image_id`` set the boot disk. Credentials are Google's Application Default Credentials
(``GOOGLE_APPLICATION_CREDENTIALS``...), never a flag nor kept in the cluster's state.

``flotilla stop`` stops the instances (``instances.stop``: the boot disk stays, only it is
billed) and ``flotilla start`` (or the next ``launch``) starts the same ones again (see
``flotilla._providers.cloud.stopstart``); SPOT instances are never stopped, so ``stop``
and ``--autostop`` without ``--down`` are refused for SPOT clusters.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._providers.gcp.settings import GCPSettings
from .base import RentedBackend, RentedSpec


@dataclass(frozen=True)
class GCPSpec(RentedSpec):
    """Compute Engine instances (settings: ``GCPSettings``)."""

    kind = "gcp"

    def describe(self) -> str:
        where = self.value("zone") or self.value("region", "us-central1")
        market = self.value("allocation", "on-demand")
        return f"gcp ({where}{'' if market == 'on-demand' else ', ' + market})"


class GCPBackend(RentedBackend[GCPSpec]):
    spec_type = GCPSpec
    summary = "Compute Engine instances created for the cluster, deleted by `flotilla down`"
    settings_type = GCPSettings
    honours = frozenset({"cpus", "memory"})
    hint_reason = "Compute Engine has no such setting flotilla knows of"
    infra = ("gcp",)
    package = "gcp"
    provider_name = "GCP"
    removes = ("would delete", "deleted")
    stop_note = ""  # instances.stop keeps the boot disk; instances.start boots it again
    stoppable = True


BACKEND = GCPBackend()
