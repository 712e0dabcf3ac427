"""Agents on EC2 instances: their watchdog's settings, interruption notices.

An instance is an SSH host whose host key the client generated (``cloud.keys``): the
agent starts through ``ssh`` as on any cloud instance (``cloud.allocation``, the client's
exact flotilla shipped by content hash), with the pool's login key and known_hosts, once
the instance answers on port 22; spot interruption notices come on its stderr, taken out
by the cloud kit's ``watch_notices`` (``cloud/notice.py``), which GCP shares.
"""

from __future__ import annotations

import json
from typing import Any

from ..._wire.protocol import CLOUD_ENV
from ..cloud.guard import contact_path
from .settings import EFA_ENV, AWSSettings

IMDS = "http://169.254.169.254"


def cloud_env(
    settings: AWSSettings, ident: str, instance: dict[str, Any], efa: bool
) -> dict[str, str]:
    """``FLOTILLA_CLOUD`` for the agent on instance ``ident`` (described by ``instance``):
    its watchdog's settings (see ``_node/cloud.py``; a spot instance's polls the metadata
    service for interruption notices); with ``efa``, the EFA variables."""
    spot = instance.get("InstanceLifecycle") == "spot"
    watchdog = {
        "contact": contact_path(settings.workdir, ident),
        "ttl": settings.ttl,
        "poweroff": list(settings.poweroff_command),
        "imds": IMDS if spot else "",
    }
    env = {CLOUD_ENV: json.dumps(watchdog)}
    if efa:
        env.update(EFA_ENV)
    return env


__all__ = ["cloud_env"]
