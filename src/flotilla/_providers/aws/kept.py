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

from dataclasses import asdict, dataclass, field
from typing import Any

from ..cloud.kept import KeepFolder, record

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
        return record(KeptPool, data, "instances", KeptInstance)


@dataclass
class Keep(KeepFolder):
    """An AWS stoppable pool's folder (see ``cloud.kept.KeepFolder``): its record is a
    :class:`KeptPool`."""

    where = "its instances are tagged flotilla:stopped in the EC2 console"

    def load(self) -> KeptPool | None:
        """The kept pool, or None when there is none; a ConfigurationError when its record
        cannot be read."""
        data = self.load_data()
        return None if data is None else KeptPool.from_json(data)

    def save(self, pool: KeptPool, login_key: str | None = None) -> None:
        """Record ``pool`` (atomically), and copy the login key file ``login_key``."""
        self.save_data(asdict(pool), login_key)
