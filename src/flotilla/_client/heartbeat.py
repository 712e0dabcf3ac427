"""A pool's heartbeat: what its event loop does every quarter second while the pool runs
(``Compute`` starts it once its nodes are being brought up).

- Pings every node (agents exit when the client is silent) and declares lost those whose
  agents went silent.
- Trims the kept shared-memory argument files of an idle pool.
- Draws the live rows of metrics on a terminal while calls run.
- Keeps the pool's entry for ``flotilla top`` (``listing.py``).
- Reports an elastic pool's size as it changes (``Scaling``, and the new nodes' ``NodeReady``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol

from .._providers.base import Options
from .._wire.frames import Kind
from ..events import Scaling, view_dict
from ..metrics import Metric
from .console import Console
from .dispatch import Dispatcher
from .elastic import Elastic
from .listing import Listing
from .node import Node, NodeState
from .observe import Observer, stat_rows
from .renew import Renewals


class Beating(Protocol):
    """What the heartbeat reads of its pool (a ``Compute``)."""

    pool_id: str
    listed: bool
    options: Options
    metrics_config: tuple[Metric, ...]
    _dispatcher: Dispatcher
    _renewals: Renewals
    _elastic: Elastic | None
    _observer: Observer

    @property
    def _nodes(self) -> list[Node]: ...

    @property
    def _console(self) -> Console: ...

    def _ready(self, nodes: Sequence[Node]) -> None: ...


class Heartbeat:
    """The periodic work of one pool (:meth:`run`, a task on the pool's loop).

    Attributes:
        pool: the pool.
        listing: its entry for ``flotilla top`` (``listing.py``), once written.
        busy_since: when calls started running (the live rows of metrics; 0: idle).
        stats_due: when the live rows are drawn next.
        size_seen: an elastic pool's size, as last reported (``Scaling``).
    """

    def __init__(self, pool: Beating) -> None:
        self.pool = pool
        self.listing: Listing | None = None
        self.busy_since = self.stats_due = 0.0
        self.size_seen = 0

    async def run(self) -> None:
        """Ping every node (agents exit when the client is silent) and declare lost the
        nodes whose agents went silent (they BEAT every quarter of the timeout). Silence is
        checked every quarter second: a frozen node is found within the timeout + 0.25 s."""
        pool = self.pool
        limit = pool.options.heartbeat_timeout
        interval = limit / 4
        tick = min(interval, 0.25)
        last = next_ping = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            nodes = [*pool._nodes, *pool._renewals.starting]
            if pool._elastic is not None:
                nodes += pool._elastic.starting
            if now - last > interval:  # this process was stalled, not the nodes
                for node in nodes:
                    node.last_heard = max(node.last_heard, now)
            last = now
            ping = now >= next_ping
            if ping:
                next_ping = now + interval
            for node in nodes:
                node.proc.watch()  # a lone call's read may have left the loop's off
                if node.state in (NodeState.READY, NodeState.CONFIGURING):
                    if ping:
                        node.send_control(Kind.PING, wait=False)
                    node.check_silence(now, limit)
            pool._dispatcher.shm_files.trim(now)  # kept argument files of an idle pool go
            self.live_stats(now)
            self.write_listing(now)
            if pool._elastic is not None and len(pool._nodes) != self.size_seen:
                self.size_seen = len(pool._nodes)
                pool._observer.emit(Scaling(pool=pool.pool_id, nodes=self.size_seen))
                seen = pool._observer.nodes
                with pool._observer.lock:  # released nodes leave the view
                    for rank in [r for r in seen if r >= self.size_seen]:
                        del seen[rank]
                pool._ready(
                    [
                        n
                        for n in pool._nodes
                        if n.state is NodeState.READY
                        and (n.rank not in seen or seen[n.rank].phase != "ready")
                    ]
                )

    def write_listing(self, now: float) -> None:
        """Keep this pool's entry for ``flotilla top`` (``listing.py``): with metrics on."""
        pool = self.pool
        if pool.metrics_config and pool.listed and pool._dispatcher.running():
            if self.listing is None:
                self.listing = Listing(pool.pool_id)
            if now >= self.listing.due:
                self.listing.write(now, view_dict(pool._observer.view()))

    def live_stats(self, now: float) -> None:
        """On a terminal, while calls run (for a second or more): a row per node with its
        metrics, redrawn every second (``observe.stat_rows``)."""
        pool = self.pool
        console = pool._console
        if not pool.metrics_config or not console.live:
            return
        running = any(n.running for n in pool._observer.nodes.values())
        if not running:
            self.busy_since = 0.0
            if console.stat_rows:
                console.stats({})
            return
        if not self.busy_since:
            self.busy_since = now
        if now - self.busy_since >= 1.0 and now >= self.stats_due:
            self.stats_due = now + 1.0
            console.stats(stat_rows(pool._observer.view()))

    def close(self) -> None:
        """The pool closes (its heartbeat task stopped): its ``flotilla top`` entry goes."""
        if self.listing is not None:
            self.listing.remove()
