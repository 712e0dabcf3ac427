"""Elastic pools: ``nodes=(desired, max)`` or ``Nodes(desired, min, max)``, as Skyward has them.

The pool opens once ``min`` nodes serve (default: all ``desired``) and keeps starting the
rest, adding each as it comes (a host that is down is tried again, with a backoff). With a
``max``, single calls that find every process busy wait in the dispatcher's backlog
(``Dispatcher.hold``) and the pool grows for them, up to ``max``; a node beyond
``desired`` idle for ``Options(scale_down_after=...)`` seconds is released (the last rank
first: ranks stay 0..n-1). Every node learns the new size and peers (``instance_info()``)
before the next call it runs; broadcasts go to the nodes present.

A pool whose processes form one group (torch, JAX) cannot change its world size under a
running collective: it changes only between calls, by restarting every process with the
new size (as torchrun's elastic agent does). A gate (``Dispatcher.gate``) holds the calls
made from then on while those under way finish (so back-to-back calls leave room for it);
then the new nodes join, the old ones get fresh agents, and the calls that waited are sent
(a broadcast to every node, to every node of the new size).

Everything runs on the client's event loop, in one task (no task or thread per node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigurationError, ProvisionError
from .._providers.base import AgentProcess, Allocation, Machine, start_agents
from .bringup import Bringup
from .dispatch import Dispatcher
from .node import Node, NodeState
from .renew import stop_node

logger = logging.getLogger("flotilla")
BACKOFF_MIN = 0.25
BACKOFF_MAX = 5.0
"""Seconds between attempts at a machine whose agent did not start (doubling)."""


@dataclass(frozen=True)
class Nodes:
    """How many nodes a pool has: ``Nodes(4)``, or an elastic pool.

    Args:
        desired: the nodes the pool starts (and keeps starting until they serve).
        min: the pool opens once this many serve (default: ``desired``); the others
            join as they come up.
        max: the pool grows up to this many while calls wait for a free process, and
            shrinks back to ``desired`` when the extra nodes are idle
            (``Options(scale_down_after=...)``). Default: ``desired``.

    ``Compute(nodes=...)`` also takes an int (``Nodes(n)``) and ``(desired, max)``.
    """

    desired: int
    min: int | None = None
    max: int | None = None

    def __post_init__(self) -> None:
        for name in ("desired", "min", "max"):
            value = getattr(self, name)
            if value is None and name != "desired":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    f"Nodes({name}=...) must be a whole number of nodes (>= 1), got {value!r}"
                )
        if self.least > self.desired:
            raise ConfigurationError(
                f"Nodes(desired={self.desired}, min={self.min}): min cannot exceed desired"
            )
        if self.most < self.desired:
            raise ConfigurationError(
                f"Nodes(desired={self.desired}, max={self.max}): max cannot be below desired"
            )

    @property
    def least(self) -> int:
        """The nodes the pool opens with."""
        return self.desired if self.min is None else self.min

    @property
    def most(self) -> int:
        """The most nodes the pool may have."""
        return self.desired if self.max is None else self.max

    @property
    def elastic(self) -> bool:
        return self.least < self.desired or self.most > self.desired

    @classmethod
    def of(cls, nodes: object) -> Nodes:
        """``Compute(nodes=...)``'s value as :class:`Nodes`; ConfigurationError if it is
        none of an int, ``(desired, max)`` or a Nodes."""
        if isinstance(nodes, Nodes):
            return nodes
        if (
            isinstance(nodes, tuple | list)
            and len(nodes) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in nodes)
        ):
            return cls(nodes[0], max=nodes[1])
        if isinstance(nodes, int) and not isinstance(nodes, bool):
            if nodes < 1:
                raise ConfigurationError(f"nodes={nodes}: a pool needs at least one node")
            return cls(nodes)
        raise ConfigurationError(
            "nodes must be a whole number of nodes (>= 1), (desired, max) or "
            f"flotilla.Nodes(desired, min=..., max=...), got {nodes!r}"
        )


class Elastic:
    """Grows and shrinks one elastic pool (see the module docstring).

    Attributes:
        target: the size the pool is heading for (``desired``, more while calls wait).
        starting: nodes whose agents are being started or brought up (heartbeats reach them).
        failures: the last reason each machine's agent did not start (by host), for the
            error when the pool cannot open.
    """

    def __init__(
        self,
        size: Nodes,
        dispatcher: Dispatcher,
        bringup: Bringup,
        scale_down_after: float,
    ) -> None:
        self.size = size
        self.dispatcher = dispatcher
        self.bringup = bringup
        self.scale_down_after = scale_down_after
        self.allocation: Allocation | None = None
        self.target = size.desired
        self.starting: list[Node] = []
        self.failures: dict[str, str] = {}
        self.regroups = 0
        self._attempts = 0  # machines whose agents are being started
        self._arrived: list[tuple[Machine, AgentProcess]] = []
        self._joining = 0  # agents taken from _arrived, not among the nodes yet
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._backoff = BACKOFF_MIN
        self._idle_since = 0.0
        self._changing = asyncio.Lock()

    @property
    def nodes(self) -> list[Node]:
        return self.dispatcher.nodes

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def open(self, allocation: Allocation, timeout: float) -> None:
        """Start the pool's nodes; return once ``min`` serve (ProvisionError naming what
        failed when they do not within ``timeout`` s). The rest keep coming."""
        self.allocation = allocation
        self.dispatcher.most = self.size.most
        self._spawn(self._run())
        deadline = time.monotonic() + timeout
        while len(self.nodes) < self.size.least:
            left = deadline - time.monotonic()
            if left <= 0:
                why = "; ".join(f"{h}: {r}" for h, r in self.failures.items()) or "still starting"
                raise ProvisionError(
                    f"{len(self.nodes)} of the {self.size.least} node(s) the pool needs "
                    f"to open served within {timeout:.0f} s ({why}); "
                    "Options(start_timeout=...) sets the limit"
                )
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.25)):
                    await self._wake.wait()

    async def close(self) -> None:
        """Stop growing and shrinking; agents being started are stopped."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _machine, agent in self._arrived:
            await agent.terminate()
        self._arrived = []

    # -- the loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._scale()
            missing = (
                self.target
                - len(self.nodes)
                - len(self.starting)
                - self._attempts
                - len(self._arrived)
                - self._joining
            )
            for _ in range(max(0, missing)):
                self._attempts += 1
                self._spawn(self._attempt())
            if self._arrived and not self._changing.locked():
                self._spawn(self._join())
            with contextlib.suppress(TimeoutError):  # (not wait_for: see pyproject's ruff)
                async with asyncio.timeout(0.1):
                    await self._wake.wait()
            self._wake.clear()

    def _scale(self) -> None:
        """Grow for the calls waiting; shrink when the last node beyond ``desired`` has
        been idle long enough."""
        d = self.dispatcher
        procs = max(1, d.procs)
        if d.backlog and self.target < self.size.most:
            wanted = len(self.nodes) + math.ceil(len(d.backlog) / procs)
            self.target = max(self.target, min(self.size.most, wanted))
        if self.target <= self.size.desired or d.backlog or self._changing.locked():
            self._idle_since = 0.0
            return
        busy = any(n.inflight or any(n.busy) for n in self.nodes)
        now = time.monotonic()
        if busy or self._attempts or self._arrived:
            self._idle_since = 0.0
        elif not self._idle_since:
            self._idle_since = now
        elif now - self._idle_since >= self.scale_down_after:
            self._idle_since = 0.0
            self.target = max(self.size.desired, len(self.nodes) - 1)
            self._spawn(self._shrink())

    async def _attempt(self) -> None:
        """Get a machine and start an agent on it; it joins the pool (``_join``)."""
        allocation = self.allocation
        assert allocation is not None
        failed = False
        try:
            try:
                machine = await allocation.candidate(len(self.nodes))
            except Exception as e:  # e.g. no room for a node's folder: tried again later
                machine, failed = None, True
                self.failures["(provider)"] = str(e).strip().split("\n", 1)[0]
            if machine is None:
                failed = True
                return
            try:
                agent = await allocation.start_agent(machine)
            except Exception as e:
                failed = True
                why = str(e).strip().split("\n", 1)[0]
                if machine.host not in self.failures:  # once per host, until it is up
                    self.bringup.console.say(f"{why}; trying it again meanwhile")
                self.failures[machine.host] = why
                await allocation.give_back(machine, failed=True)
                return
            self._backoff = BACKOFF_MIN
            self.failures.pop(machine.host, None)
            self._arrived.append((machine, agent))
        finally:
            if failed:  # the next attempt waits (the count stays up meanwhile)
                await asyncio.sleep(self._backoff)
                self._backoff = min(BACKOFF_MAX, self._backoff * 2)
            self._attempts -= 1
            self._wake.set()

    async def _join(self) -> None:
        """Bring the agents started up as nodes at the next ranks, all at once."""
        async with self._changing:
            arrived, self._arrived = self._arrived, []
            self._joining = len(arrived)
            try:
                await self._join_now(arrived)
            finally:
                self._joining = 0

    async def _join_now(self, arrived: list[tuple[Machine, AgentProcess]]) -> None:
        """Bring ``arrived`` up (see ``_join``)."""
        if not arrived:
            return
        if self.bringup.group and self.nodes:
            await self._regroup(arrived, 0)
            return
        allocation = self.allocation
        assert allocation is not None
        machines = [allocation.admit(m) for m, _ in arrived]
        fresh = self.bringup.nodes([m.rank for m in machines], [a for _, a in arrived])
        self.starting += fresh
        try:
            await self.bringup.bring_up(fresh, [*self.nodes, *fresh])
        except asyncio.CancelledError:
            for node in fresh:
                node.state = NodeState.CLOSED
            raise
        except Exception as e:
            await self._undo(fresh, f"{e}".split("\n", 1)[0])
            return
        finally:
            self.starting = [n for n in self.starting if n not in fresh]
        left = self.dispatcher.add(fresh, self._tell_now)
        names = ", ".join(n.name for n in fresh)
        self.bringup.console.say(f"{names} joined: the pool has {len(self.nodes)} node(s)")
        await self._tell(left)
        self._wake.set()

    async def _undo(self, fresh: list[Node], why: str) -> None:
        """Nodes that failed to come up: their machines go back (tried again later)."""
        allocation = self.allocation
        assert allocation is not None
        for node in reversed(fresh):
            node.state = NodeState.CLOSED
            await node.proc.terminate()
            machine = allocation.remove_last()
            self.failures[machine.host] = why
            await allocation.give_back(machine, failed=True)
        logger.info("%d node(s) did not come up (%s); trying again", len(fresh), why)

    def _tell_now(self, nodes: list[Node], to: list[Node]) -> list[Node]:
        """Tell ``to`` the pool's new ``nodes`` as the change is made (no wait: the
        dispatcher's lock is held); the nodes left to tell."""
        return self.bringup.members(nodes, to, wait=False)

    async def _tell(self, left: list[Node]) -> None:
        """Tell the nodes ``_tell_now`` left the new size and peers (not on the loop)."""
        await self.bringup.tell_rest(list(self.nodes), left)

    async def _shrink(self) -> None:
        """Release the last node if it is still idle."""
        async with self._changing:
            allocation = self.allocation
            assert allocation is not None
            if len(self.nodes) <= self.size.desired:
                return
            node = self.nodes[-1]
            if self.bringup.group:
                await self._regroup([], 1)
                return
            left = self.dispatcher.remove_idle(node, self._tell_now)
            if left is None:
                self.target = max(self.target, len(self.nodes))
                return
            await self._tell(left)
            await stop_node(node)
            await allocation.give_back(allocation.remove_last(), failed=False)
            self.bringup.console.say(
                f"{node.name} released, idle for "
                f"{self.scale_down_after:g} s: the pool has {len(self.nodes)} node(s)"
            )
            self._wake.set()

    async def _regroup(self, arrived: list[tuple[Machine, AgentProcess]], drop: int) -> None:
        """A group pool changes size (``arrived`` join, the last ``drop`` nodes leave):
        between calls, every process restarts with the new world size (the calls sent
        meanwhile wait for the new group)."""
        d, allocation = self.dispatcher, self.allocation
        assert allocation is not None
        d.gate()  # only between calls: new ones wait, those under way finish
        while not d.drained():
            await asyncio.sleep(0.05)
        old = list(self.nodes)
        size = len(old) - drop + len(arrived)
        cause = f"the pool changes size from {len(old)} to {size} nodes"
        logger.warning("restarting every process of the pool: %s", cause)
        d.generation += 1
        for node in old:
            d.retire(node, cause)
        await asyncio.gather(*(stop_node(n) for n in old))
        for _ in range(drop):
            await allocation.give_back(allocation.remove_last(), failed=False)
        fresh: list[Node] = []
        try:
            kept = await start_agents(allocation, list(allocation.machines))
            machines = [allocation.admit(m) for m, _ in arrived]
            procs = [*kept, *(a for _, a in arrived)]
            ranks = [*range(len(kept)), *(m.rank for m in machines)]
            fresh = self.bringup.nodes(ranks, procs)
            self.starting += fresh
            await self.bringup.bring_up(fresh, fresh)
        except asyncio.CancelledError:
            for node in fresh:
                node.state = NodeState.CLOSED
            raise
        except Exception as e:
            reason = str(e).split("\n", 1)[0] or type(e).__name__
            logger.error("the pool's group could not restart with %d nodes: %s", size, reason)
            for node in fresh:
                node.state = NodeState.CLOSED
                await node.proc.terminate()
            d.resume([], reason)
            return
        finally:
            self.starting = [n for n in self.starting if n not in fresh]
        self.regroups += 1
        d.resume(fresh)
        self.bringup.console.say(f"the pool's group restarted with {size} node(s)")
        self._wake.set()
