"""``--provider runpod``: RunPod GPU pods rented for the cluster and terminated by
``flotilla down`` (see ``flotilla._providers.runpod``).

A task file chooses it with ``resources: infra: runpod`` (``runpod/EU-RO-1`` for a data
center); its ``accelerators`` select the GPU types, ``use_spot`` interruptible pods,
``disk_size`` the container disk, ``image_id`` the image, ``region`` the data centers. The
API key is never a flag nor kept in the cluster's state: it comes from
``RUNPOD_API_KEY`` or the official client's ``~/.runpod/config.toml``, as for the library.

``flotilla stop`` stops the pods (``podStop``: their volume disk, ``config: {runpod:
{volume_gb: N}}``, stays; their container disk is wiped) and ``flotilla start`` resumes the
same pods (see ``flotilla._providers.runpod.stopstart``); interruptible pods are never
stopped, so ``stop`` and ``--autostop`` without ``--down`` are refused for spot clusters.
"""

from __future__ import annotations

from ..._providers.runpod.settings import RunPodSettings
from .base import RentedBackend, RentedSpec, rented_spec


class RunPodBackend(RentedBackend[RentedSpec]):
    spec_type = rented_spec("runpod", where="data_centers")
    summary = "RunPod GPU pods rented for the cluster, terminated by `flotilla down`"
    settings_type = RunPodSettings
    hint_reason = "RunPod's pods have no such setting flotilla knows of"
    infra = ("runpod",)
    package = "runpod"
    provider_name = "RunPod"
    removes = ("would terminate", "terminated")
    orphan_kinds = (("pod(s)", "pods"),)
    ssh_config = False  # `flotilla ssh` only: no ssh_config blocks
    stop_note = ""  # podStop keeps the volume disk; podResume starts the same pods
    stoppable = True


BACKEND = RunPodBackend()
