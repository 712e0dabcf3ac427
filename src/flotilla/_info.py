"""Where a task runs: :class:`InstanceInfo` and :func:`instance_info`.

Each executor process gets a ``COMPUTE_POOL`` environment variable holding this node's
place in the pool as JSON; :func:`instance_info` parses it. Outside a pool (a plain script,
``fn.local()``) it returns :data:`SINGLE_NODE`: node 0 of 1, the head, on 127.0.0.1.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import asdict, dataclass

from ._system import fastjson as json

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ENV_VAR = "COMPUTE_POOL"
DEFAULT_HEAD_PORT = 29500


@dataclass(frozen=True, slots=True)
class Peer:
    """One node of the pool as the others see it.

    Attributes:
        node: the node's rank, 0 to total_nodes - 1.
        addr: the address other nodes use to reach it (a private address on clouds).
        host: its host name, or the address when the provider knows no name.
    """

    node: int
    addr: str
    host: str = ""


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """This node's place in the pool.

    Attributes:
        node: this node's rank, 0 to ``total_nodes - 1`` (SLURM's rank, MPI's comm rank).
        total_nodes: number of nodes in the pool (MPI's world size).
        is_head: True on node 0 (also in standalone mode, as in Skyward).
        head_addr: the address of node 0, reachable from every node ('' in standalone mode).
        head_port: a port free on node 0 for the frameworks' rendezvous (MASTER_PORT); the
            63 ports after it were free there too when the pool started (plugins use them).
        accelerators: number of accelerators (GPUs) on this node (a fraction, e.g. 0.5,
            for a slice of one: Skyward's fractional accelerators).
        peers: every node with its address, in rank order (empty in standalone mode).
        pool_id: identifier of the pool, unique per ``Compute`` block.
        addr: this node's own address (as listed in ``peers``).
        cluster: False in standalone mode (``Options(cluster=False)``): no peers, no head
            address.
        accelerator: the accelerator type name (e.g. "A100"), or None.
        local_rank: this process's rank on its node (0 unless a plugin asks for several
            processes per node, as ``plugins.torch(procs_per_node=...)`` does).
        procs_per_node: processes per node running each broadcast call.
        worker: Skyward's: this process's task slot on its node, 0 to
            ``workers_per_node - 1`` (``Worker(concurrency=...)``; also the local rank of
            a plugin's processes).
        workers_per_node: task slots per node (``Worker(concurrency=...)``, or the
            processes a plugin runs per node).
    """

    node: int
    total_nodes: int
    is_head: bool
    head_addr: str
    head_port: int
    accelerators: int | float
    peers: tuple[Peer, ...]
    pool_id: str
    addr: str = "127.0.0.1"
    cluster: bool = True
    accelerator: str | None = None
    local_rank: int = 0
    procs_per_node: int = 1
    worker: int = 0
    workers_per_node: int = 1

    @property
    def global_worker_index(self) -> int:
        """This worker's index in the pool, 0 to ``total_workers - 1``."""
        return self.node * self.workers_per_node + self.worker

    @property
    def total_workers(self) -> int:
        """Worker slots (task processes) in the pool."""
        return self.total_nodes * self.workers_per_node

    def to_json(self) -> str:
        """The ``COMPUTE_POOL`` representation."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> InstanceInfo:
        """Parse a ``COMPUTE_POOL`` value."""
        data: dict[str, Any] = json.loads(text)
        data["peers"] = tuple(Peer(**p) for p in data.get("peers", ()))
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


SINGLE_NODE = InstanceInfo(
    node=0,
    total_nodes=1,
    is_head=True,
    head_addr="127.0.0.1",
    head_port=DEFAULT_HEAD_PORT,
    accelerators=0,
    peers=(Peer(0, "127.0.0.1", "localhost"),),
    pool_id="local",
)
"""What :func:`instance_info` returns outside a pool: a one-node cluster on this machine."""

_cache: dict[str, InstanceInfo] = {}


def in_task() -> bool:
    """Whether this process runs a pool's tasks (an executor on a node, or a fork a task
    made): the executor says so in its own module (``serving``), which every such process
    has loaded (the executor imports this module only when it needs it: not at its
    start)."""
    executor = sys.modules.get("flotilla._node.executor")
    return bool(getattr(executor, "serving", False))


_thread = threading.local()


def set_thread_pool(raw: str) -> None:
    """This thread's ``COMPUTE_POOL`` (a thread slot of ``Worker(executor="thread")``: its
    own ``worker`` in a process shared with the node's other slots)."""
    _thread.pool = raw


def instance_info() -> InstanceInfo:
    """This process's place in the pool, read from ``COMPUTE_POOL`` (a thread slot's own,
    see :func:`set_thread_pool`).

    Outside a pool (and in ``fn.local()``) returns :data:`SINGLE_NODE`. Never raises for a
    missing variable; a malformed one raises ValueError naming the variable.
    """
    raw = getattr(_thread, "pool", None) or os.environ.get(ENV_VAR)
    if not raw:
        return SINGLE_NODE
    info = _cache.get(raw)
    if info is None:
        try:
            info = InstanceInfo.from_json(raw)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"{ENV_VAR} is not a valid pool description ({e}): {raw[:200]!r}"
            ) from e
        _cache.clear()
        _cache[raw] = info
    return info
