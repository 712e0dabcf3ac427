"""Broadcasts that fan out: a large payload reaches many remote nodes through a tree of
nodes instead of one upload per node (the nodes' side, the trust model and the relay
handshake: ``_node/relay.py``).

For a broadcast whose payload is at least :data:`MIN_BYTES` to at least :data:`MIN_NODES`
remote nodes (nodes that do not share the client's ``/dev/shm``, each with a relay port):

1. the payload's wire form is hashed once (sha256);
2. the nodes, in rank order, form a tree of :data:`DEGREE` children per node: node 0 gets
   the payload from the client (BLOB frames on its channel, in chunks, so that it relays
   the first bytes before the last have come), every other node a FETCH naming its parent
   (address, relay port) and the payload's reference (its hash and the broadcast's
   number); the calls themselves are TASKREF frames that name the payload by reference.
   The client writes to the other nodes first (small frames) and to node 0 last: its
   upload is one copy whatever the size of the pool;
3. a node reports (HAVE) when it holds the payload, checked against the hash, or that its
   fetch failed: then the client sends it the payload itself (FETCH without parent, then
   BLOB frames), from a worker thread. Correctness never depends on the tree: a node whose
   payload cannot be delivered even so is lost (NodeLostError for its calls);
4. when the broadcast's calls have all ended, the nodes drop the payload (DROP).

A node that was not in the tree (a replacement, a node that joined later) gets the whole
TASK frame, as every broadcast did before.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._wire.frames import Buffer, Kind, frame

if TYPE_CHECKING:
    from .node import Node

logger = logging.getLogger("flotilla")

MIN_BYTES = 1 << 20
"""Payloads smaller than this go to every node directly (the direct path costs less)."""
MIN_NODES = 4
"""Broadcasts to fewer remote nodes than this go to every node directly."""
DEGREE = 4
"""Children per node in the tree."""
CHUNK = 1 << 20
"""Bytes per BLOB frame."""
DIRECT_TRIES = 3
"""Times the client sends a node the payload itself before the node counts as lost."""

_BLOB_HEAD_SIZE = 48  # reference + offset u64 (_node/relay.py's BLOB_HEAD)
_broadcasts = itertools.count(1)


def eligible(node: Node) -> bool:
    """Whether ``node`` can take part in a fan-out (remote, with a relay port)."""
    return not node.shm and bool(node.ready_info.get("relay_port"))


def worth_it(size: int, nodes: int) -> bool:
    return size >= MIN_BYTES and nodes >= MIN_NODES


class Fanout:
    """One broadcast's payload on its way through the tree (see the module docstring)."""

    def __init__(self, parts: Sequence[Buffer], nodes: Sequence[Node]) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.size = sum(p.nbytes for p in self.parts)
        hasher = hashlib.sha256()
        for p in self.parts:
            hasher.update(p)
        self.ref = hasher.digest() + next(_broadcasts).to_bytes(8, "little")
        """The payload's reference: its sha256 and this broadcast's number (a node's copy
        and its drop belong to one broadcast, even when another sends the same bytes)."""
        self.nodes = list(nodes)
        self.parent: dict[Node, Node | None] = {
            node: None if q == 0 else nodes[(q - 1) // DEGREE] for q, node in enumerate(nodes)
        }
        self.lock = threading.Lock()
        self.told: list[Node] = []
        self.direct: dict[Node, int] = {}  # times the client sent the payload itself

    @property
    def root(self) -> Node:
        return self.nodes[0]

    def announce(self, node: Node) -> list[Buffer] | None:
        """The frames that tell ``node`` how it gets the payload ([] when it was told
        already); None when ``node`` is not in the tree (it gets the whole TASK frame).
        Called with ``node``'s write lock held."""
        if node not in self.parent:
            return None
        if self.ref in node.blobs:
            return []
        node.blobs[self.ref] = self
        with self.lock:
            self.told.append(node)
        parent = self.parent[node]
        if parent is None:
            return self._from_client()
        where = [parent.proc.address, int(parent.ready_info["relay_port"])]
        info = {"ref": self.ref.hex(), "size": self.size, "parent": where}
        return frame(Kind.FETCH, 0, json.dumps(info).encode())

    def _from_client(self) -> list[Buffer]:
        info = {"ref": self.ref.hex(), "size": self.size, "parent": None}
        out = frame(Kind.FETCH, 0, json.dumps(info).encode())
        offset = 0
        for part in self.parts:
            for start in range(0, part.nbytes, CHUNK):
                piece = part[start : start + CHUNK]
                head = self.ref + offset.to_bytes(8, "little")
                assert len(head) == _BLOB_HEAD_SIZE
                out += frame(Kind.BLOB, 0, head, piece)
                offset += piece.nbytes
        return out

    def send_direct(self, node: Node, why: str) -> None:
        """``node`` could not get the payload through the tree (``why``): the client sends
        it itself (in a worker thread: the write may take a while); after
        :data:`DIRECT_TRIES` failed tries the node is lost."""
        with self.lock:
            tries = self.direct[node] = self.direct.get(node, 0) + 1
        if tries > DIRECT_TRIES:
            loop = node.loop
            if loop is not None:
                loss = f"could not be sent a broadcast's payload ({why})"
                loop.call_soon_threadsafe(node.gone, loss)
            return
        logger.info("%s: the relayed payload did not come (%s); sent directly", node.name, why)
        frames = self._from_client()
        with node.write_lock:
            try:
                node.proc.write(frames, node.give_up)
            except OSError:
                pass  # the node is lost: its calls are failed or sent elsewhere

    def release(self) -> None:
        """Every call of the broadcast ended: the nodes drop the payload."""
        with self.lock:
            told, self.told = self.told, []
        for node in told:
            node.blobs.pop(self.ref, None)
        left = [n for n in told if not n.send_control(Kind.DROP, wait=False, body=self.ref)]
        if left:
            from .loop import get_loop

            def drop() -> None:
                for node in left:
                    node.send_control(Kind.DROP, body=self.ref)

            get_loop().call_soon_threadsafe(get_loop().run_in_executor, None, drop)
