"""The AWS provider: ephemeral EC2 instances, reached over SSH with pinned host keys.

Acquiring a pool (:meth:`AWS.acquire`) makes, in order: the instance choice (see
``choice``), a security group of its own (SSH from the client's address, all traffic
between the pool's members, nothing else), the pool's keys (see ``keys``) and ONE
RunInstances call for all the nodes, with ``MinCount = MaxCount = nodes``: EC2 launches all
of them or none, so a partial launch is never kept. Spot (``allocation``) goes through
InstanceMarketOptions; a capacity error moves to the next zone that offers the type, then,
for ``"spot-if-available"``, to on-demand.

An instance is then an SSH host: the launch layer starts the agents through ``ssh``
(``ssh_shell``; the client's exact flotilla, shipped by content hash), for all nodes at
once, each first waiting for its instance's port 22. Peers and ``head_addr`` are the
private addresses.

Nothing is left behind: :meth:`AWSAllocation.release` (end of the block, an exception,
Ctrl-C) terminates every instance tagged with the pool (also ones a lost response did not
report), checks they are terminated, deletes the security group and the local key folder.
When the client dies, the instances end themselves: shutdown behaviour "terminate" plus a
watchdog started with the agent that powers off ``ttl`` s after the last contact from the
client (``_node/cloud.py``). Before the agent starts, a boot guard in the user-data does it
(``cloud.guard``): cloud-init starts it at boot, and unless an agent has started (its
watchdog's contact file exists) ``max(ttl, start_timeout)`` s later, it runs the same
power-off command; so an instance that no client ever reaches (the client died right after
RunInstances, SSH is blocked, a bad AMI) ends too. :meth:`AWS.remove_orphans` removes what
such a client left.

A named cluster's pool can be stopped and started again (``flotilla stop`` / ``start``):
see ``kept``.

Spot interruption notices reach the client as a line on the agent's stderr (see
``_node/cloud.py``); ``cloud.notice.watch_notices`` takes it out of the stream and reports
the machine lost through :meth:`Allocation.watch`'s callback, two minutes before AWS
reclaims it.
"""

from __future__ import annotations

import asyncio
import logging

from ..._errors import ConfigurationError
from ..base import PoolSpec, Provider
from ..cloud.market import check_stoppable, check_ttl
from ..offers import Offer
from ..options import provider_init
from .api import Api
from .kept import Keep
from .orphans import Orphans, remove_orphans, sweep
from .pool import AWSAllocation
from .settings import AWSSettings

logger = logging.getLogger("flotilla")


class AWS(Provider):
    """Run the nodes on EC2 instances started for the pool and terminated after it.

    Needs boto3 (``pip install 'flotilla[aws]'``), AWS credentials, and OpenSSH's ``ssh``
    and ``ssh-keygen`` on this machine. The pool's ``accelerator``, ``vcpus`` and
    ``memory_gb`` choose the smallest instance type that has them.
    """

    name = "aws"
    elastic = True
    reattaches_over_ssh = True  # a named cluster's nodes (``_providers/reattach.py``)
    """Elastic pools: an instance is launched per node added and terminated per node
    released (``AWSAllocation.candidate``, ``give_back``); a pool born empty launches none
    until its first call."""
    settings: AWSSettings
    keep: Keep | None = None
    """Set for a stoppable pool (a named cluster's, see ``kept``): its instances are
    recorded there, closing the pool with ``keep.stop`` set stops them, and the next pool
    starts them again instead of launching new ones."""
    _api: Api | None = None

    @provider_init(AWSSettings)
    def __init__(self) -> None: ...

    @property
    def api(self) -> Api:
        if self._api is None:
            self._api = Api(self.settings.region, self.settings.profile)
        return self._api

    def validate(self, spec: PoolSpec) -> None:
        self.api.check()
        check_ttl(self, spec, "the instances would power themselves off")
        check_stoppable(self, spec)
        if spec.vcpus is not None and spec.vcpus <= 0:
            raise ConfigurationError(f"vcpus={spec.vcpus!r}: a positive number")
        if spec.memory_gb is not None and spec.memory_gb <= 0:
            raise ConfigurationError(f"memory_gb={spec.memory_gb!r}: a positive number")

    def offers(self, spec: PoolSpec) -> list[Offer]:
        """The instance type the pool would run on, on-demand and (if it has spot) spot,
        priced when the Price List API and spot price history answer."""
        from .choice import choose
        from .price import on_demand_price, spot_price

        self.api.check()
        try:
            choice = choose(
                self.api,
                self.settings.instance_type,
                spec.accelerator,
                spec.vcpus,
                spec.memory_gb,
                self.settings.allocation == "spot",
                None,
            )
        except ConfigurationError:
            return []
        gpu = choice.gpu_name or None
        found = []
        if self.settings.allocation != "spot":
            found.append(
                Offer(
                    "aws",
                    gpu,
                    choice.gpus,
                    on_demand_price(self.api, choice.instance_type),
                    self.api.region,
                    False,
                    choice.instance_type,
                )
            )
        if choice.spot and self.settings.allocation != "on-demand":
            found.append(
                Offer(
                    "aws",
                    gpu,
                    choice.gpus,
                    spot_price(self.api, choice.instance_type, choice.zones),
                    self.api.region,
                    True,
                    choice.instance_type,
                )
            )
        return found

    async def acquire(self, spec: PoolSpec) -> AWSAllocation:
        """Launch the pool's instances (see the module docstring); on failure or
        cancellation everything made so far is removed before the error propagates."""
        await asyncio.get_running_loop().run_in_executor(None, self._sweep)
        kept = self.keep.load() if self.keep is not None else None
        if kept is not None and not kept.stopped:
            kept = None  # a pool whose client died: the sweep terminated it
        allocation = AWSAllocation(self.settings, self.api, spec, self.keep, kept)
        try:
            if kept is not None:
                await allocation.resume(kept)
            else:
                await allocation.launch()
        except BaseException:
            await allocation.release()
            raise
        return allocation

    def _sweep(self) -> None:
        """Remove what killed clients of this machine left (see ``orphans.sweep``)."""
        try:
            found = sweep(self.api)
        except Exception as e:  # no permission to list, say: the pool still starts
            logger.debug("the sweep of orphan AWS pools failed: %s", e)
            return
        if found.pools:
            logger.info(
                "removing what killed clients left: pool(s) %s (%d instance(s))",
                ", ".join(found.pools),
                len(found.instances),
            )

    def remove_orphans(self, dry_run: bool = False) -> Orphans:
        """Remove the instances, security groups and key folders of pools whose client
        process (on this machine) is gone: what a killed client left behind. Pools of
        clients on other machines are listed in ``Orphans.skipped``, not touched."""
        self.api.check()
        return remove_orphans(self.api, dry_run)
