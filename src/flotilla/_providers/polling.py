"""Watching an allocation's machines through the provider's own view (SLURM's node and job
states, Kubernetes' pods): :class:`PolledAllocation` asks every ``watch_interval`` s while
the allocation is READY, and reports each machine found lost once. A lost agent is noticed
by the client anyway; this is for what only the provider can see."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import abstractmethod

from .._errors import ProvisionError
from .base import Allocation, AllocationState, LostCallback, Machine

logger = logging.getLogger("flotilla")


class PolledAllocation(Allocation):
    """An allocation whose provider is asked, every ``watch_interval`` s, which of its
    machines are gone (:meth:`lost_machines`), once it is watched (:meth:`watch`).

    Attributes:
        watch_interval: seconds between two looks.
    """

    watch_interval: float
    _watcher: asyncio.Task[None] | None = None

    def watch(self, on_lost: LostCallback) -> None:
        super().watch(on_lost)
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to poll from
            if self._watcher is None:
                self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def stop_watching(self) -> None:
        """Stop looking (the allocation is freed)."""
        if self._watcher is not None:
            self._watcher.cancel()

    @abstractmethod
    async def lost_machines(self, machines: list[Machine]) -> dict[str, str]:
        """Those of ``machines`` the provider sees gone, by ident: why, in a few words.
        ProvisionError when the provider cannot be asked this time (asked again later)."""

    async def _watch(self) -> None:
        reported: set[str] = set()
        while self.state is AllocationState.READY:
            await asyncio.sleep(self.watch_interval)
            machines = [m for m in self.machines if m.ident not in reported]
            if not machines or self.state is not AllocationState.READY:
                continue
            try:
                lost = await self.lost_machines(machines)
            except ProvisionError as e:
                logger.debug("pool %s: cannot watch its machines: %s", self.spec.pool_id, e)
                continue
            if self.state is not AllocationState.READY:
                break
            for m in list(self.machines):  # (one replaced meanwhile: its replacement stays)
                if m.ident in lost and m.ident not in reported:
                    reported.add(m.ident)
                    self.report_lost(m.rank, lost[m.ident])
