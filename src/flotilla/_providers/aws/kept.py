"""A stoppable AWS pool: what a named cluster keeps on this machine so that its instances
can be stopped (StopInstances: their EBS disks stay, no compute is billed) and started
again by a later pool (StartInstances: the same instances, perhaps with new public
addresses), as SkyPilot's ``sky stop`` / ``sky start`` do.

The command line's AWS backend gives the provider a :class:`Keep` (a private folder of the
cluster's). The pool then records its instances there (:class:`KeptPool`, ``pool.json``,
written once the pool is up, after a replacement and when it stops) with the pool's login
key. Closing the pool terminates everything, as always, unless :attr:`Keep.stop` was set
(``flotilla stop``, ``--autostop``): then the instances are stopped and tagged
``flotilla:stopped`` (so no orphan sweep removes them while no client runs), and the next
pool of the cluster starts them instead of launching new ones, pins their recorded host
keys at their current addresses, and removes the tag. Spot instances cannot be stopped
(EC2 only terminates them): a spot pool closed with ``stop`` set is terminated, and the
command line refuses ``stop`` for it before anything happens.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..._errors import ConfigurationError
from ..._system.private import private_dir

STATE_FILE = "pool.json"
LOGIN_KEY = "login_key"
TAG_STOPPED = "flotilla:stopped"
"""On every resource of a stopped pool: the orphan sweep leaves the pool alone."""


@dataclass
class KeptInstance:
    """One node's instance, in rank order.

    Attributes:
        id: the instance id.
        host_key: the public host key it was given in its user-data (pinned at every start).
    """

    id: str
    host_key: str


@dataclass
class KeptPool:
    """What a stoppable pool records (``pool.json``).

    Attributes:
        pool: the ``flotilla:pool`` tag of its resources (the first pool's id).
        region: the region its instances are in.
        stopped: its instances were stopped (True) or run under a live pool (False).
        market: "on-demand" or "spot", as launched.
        zone: the zone it launched in.
        instance_type: its instances' type.
        image: the AMI they were launched from.
        security_group: the pool's security group.
        placement_group: its cluster placement group ("" for none).
        instances: the node instances, in rank order.
    """

    pool: str
    region: str
    stopped: bool
    market: str
    zone: str
    instance_type: str
    image: str
    security_group: str
    placement_group: str = ""
    instances: list[KeptInstance] = field(default_factory=list)

    @staticmethod
    def from_json(data: dict[str, Any]) -> KeptPool:
        instances = [KeptInstance(**i) for i in data.get("instances", [])]
        known = {k: v for k, v in data.items() if k in KeptPool.__dataclass_fields__}
        known["instances"] = instances
        return KeptPool(**known)


@dataclass
class Keep:
    """A stoppable pool's folder on this machine, and what closing the pool does.

    Attributes:
        folder: the folder (made private to this user on first write).
        stop: closing the pool stops its instances (kept for a later pool) instead of
            terminating them. A pool that starts kept instances sets it while it starts
            (a failed start keeps them); it is cleared once the pool is up.
    """

    folder: Path
    stop: bool = False

    @property
    def state_file(self) -> Path:
        return self.folder / STATE_FILE

    def load(self) -> KeptPool | None:
        """The kept pool, or None when there is none; a ConfigurationError when its record
        cannot be read."""
        try:
            data = json.loads(self.state_file.read_text())
            return KeptPool.from_json(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            raise ConfigurationError(
                f"the stopped pool's record {self.state_file} cannot be read ({e}): its "
                "instances are tagged flotilla:stopped in the EC2 console"
            ) from e

    def save(self, pool: KeptPool, login_key: str | None = None) -> None:
        """Record ``pool`` (atomically), and copy the login key file ``login_key``."""
        private_dir(self.folder)
        if login_key is not None and os.path.abspath(login_key) != str(self.login_key):
            for suffix in ("", ".pub"):  # the private key first made 0600, then written
                target = f"{self.login_key}{suffix}"
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as dst, open(f"{login_key}{suffix}", "rb") as src:
                    shutil.copyfileobj(src, dst)
        fd, tmp = tempfile.mkstemp(prefix=".pool.", dir=self.folder)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(pool), f, indent=1)
        os.replace(tmp, self.state_file)

    @property
    def login_key(self) -> Path:
        return self.folder / LOGIN_KEY

    def forget(self) -> None:
        """The pool's instances are terminated: nothing to keep."""
        shutil.rmtree(self.folder, ignore_errors=True)
