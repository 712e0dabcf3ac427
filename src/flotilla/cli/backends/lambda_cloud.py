"""``--provider lambda``: Lambda Cloud GPU instances launched for the cluster and
terminated by ``flotilla down`` (see ``flotilla._providers.lambda_cloud``).

A task file chooses it with ``resources: infra: lambda`` or ``lambda/<region>``; its
``accelerators`` select the instance types (``instance_type`` names one). The API key is
never a flag nor kept in the cluster's state: it comes from ``LAMBDA_API_KEY``, as for the
library.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._providers.lambda_cloud.settings import LambdaSettings
from .base import RentedBackend, ResourceSpec


@dataclass(frozen=True)
class LambdaSpec(ResourceSpec):
    """Lambda Cloud instances (settings: ``LambdaSettings``); the task's resources (see
    :class:`ResourceSpec`) select the instance types."""

    kind = "lambda"

    def describe(self) -> str:
        region = self.value("region", None)
        return "lambda" + (f" ({region})" if region else "")


class LambdaBackend(RentedBackend[LambdaSpec]):
    spec_type = LambdaSpec
    summary = "Lambda Cloud GPU instances launched for the cluster, terminated by `flotilla down`"
    settings_type = LambdaSettings
    hint_reason = "Lambda's instance types have no such setting flotilla knows of"
    infra = ("lambda", "lambda_cloud", "lambdalabs")
    package = "lambda_cloud"
    provider_name = "LambdaCloud"
    removes = ("would terminate", "terminated")
    ssh_config = False  # `flotilla ssh` only: no ssh_config blocks


BACKEND = LambdaBackend()
