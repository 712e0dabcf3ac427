"""An elastic pool's size: nodes that join or leave while calls run, and the gate a group
pool closes to change size between calls (``elastic.py`` drives it; see ``dispatch.py``).

:class:`Membership` works on the dispatcher's nodes and bookkeeping, under its ``lock``;
it runs on the loop thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._errors import PoolClosedError
from .node import Node, NodeState, Submission
from .placement import Placement
from .ranks import Ranks
from .recovery import Recovery

Telling = Callable[[list[Node], list[Node]], list[Node]]
"""Tells nodes (the second list) the pool's new nodes (the first) without waiting; the
nodes it could not tell so."""


class Membership:
    """Who the pool's nodes are: nodes added and removed (an elastic pool), and the gate
    that holds new calls while a group pool changes size.

    Attributes:
        d: the pool's nodes and bookkeeping (the dispatcher, see ``ranks.py``).
    """

    def __init__(self, d: Ranks, placement: Placement, recovery: Recovery) -> None:
        self.d = d
        self.placement = placement
        self.recovery = recovery

    def send_gated(self, subs: list[Submission], ranks: list[int] | None) -> None:
        """Send calls that waited at the gate: a batch (``ranks`` None) or a broadcast."""
        if ranks is not None:
            kept = [(sub, r) for sub, r in zip(subs, ranks, strict=True) if not sub.future.done()]
            subs, ranks = [sub for sub, _ in kept], [r for _, r in kept]
        else:
            subs = [sub for sub in subs if not sub.future.done()]
        if not subs:
            return
        try:
            if ranks is None:
                self.placement.dispatch(subs)
            elif max(ranks) >= len(self.d.nodes):
                raise PoolClosedError(f"node {max(ranks)} left the pool")
            else:
                self.placement.place_all(subs, ranks)
        except Exception as e:
            for sub in subs:
                if sub.node is None and not sub.future.done():
                    self.d.settle(sub, exc=e)

    def add(self, nodes: Sequence[Node], tell: Telling) -> list[Node]:
        """New ``nodes`` (at the next ranks) serve: backlogged calls go to them. The nodes
        there before are told first (``tell(every node, the old ones)`` returns those it
        could not tell without waiting: the caller tells them at once)."""
        with self.d.lock:
            old = list(self.d.nodes)
            for node in nodes:
                assert node.rank == len(self.d.nodes)
                self.d.nodes.append(node)
            left = tell(list(self.d.nodes), old)
        self.d.pump()
        return left

    def gate(self) -> None:
        """Stop sending new calls (a group pool is to change size between calls): the
        broadcasts and single calls made from now on wait for :meth:`resume`; those
        being sent and running go on (see :meth:`drained`)."""
        with self.d.lock:
            self.d.gated = True

    def drained(self) -> bool:
        """With the gate closed: whether no call runs or is being sent any more; if so
        every node is taken out of service until :meth:`resume`."""
        with self.d.lock:
            if self.d.placing or self.d.waiting:
                return False
            for node in self.d.nodes:
                with node.lock:
                    if node.inflight or any(node.busy):
                        return False
            for node in self.d.nodes:  # a retry on its way to one is refused, and waits
                with node.lock:
                    node.state = NodeState.CLOSED
            for rank in range(len(self.d.nodes)):
                self.d.replacing.add(rank)
                self.d.waiting[rank] = []
            return True

    def resume(self, nodes: Sequence[Node], failure: str = "") -> None:
        """The pool's ``nodes`` after a change of size (see ``elastic.py``): they
        serve, and the calls that waited are sent (to a rank no more: they fail). With
        ``failure`` (no nodes: the new group did not start) every rank is gone."""
        if failure:
            with self.d.lock:
                self.d.gated = False
                self.d.opened.notify_all()
                gated, self.d.gated_calls = self.d.gated_calls, []
            self.recovery.give_up(range(len(self.d.nodes)), f"could not restart: {failure}")
            for subs, _ in gated:
                for sub in subs:
                    self.d.settle(
                        sub, exc=PoolClosedError(f"the pool could not restart: {failure}")
                    )
            return
        with self.d.lock:
            self.d.nodes[:] = nodes
            self.d.replacing.clear()
            self.d.gated = False
            self.d.opened.notify_all()
            waiting, self.d.waiting = self.d.waiting, {}
            unplaced, self.d.unplaced = self.d.unplaced, []
            gated, self.d.gated_calls = self.d.gated_calls, []
        for rank, subs in waiting.items():
            for sub in subs:
                if rank < len(nodes):
                    self.recovery.resend(sub, rank)
                else:
                    self.d.settle(sub, exc=PoolClosedError(f"node {rank} left the pool"))
        for sub in unplaced:
            self.recovery.resend(sub, None)
        for subs, ranks in gated:  # whole broadcasts and batches, as they were made
            self.send_gated(subs, ranks)
        self.d.pump()

    def remove_idle(self, node: Node, tell: Telling) -> list[Node] | None:
        """Take the last node out of service if it runs nothing (None if it does); the
        others are told first (see :meth:`add`: those left to tell are returned)."""
        with self.d.lock:
            if self.d.nodes[-1] is not node or node.rank in self.d.waiting:
                return None
            with node.lock:
                if node.inflight or any(node.busy):
                    return None
                node.state = NodeState.CLOSED
            self.d.nodes.pop()
            return tell(list(self.d.nodes), list(self.d.nodes))
