"""Where a pool's calls go: least busy first, pinned calls to their rank, broadcasts to
every process (see ``dispatch.py`` for the policy).

:class:`Placement` works on the dispatcher's nodes and rank bookkeeping, under its ``lock``
(never held while writing to a node); calls are sent from any thread.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from .._errors import NodeLostError, PoolClosedError
from . import fanout
from .encoding import Encoder
from .function import PendingCall
from .futures import Batch
from .node import Node, NodeState, Payload, Submission
from .ranks import Ranks


class Placement:
    """Sends a pool's calls to its nodes: the least busy (node, local rank), the rank of a
    pinned call, every process for a broadcast; parks a call while its rank is down.

    Attributes:
        d: the pool's nodes and bookkeeping (the dispatcher, see ``ranks.py``).
        encoder: makes a broadcast's submissions (``encoding.py``).
    """

    def __init__(self, d: Ranks, encoder: Encoder) -> None:
        self.d = d
        self.encoder = encoder

    def least_busy(
        self, exclude: Node | None = None, dead: Collection[Node] = ()
    ) -> tuple[Node, int] | None:
        """The ready (node, local rank) with the fewest calls in flight, lowest rank first
        among equals; on a node other than ``exclude`` when there is one, never on one of
        ``dead`` (they refused a call). None if no node is ready."""
        nodes = [n for n in self.d.nodes if n.state is NodeState.READY]
        if dead:
            nodes = [n for n in nodes if n not in dead]
        if exclude is not None:
            nodes = [n for n in nodes if n is not exclude] or nodes
        best: tuple[Node, int] | None = None
        least = 0
        for node in nodes:
            for worker, busy in enumerate(node.busy):
                if best is None or busy < least:
                    best, least = (node, worker), busy
        return best

    def dispatch(self, subs: list[Submission]) -> None:
        """Send each call to the least busy node; ties go to the lowest rank.

        Counting each assignment spreads a batch evenly; preferring low ranks among idle
        nodes keeps one agent warm for a stream of single calls.
        """
        with self.d.lock:
            if self.d.gated:
                self.d.gated_calls.append((subs, None))
                return
            self.d.placing += 1
        try:
            self._dispatch(subs)
        finally:
            with self.d.lock:
                self.d.placing -= 1

    def _dispatch(self, subs: list[Submission]) -> None:
        if len(subs) == 1 or self.d.hold:  # `>>`: no bookkeeping beyond the choice
            for sub in subs:
                self.place(sub)
            return
        load = {
            (n, w): busy
            for n in self.d.nodes
            if n.state is NodeState.READY
            for w, busy in enumerate(n.busy)
        }
        if not load:
            for sub in subs:
                self.place(sub)
            return
        by_node: dict[Node, list[Submission]] = {}
        for sub in subs:
            node, sub.worker = best = min(load, key=load.__getitem__)
            load[best] += 1
            by_node.setdefault(node, []).append(sub)
        for node, batch in by_node.items():
            try:
                node.send(batch)
            except NodeLostError:
                if self.d.replacer is None and node in self.d.nodes:  # (not: released by a shrink)
                    raise
                for sub in batch:
                    self.place(sub, dead={node})

    def place(
        self,
        sub: Submission,
        rank: int | None = None,
        exclude: Node | None = None,
        dead: set[Node] | None = None,
    ) -> None:
        """Send ``sub`` to the node at ``rank`` (a pinned call) or to the least busy one
        (other than ``exclude`` if possible, never one of ``dead``); or park it until a
        lost node is back.

        A node that refuses the call (its agent is gone, the loss not reported yet) is
        treated as down from then on. Raises PoolClosedError when the call can run
        nowhere, NodeLostError when its node is lost and lost nodes are not replaced."""
        while True:
            with self.d.lock:
                if rank is not None:
                    if rank in self.d.gone:
                        raise self.gone_error([rank], "cannot run the call")
                    node = self.d.nodes[rank]
                    if rank in self.d.waiting or (
                        node.state is not NodeState.READY and self.d.replacer is not None
                    ):
                        self.d.waiting.setdefault(rank, []).append(sub)
                        return
                else:
                    choice = self.least_busy(exclude, dead or ())
                    if choice is None:
                        if self.d.most and not self.d.nodes:  # an elastic pool at zero: it wakes
                            self.d.backlog.append(sub)
                            return
                        if self.d.waiting:
                            self.d.unplaced.append(sub)
                            return
                        raise self.d.all_lost()
                    node, sub.worker = choice
                    if self.d.hold and node.busy[sub.worker] > 0:
                        self.d.backlog.append(sub)
                        return
            try:
                node.send([sub])
                return
            except NodeLostError:
                with self.d.lock:  # not current: an elastic pool released it (choose again)
                    current = node.rank < len(self.d.nodes) and self.d.nodes[node.rank] is node
                if current and (self.d.replacer is None or not self.d.running()):
                    raise
                with self.d.lock:  # its loss is on its way: wait for the replacement
                    if current and node.rank not in self.d.gone:
                        self.d.waiting.setdefault(node.rank, [])
                dead = {node} | (dead or set())

    def broadcast(
        self, call: PendingCall[Any], ranks: Sequence[int] | None = None, any_slot: bool = False
    ) -> list[Submission]:
        """Send ``call`` to every process of the nodes at ``ranks`` (None: of every node,
        as many as there are when it is sent: a broadcast made while a group pool changes
        size waits for the new size); a submission each. ``any_slot`` (one process per
        node): each runs in its node's least busy task slot, not always the first."""
        with self.d.lock:
            while ranks is None and self.d.gated and not self.d.closed:
                self.d.opened.wait()
            if self.d.closed:
                raise PoolClosedError("the pool closed before the call could be sent")
            targets = list(range(len(self.d.nodes)) if ranks is None else ranks)
            gone = [r for r in targets if r in self.d.gone]
            if self.d.replacer is None:
                gone += [
                    r
                    for r in targets
                    if self.d.nodes[r].state is not NodeState.READY and r not in gone
                ]
            gated = self.d.gated  # (explicit ranks only) sent whole when the gate opens
            if not gone and not gated:
                self.d.placing += 1  # the gate waits for this broadcast to be sent
        if gone:
            raise self.gone_error(sorted(gone), "cannot broadcast")
        try:
            key, define = self.encoder.function(call.function)
            payload = self.encoder.payload(call, key, shared=True)
            root = self._fan_out(payload, targets)
            places = [(r, w) for r in targets for w in range(self.d.procs)]
            batch = Batch(len(places))
            subs = [
                self.encoder.submission(call, payload, key, define, pinned=True, batch=batch)
                for _ in places
            ]
            for (_, worker), sub in zip(places, subs, strict=True):
                sub.siblings, sub.generation, sub.worker = subs, self.d.generation, worker
                sub.any_slot = any_slot and self.d.procs == 1
            pinned = [rank for rank, _ in places]
            if gated:
                with self.d.lock:
                    self.d.gated_calls.append((subs, pinned))
                return subs
            if root is not None:  # the tree's root last: see _fan_out
                order = sorted(range(len(subs)), key=lambda i: pinned[i] == root)
                self.place_all([subs[i] for i in order], [pinned[i] for i in order])
            else:
                self.place_all(subs, pinned)
        finally:
            if not gated:
                with self.d.lock:
                    self.d.placing -= 1
        return subs

    def _fan_out(self, payload: Payload, targets: list[int]) -> int | None:
        """Relay ``payload`` from node to node when it is large and goes to many remote
        nodes (``fanout.py``); the rank of the tree's root, to send to last (the others'
        small frames go first, so that they are ready when the bytes flow), or None."""
        nodes = [self.d.nodes[r] for r in dict.fromkeys(targets)]
        nodes = [n for n in nodes if n.state is NodeState.READY and fanout.eligible(n)]
        if not nodes or not fanout.worth_it(payload.size(), len(nodes)):
            return None
        payload.fanout = fanout.Fanout(payload.parts(False), nodes)
        return nodes[0].rank

    def place_all(self, subs: list[Submission], ranks: list[int]) -> None:
        """Send the calls of a broadcast, each to the node at its rank."""
        try:
            for sub, rank in zip(subs, ranks, strict=True):
                self.place(sub, rank)
        except BaseException:
            for sub in subs:
                if sub.node is None and not self.parked(sub):
                    sub.payload.release()
                    self.d.by_future.pop(id(sub.future), None)
            raise

    def parked(self, sub: Submission) -> bool:
        with self.d.lock:
            return any(sub in subs for subs in self.d.waiting.values())

    def gone_error(self, ranks: list[int], what: str) -> PoolClosedError:
        reasons = "; ".join(f"node {r}: {self.d.gone.get(r) or 'lost'}" for r in ranks)
        names = ", ".join(self.d.nodes[r].name for r in ranks)
        if all(r in self.d.replacing for r in ranks):  # (see Recovery.down)
            back = "cannot take calls until it is back"
            return PoolClosedError(f"{what}: {names} {back} ({reasons})")
        return PoolClosedError(f"{what}: {names} can no longer take calls ({reasons})")
