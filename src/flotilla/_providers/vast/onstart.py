"""The on-start script of a pool's instances: the pinned SSH host key and the guard.

No trust on first use (as on AWS, ``cloud/keys.py``): the client generates the instances'
SSH host key (ed25519, in a pool-private folder) and hands it over in the instance's
on-start script (``onstart`` of ``PUT /asks/{id}/``), which installs it as the only host
key of the instance's sshd (and makes a running sshd reload); the client connects with
exactly that key pinned for ``[public address]:port`` in the pool's own known_hosts. The
login key is attached through the API (``POST /instances/{id}/ssh/``).

The guard (as AWS's boot guard, ``cloud/guard.py``): an instance that no client ever reaches
must not run, and cost, forever. The script writes ``{workdir}/vast/{CONTAINER_ID}.destroy``
(0700), which destroys the instance through Vast's API with the key Vast gives each
instance for itself (``CONTAINER_API_KEY``: it can act on that instance only; the
account's key never leaves the client), then detaches a guard that waits
``max(ttl, start_timeout)`` s and runs it unless an agent started its watchdog (the
watchdog's lock file exists): the watchdog (``_node/cloud.py``) runs the same script
``ttl`` s after the client's last contact. The destroy call is tried again for a few
minutes (the API may throttle). POSIX sh and python3 (curl if there is no python3).

The script is the cloud kit's (``cloud/selfdestruct.py``, as RunPod's), with Vast's
variables; what is Vast's own here is the length it may have and the URL check.
"""

from __future__ import annotations

import re

from ..._errors import ConfigurationError
from ..cloud import selfdestruct
from ..cloud.keys import KeyPair
from ..cloud.selfdestruct import DestroyCall, contact

__all__ = ["ONSTART_LIMIT", "contact", "onstart_script", "poweroff_command"]

ONSTART_LIMIT = 4048
"""The most characters Vast takes in an instance's ``onstart`` (its API reference)."""
SAFE_URL = re.compile(r"[A-Za-z0-9:/._\-\[\]%@]+")


def poweroff_command(workdir: str, instance: int | str) -> list[str]:
    """What the watchdog runs when the client is gone: the instance's destroy script."""
    return selfdestruct.poweroff_command(workdir, "vast", str(instance))


def onstart_script(
    pool_id: str, host_key: KeyPair, url: str, workdir: str, ttl: float, start_timeout: float
) -> str:
    """The on-start script (see the module docstring)."""
    if not SAFE_URL.fullmatch(url):
        raise ValueError(f"not a plain URL: {url!r}")
    call = DestroyCall(
        "CONTAINER_ID",
        "DELETE",
        f"{url}/api/v0/instances/$CONTAINER_ID/",
        (("Authorization", "Bearer $CONTAINER_API_KEY"),),
    )
    script = "#!/bin/sh\n" + selfdestruct.start_script(
        "vast", pool_id, host_key, call, workdir, ttl, start_timeout, guard_log=False
    )
    if len(script) > ONSTART_LIMIT:
        raise ConfigurationError(
            f"the on-start script is {len(script)} characters, more than Vast takes "
            f"({ONSTART_LIMIT}): use a shorter VastAI(url=..., workdir=...)"
        )
    return script
