"""``--provider lambda``: Lambda Cloud GPU instances launched for the cluster and
terminated by ``flotilla down`` (see ``flotilla._providers.lambda_cloud``).

A task file chooses it with ``resources: infra: lambda`` or ``lambda/<region>``; its
``accelerators`` select the instance types (``instance_type`` names one). The API key is
never a flag nor kept in the cluster's state: it comes from ``LAMBDA_API_KEY``, as for the
library.
"""

from __future__ import annotations

from ..._providers.lambda_cloud.settings import LambdaSettings
from .base import RentedBackend, RentedSpec, rented_spec


class LambdaBackend(RentedBackend[RentedSpec]):
    spec_type = rented_spec("lambda", where="region")
    summary = "Lambda Cloud GPU instances launched for the cluster, terminated by `flotilla down`"
    settings_type = LambdaSettings
    hint_reason = "Lambda's instance types have no such setting flotilla knows of"
    infra = ("lambda", "lambda_cloud", "lambdalabs")
    package = "lambda_cloud"
    provider_name = "LambdaCloud"
    removes = ("would terminate", "terminated")
    ssh_config = False  # `flotilla ssh` only: no ssh_config blocks


BACKEND = LambdaBackend()
