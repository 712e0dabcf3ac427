"""``--provider verda``: Verda GPU instances created for the cluster and deleted by
``flotilla down`` (see ``flotilla._providers.verda``).

A task file chooses it with ``resources: infra: verda`` or ``verda/<location>``; its
``accelerators`` select the instance types (``instance_type`` names one), ``use_spot``
Verda's spot instances. The client credentials are never flags nor kept in the cluster's
state: they come from ``VERDA_CLIENT_ID``/``VERDA_CLIENT_SECRET``, as for the library.
"""

from __future__ import annotations

from ..._providers.verda.settings import VerdaSettings
from .base import RentedBackend, RentedSpec, rented_spec


class VerdaBackend(RentedBackend[RentedSpec]):
    spec_type = rented_spec("verda", where="region")
    summary = "Verda GPU instances created for the cluster, deleted by `flotilla down`"
    settings_type = VerdaSettings
    hint_reason = "Verda's instance types have no such setting flotilla knows of"
    infra = ("verda", "datacrunch")
    package = "verda"
    provider_name = "Verda"
    removes = ("would delete", "deleted")
    ssh_config = False  # `flotilla ssh` only: no ssh_config blocks


BACKEND = VerdaBackend()
