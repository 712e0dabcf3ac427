"""Stopping and starting a rented cloud's stoppable pool (a named cluster's, see ``kept``),
one flow for every provider that can (RunPod pods, Compute Engine instances): closing the
pool with its keep folder's ``stop`` set stops the nodes' instances (their disks kept) and
records them; the next pool of the cluster starts the same instances again, at the same
ranks, with their recorded host keys pinned at their current addresses. A provider's
allocation inherits :class:`StoppableAllocation` and implements its four hooks (its API's
stop, start and delete calls, and the host keys it pinned)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..base import AllocationState, Machine
from .allocation import InstanceAllocation, show
from .kept import Keep, KeptNode, KeptPool
from .keys import KeyPair, pin_public
from .market import launched

logger = logging.getLogger("flotilla.cloud")
_S = TypeVar("_S", bound="StoppableAllocation")


class StoppableAllocation(InstanceAllocation):
    """A cloud allocation whose instances can be stopped and started again (and, in an
    elastic pool, which cannot be a stoppable one, come and go one at a time).

    Attributes:
        keep: where the pool records its instances, and whether closing it stops them
            (see ``kept``); None: closing removes everything.
        kept_ids: the kept instances a start is starting (for a start that fails before
            the pool has its machines).
        kept_pool_id: the id of the pool that made the kept instances (their label).
        provider_kind: the provider's name in records and messages ("gcp", "runpod").
        spot: the pool's instances are spot / interruptible ones (never stopped).
    """

    keep: Keep | None = None
    kept_ids: tuple[str, ...] = ()
    kept_pool_id = ""
    provider_kind = ""
    provider_title = ""
    spot = False

    # -- the provider's hooks --------------------------------------------------------
    def place(self) -> str:
        """Where the pool's instances are (a zone, a data center)."""
        raise NotImplementedError

    def host_keys_of(self, ident: str) -> list[str]:
        """The host keys pinned for instance ``ident`` (``type key`` lines)."""
        raise NotImplementedError

    def stop_instances(self, ids: list[str]) -> None:
        """Stop the instances ``ids`` (their disks kept) and delete the pool's other
        instances; return once they are stopped."""
        raise NotImplementedError

    def start_instances(self, kept: KeptPool) -> list[Machine]:
        """Start ``kept``'s stopped instances; their machines, in rank order, once each
        runs with its address. ProvisionError (CAPACITY) when the provider has no room
        for them now: they stay stopped."""
        raise NotImplementedError

    # -- the shared flow -------------------------------------------------------------
    def node_ids(self) -> list[str]:
        """The instances of the nodes, in rank order (those a start was starting, if it
        failed before the pool had its machines)."""
        return [m.ident for m in self.machines] or list(self.kept_ids)

    def record(self, stopped: bool) -> None:
        """Write the pool's nodes to the keep folder (see ``kept``)."""
        if self.keep is None:
            return
        nodes = [KeptNode(i, self.host_keys_of(i)) for i in self.node_ids()]
        pool = self.kept_pool_id or self.spec.pool_id  # the instances' label
        kept = KeptPool(self.provider_kind, pool, stopped, self.spot, self.place(), self.hourly)
        kept.nodes = nodes
        self.keep.save(kept, self.login_key.path if self.login_key is not None else None)

    def stop_kept(self) -> bool:
        """Closing the pool: stop its nodes' instances when its keep folder says so (and
        they are not spot ones, which are removed as usual); True when they were stopped
        and recorded (the caller then removes nothing)."""
        keep = self.keep
        if keep is None or not keep.stop or not self.node_ids():
            return False
        if self.spot:
            show(logger, f"{self.provider_title}: spot instances are not stopped: removing them")
            return False
        ids = self.node_ids()
        self.record(True)  # before stopping: `flotilla down` finds them whatever happens next
        self.stop_instances(ids)
        show(
            logger,
            f"{self.provider_title}: stopped {len(ids)} instance(s) of pool "
            f"{self.spec.pool_id} ({', '.join(ids)}); their disks are kept",
        )
        return True

    def kept_at_release(self) -> bool:
        """Closing the pool: :meth:`stop_kept`; True when the caller removes nothing (the
        instances were stopped, or their stop failed: they are recorded as stopped, and
        ``flotilla down`` removes them)."""
        try:
            return self.stop_kept()
        except ProvisionError as e:
            show(logger, f"{self.provider_title}: could not stop pool {self.spec.pool_id}: {e}")
            return True

    def start_one(self, call: Callable[[], Any], what: str) -> None:
        """``call()``, which starts a stopped instance (``what`` it does, in messages): an
        answer that the provider has no room for it now is a ProvisionError (CAPACITY)
        saying that the instances stay stopped."""
        try:
            call()
        except ProvisionError as e:
            if e.cause is not ProvisionCause.CAPACITY:
                raise
            raise ProvisionError(
                f"{self.provider_title} cannot {what} now ({e}): the instances stay stopped; "
                "try `flotilla start` again later",
                cause=ProvisionCause.CAPACITY,
            ) from e

    def forget_kept(self) -> None:
        """The pool's instances are removed: nothing to keep."""
        if self.keep is not None:
            self.keep.forget()

    async def resume(self, kept: KeptPool) -> None:
        """Start the kept, stopped instances instead of making new ones (see the module
        docstring); a failed start leaves them stopped and recorded."""
        keep = self.keep
        assert keep is not None
        keep.stop = True  # until the pool is up: a failure keeps the instances
        self.kept_ids = tuple(kept.ids)
        self.kept_pool_id = kept.pool
        if len(kept.nodes) != self.spec.nodes:
            raise ConfigurationError(
                f"{len(kept.nodes)} stopped instance(s) cannot make a pool of "
                f"{self.spec.nodes} nodes"
            )
        login = keep.restore_login_key(self.folder)
        with open(login + ".pub") as f:
            self.login_key = KeyPair(login, f.read().strip())
        self.ssh.key = login
        show(
            logger,
            f"{self.provider_title}: starting {len(kept.nodes)} stopped instance(s) in "
            f"{kept.place}: {', '.join(kept.ids)}",
        )
        machines = await self._in_thread(self.start_instances, kept)
        share = None if kept.hourly is None else kept.hourly / len(kept.nodes)
        for node in kept.nodes:  # (a replaced node's instance later is billed apart)
            self.billed(node.id, share)
        for machine, node in zip(machines, kept.nodes, strict=True):
            target = self.target(machine)
            address = target.host if target.port == 22 else f"[{target.host}]:{target.port}"
            for key in node.host_keys:  # a started instance may have a new address
                pin_public(self.known_hosts, address, key)
        self.machines = machines
        self.state = AllocationState.READY
        await self._in_thread(self.record, False)
        keep.stop = False


def kept_pool(keep: Keep | None, kind: str) -> KeptPool | None:
    """The stopped pool ``keep`` holds for provider ``kind`` (None: none; a record of a pool
    whose client died, whose instances its TTL removed, is forgotten)."""
    if keep is None:
        return None
    kept = keep.load()
    if kept is None or kept.provider != kind:
        return None
    if not kept.stopped:
        keep.forget()
        return None
    return kept


async def acquired(allocation: _S, keep: Keep | None, launch: Callable[[], Awaitable[None]]) -> _S:
    """``allocation`` of a provider that can stop its instances: the stopped pool ``keep``
    holds (if any) started again, else ``launch()`` and the pool recorded in ``keep``;
    released (nothing left, or the kept instances stopped again) when that fails; when its
    record cannot be read too (the record left as it is)."""

    async def start() -> None:
        kept = kept_pool(keep, allocation.provider_kind)
        allocation.keep = keep
        if kept is not None:
            await allocation.resume(kept)
            return
        await launch()
        if keep is not None:
            await allocation._in_thread(allocation.record, False)

    return await launched(allocation, start)
