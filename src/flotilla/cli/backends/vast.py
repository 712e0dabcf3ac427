"""``--provider vast``: Vast.ai instances rented for the cluster and destroyed by ``flotilla
down`` (see ``flotilla._providers.vast``).

A task file chooses it with ``resources: infra: vast``; its ``accelerators``, ``cpus``,
``memory`` and ``disk_size`` select the offers, ``image_id`` the Docker image, ``region``
the country codes. The API key is never a flag nor kept in the cluster's state: it comes
from ``VAST_API_KEY`` or the official CLI's key file, as for the library.
"""

from __future__ import annotations

from ..._providers.vast.settings import VastSettings
from .base import RentedBackend, RentedSpec, rented_spec


class VastBackend(RentedBackend[RentedSpec]):
    spec_type = rented_spec("vast", where="regions")
    summary = "Vast.ai instances rented for the cluster, destroyed by `flotilla down`"
    settings_type = VastSettings
    honours = frozenset({"cpus", "memory"})
    hint_reason = "Vast's offers have no such setting flotilla knows of"
    infra = ("vast", "vastai")
    package = "vast"
    provider_name = "VastAI"


BACKEND = VastBackend()
