"""Elastic pools, as Skyward has them: ``Nodes(desired, max, min)`` or ``nodes=(desired, max)``.

The pool opens once ``min`` nodes serve (default: all ``desired``) and keeps starting the
rest, adding each as it comes (a host that is down is tried again, with a backoff). With a
``max``, single calls that find every slot busy wait in the dispatcher's backlog
(``Dispatcher.hold``) and the autoscaler (``Elastic._scale``, Skyward's policy) grows the
pool for them at once, by ceil(queued calls / slots per node), up to ``max`` (fewer if
``max_hourly_cost`` buys fewer). When the pool has been idle, or under a third of its slots
busy, for ``Options(autoscale_idle_timeout=...)`` seconds, and the last decision is
``Options(autoscale_cooldown=...)`` seconds old, it shrinks towards ``min``: the last rank
first (ranks stay 0..n-1), only nodes that run nothing. ``min=0`` is scale to zero: every
node goes, the head included, and the next call (a single one, ``map``, a broadcast) starts
one again; ``desired=0`` is a pool born that way (lazy start). The distributed collections
live in the client (``store.py``): they keep their contents while the pool is empty. Every
decision is one console line. Every node learns the new size and peers (``instance_info()``)
before the next call it runs; broadcasts go to the nodes present. Every decision is
also an ``events.ScalingDecision`` (from and to counts, the reason) for ``pool.subscribe``.

A pool whose processes form one group (torch, JAX) cannot change its world size under a
running collective: it changes only between calls, by restarting every process with the
new size (as torchrun's elastic agent does). A gate (``Membership.gate``) holds the calls
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
from ..events import ScalingDecision
from .bringup import Bringup
from .dispatch import Dispatcher
from .node import Node, NodeState
from .observe import Observer
from .renew import stop_node

logger = logging.getLogger("flotilla")
LOW_USE = 0.3
"""An elastic pool with fewer than this share of its slots busy (for the idle timeout)
shrinks (Skyward's utilisation threshold)."""
BACKOFF_MIN = 0.25
BACKOFF_MAX = 5.0
"""Seconds between attempts at a machine whose agent did not start (doubling)."""


@dataclass(frozen=True)
class Nodes:
    """How many nodes a pool has, in Skyward's order: ``Nodes(desired, max=None, min=None)``.

    Args:
        desired: the nodes the pool starts with (``0``: a pool born empty, that starts
            nodes on its first call: lazy start).
        max: the most nodes the pool may grow to while calls wait for a free slot (None:
            no autoscaling, the pool keeps ``desired``).
        min: the pool opens once this many serve (None: all ``desired``), and an elastic
            pool never shrinks below it; ``0``: scale to zero (an idle pool releases every
            node, the head included, after ``Options(autoscale_idle_timeout=...)``, and
            starts one again on the next call).

    ``Compute(nodes=...)`` also takes an int (``Nodes(n)``) and a tuple ``(desired, max)``:
    ``nodes=(2, 8)`` is ``Nodes(2, max=8)``, a pool of 2 that grows up to 8.
    """

    desired: int
    max: int | None = None
    min: int | None = None

    def __post_init__(self) -> None:
        # Skyward's checks (skyward/api/spec.py), in its order and words, as ConfigurationError
        for name in ("desired", "max", "min"):
            value = getattr(self, name)
            if value is None and name != "desired":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigurationError(
                    f"{self!r}: {name} must be a whole number of nodes, got {value!r}"
                )
        if self.desired < 0:
            raise ConfigurationError(
                f"{self!r}: desired must be >= 0, got {self.desired} "
                "(0: a pool born empty, that starts nodes on its first call)"
            )
        if self.max is not None and self.max < self.desired:
            raise ConfigurationError(
                f"{self!r}: max ({self.max}) must be >= desired ({self.desired}); "
                "the order is Nodes(desired, max, min), as in Skyward"
            )
        upper = self.most
        if self.least > upper:
            raise ConfigurationError(
                f"{self!r}: min ({self.least}) must be <= "
                f"{'max' if self.max is not None else 'desired'} ({upper})"
            )
        if self.least < 0:
            raise ConfigurationError(f"{self!r}: min must be >= 0, got {self.least}")
        if upper == 0:
            raise ConfigurationError(
                f"{self!r}: a pool of at most 0 nodes can run nothing; a pool born empty "
                "needs a max to grow to, e.g. Nodes(0, max=4)"
            )

    def __repr__(self) -> str:
        args = [str(self.desired)]
        if self.max is not None:
            args.append(f"max={self.max!r}")
        if self.min is not None:
            args.append(f"min={self.min!r}")
        return f"Nodes({', '.join(args)})"

    @property
    def auto_scaling(self) -> bool:
        """Whether the pool scales with its work (it has a ``max``), as Skyward says."""
        return self.max is not None

    @property
    def least(self) -> int:
        """The nodes the pool opens with, and the fewest an elastic pool shrinks to."""
        return self.desired if self.min is None else self.min

    @property
    def most(self) -> int:
        """The most nodes the pool may have."""
        return self.desired if self.max is None else self.max

    @property
    def start(self) -> int:
        """The nodes the pool starts (``desired``, or ``min`` when that is more)."""
        return max(self.desired, self.least)

    @property
    def elastic(self) -> bool:
        """Whether the pool's size changes: it scales, or opens before all have come."""
        return self.max is not None or self.least != self.desired

    @classmethod
    def of(cls, nodes: object) -> Nodes:
        """``Compute(nodes=...)``'s value as :class:`Nodes` (Skyward's ``from_spec``): an
        int, ``(desired, max)`` or a Nodes; ConfigurationError for anything else."""
        if isinstance(nodes, Nodes):
            return nodes
        if isinstance(nodes, tuple | list) and len(nodes) == 2:  # (as Skyward's match)
            lo, hi = nodes
            if all(isinstance(n, int) and not isinstance(n, bool) for n in (lo, hi)):
                return cls(lo, max=hi)
        if isinstance(nodes, int) and not isinstance(nodes, bool):
            return cls(nodes)
        raise ConfigurationError(
            "nodes must be int, tuple[int, int], or Nodes (a number of nodes, "
            "(desired, max) or flotilla.Nodes(desired, max=..., min=...)); "
            f"got {type(nodes).__name__}: {nodes!r}"
        )


class Elastic:
    """Grows and shrinks one elastic pool (see the module docstring).

    Attributes:
        target: the size the pool is heading for (the autoscaler's or ``resize``'s last
            decision).
        cap: the most nodes the autoscaler grows to: ``max``, or fewer when
            ``max_hourly_cost`` buys fewer at the provider's price.
        starting: nodes whose agents are being started or brought up (heartbeats reach them).
        failures: the last reason each machine's agent did not start (by host), for the
            error when the pool cannot open.
        decisions: every decision so far, as said on the console.
    """

    def __init__(
        self,
        size: Nodes,
        dispatcher: Dispatcher,
        bringup: Bringup,
        idle_timeout: float,
        cooldown: float,
        slots: int,
        observer: Observer | None = None,
    ) -> None:
        self.size = size
        self.observer = observer
        self.dispatcher = dispatcher
        self.bringup = bringup
        self.idle_timeout = idle_timeout
        self.cooldown = cooldown
        self.slots = max(1, slots)
        self.allocation: Allocation | None = None
        self.target = size.start
        self.cap = size.most
        self.starting: list[Node] = []
        self.failures: dict[str, str] = {}
        self.decisions: list[str] = []
        self.regroups = 0
        self._attempts = 0  # machines whose agents are being started
        self._arrived: list[tuple[Machine, AgentProcess]] = []
        self._joining = 0  # agents taken from _arrived, not among the nodes yet
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._backoff = BACKOFF_MIN
        self._low_since = 0.0  # since when the pool has been idle (or under LOW_USE busy)
        self._decided = time.monotonic()  # the last decision (the cooldown runs from it)
        self._changing = asyncio.Lock()

    @property
    def nodes(self) -> list[Node]:
        return self.dispatcher.nodes

    @property
    def floor(self) -> int:
        """The fewest nodes the pool shrinks to (``min``; 0: scale to zero)."""
        return self.size.least

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def price_cap(self, hourly: float | None, max_hourly_cost: float | None) -> None:
        """Grow to no more nodes than ``max_hourly_cost`` buys at ``hourly`` per node (each
        None: no such cap; never below ``min``)."""
        if hourly and max_hourly_cost is not None:
            self.cap = max(self.floor, min(self.size.most, int(max_hourly_cost // hourly)))

    async def open(self, allocation: Allocation, timeout: float) -> None:
        """Start the pool's nodes; return once ``min`` serve (ProvisionError naming what
        failed when they do not within ``timeout`` s). The rest keep coming. A pool born
        empty (``desired=0``) returns at once."""
        self.allocation = allocation
        self.dispatcher.most = self.size.most
        self._decided = time.monotonic()
        self._spawn(self._run())
        await self._serving(self.size.least, timeout)

    async def _serving(self, count: int, timeout: float) -> None:
        """Wait until ``count`` nodes serve (ProvisionError after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while len(self.nodes) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                why = "; ".join(f"{h}: {r}" for h, r in self.failures.items()) or "still starting"
                raise ProvisionError(
                    f"{len(self.nodes)} of the {count} node(s) the pool needs "
                    f"served within {timeout:.0f} s ({why}); "
                    "Options(start_timeout=...) sets the limit"
                )
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.25)):
                    await self._wake.wait()

    async def wake(self, timeout: float) -> None:
        """An empty pool (scaled to zero, or born empty) is to run something that needs a
        node (a broadcast): start one and wait until it serves."""
        if not self.nodes and self.target < 1:
            self._decide(1, "a broadcast on the empty pool")
        self._wake.set()
        await self._serving(1, timeout)

    def resize(self, n: int) -> None:
        """``pool.resize(n)``: head for ``n`` nodes now (no cooldown); the autoscaler
        goes on from there. On the loop; ``n`` was checked against the bounds."""
        if n != self.target:
            self._decide(n, "pool.resize()")
        if n < len(self.nodes):
            self._spawn(self._shrink())
        self._wake.set()

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

    def _decide(self, size: int, why: str) -> None:
        """Head for ``size`` nodes: one console line (and :attr:`decisions`) and one
        ``events.ScalingDecision``."""
        line = f"autoscaler: {self.target} -> {size} node(s): {why}"
        before, self.target = self.target, size
        self._decided = time.monotonic()
        self.decisions.append(line)
        self.bringup.console.say(line)
        if self.observer is not None:
            self.observer.emit(
                ScalingDecision(
                    pool=self.observer.pool_id, from_nodes=before, to_nodes=size, reason=why
                )
            )

    def _scale(self) -> None:
        """The policy (Skyward's autoscaler): up at once by ceil(queued calls / slots per
        node), to at most :attr:`cap`; down, at most once per cooldown, when the pool has
        been idle (or under :data:`LOW_USE` of its slots busy) for the idle timeout: to
        ``min`` when idle, else to the nodes its running calls fill plus one."""
        d = self.dispatcher
        n = len(self.nodes)
        queued = len(d.backlog)
        if queued:
            self._low_since = 0.0
            # calls a free slot is about to take (a node that just joined) need no new node
            free = sum(1 for node in self.nodes for b in node.busy if not b)
            waiting = queued - free
            wanted = min(self.cap, n + math.ceil(max(0, waiting) / self.slots))
            if wanted > self.target:
                self._decide(wanted, f"{queued} call(s) queued, {self.slots} slot(s) a node")
            return
        if not self.size.auto_scaling:  # Nodes(8, min=4): a fixed pool that opens early
            return
        pending = self._attempts or self._arrived or self._joining or self.starting
        if pending or self._changing.locked() or n <= self.floor or self.target > n:
            self._low_since = 0.0
            return
        busy = sum(1 for node in self.nodes for b in node.busy if b)
        if busy >= LOW_USE * n * self.slots:
            self._low_since = 0.0
            return
        now = time.monotonic()
        if not self._low_since:
            self._low_since = now
        if now - self._low_since < self.idle_timeout or now - self._decided < self.cooldown:
            return
        keep = max(self.floor, math.ceil(busy / self.slots) + 1 if busy else 0)
        if keep >= n:
            return
        self._low_since = 0.0
        quiet = f"{self.idle_timeout:g} s"
        self._decide(
            keep,
            f"idle for {quiet}"
            if not busy
            else f"{busy} of {n * self.slots} slot(s) busy for {quiet}",
        )
        self._spawn(self._shrink())

    async def _attempt(self) -> None:
        """Get a machine and start an agent on it; it joins the pool (``_join``)."""
        allocation = self.allocation
        assert allocation is not None
        failed = False
        try:
            try:
                machine = await allocation.candidate(len(self.nodes))
            except Exception as e:  # no capacity, no room for a node's folder: tried again
                machine, failed = None, True
                why = str(e).strip().split("\n", 1)[0]
                if self.failures.get("(provider)") != why:  # once per reason
                    self.bringup.console.say(
                        f"the pool could not grow ({why}); it goes on with "
                        f"{len(self.nodes)} node(s) and tries again"
                    )
                self.failures["(provider)"] = why
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
            self.failures.pop("(provider)", None)
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
        left = self.dispatcher.membership.add(fresh, self._tell_now)
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
        """Release the last nodes, one at a time, down to :attr:`target`; a node running
        a call (or holding one queued) stays, and the pool keeps it (ranks stay 0..n-1,
        so the nodes before it stay too)."""
        async with self._changing:
            allocation = self.allocation
            assert allocation is not None
            if len(self.nodes) <= self.target:
                return
            if self.bringup.group:  # between calls: every process restarts (see _regroup)
                await self._regroup([], len(self.nodes) - self.target)
                return
            while len(self.nodes) > self.target:
                node = self.nodes[-1]
                left = self.dispatcher.membership.remove_idle(node, self._tell_now)
                if left is None:
                    n = len(self.nodes)
                    logger.info("%s runs a call: the pool keeps %d node(s)", node.name, n)
                    self.target = len(self.nodes)
                    break
                await self._tell(left)
                await stop_node(node)
                await allocation.give_back(allocation.remove_last(), failed=False)
                self.bringup.console.say(
                    f"{node.name} released: the pool has {len(self.nodes)} node(s)"
                )
            if not self.nodes:
                self.bringup.console.say("the pool is empty: its next call starts a node")
            self._wake.set()

    async def _regroup(self, arrived: list[tuple[Machine, AgentProcess]], drop: int) -> None:
        """A group pool changes size (``arrived`` join, the last ``drop`` nodes leave):
        between calls, every process restarts with the new world size (the calls sent
        meanwhile wait for the new group)."""
        d, allocation = self.dispatcher, self.allocation
        assert allocation is not None
        d.membership.gate()  # only between calls: new ones wait, those under way finish
        while not d.membership.drained():
            await asyncio.sleep(0.05)
        old = list(self.nodes)
        size = len(old) - drop + len(arrived)
        cause = f"the pool changes size from {len(old)} to {size} nodes"
        logger.warning("restarting every process of the pool: %s", cause)
        d.generation += 1
        for node in old:
            d.recovery.retire(node, cause)
        await asyncio.gather(*(stop_node(n) for n in old))
        for _ in range(drop):
            await allocation.give_back(allocation.remove_last(), failed=False)
        if size == 0:  # scaled to zero: the next call starts a new group (see _join_now)
            self.regroups += 1
            d.membership.resume([])
            self.bringup.console.say("the pool's group ended: the pool is empty")
            self._wake.set()
            return
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
            d.membership.resume([], reason)
            return
        finally:
            self.starting = [n for n in self.starting if n not in fresh]
        self.regroups += 1
        d.membership.resume(fresh)
        self.bringup.console.say(f"the pool's group restarted with {size} node(s)")
        self._wake.set()
