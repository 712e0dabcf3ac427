"""The TensorFlow plugin: ``TF_CONFIG`` for ``tf.distribute.MultiWorkerMirroredStrategy``."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from .._info import InstanceInfo
from ._base import Plugin
from ._env import environ, global_rank, host_port, world_size
from ._extend import extend

WORKER_PORT_OFFSET = 2
"""Worker ``k`` (the pool's process of global rank ``k``) listens on ``head_port + 2 + k``.

``head_port`` is torch's ``MASTER_PORT`` and ``head_port + 1`` the JAX coordinator's, so
the three plugins can share a pool. Adding the rank keeps the ports distinct when several
workers share an address (the local provider, several processes per node). The head
node's ``head_port .. head_port + 63`` are checked free when the pool starts (so the ports
of up to 61 workers on one machine are: ``head_port + 63`` is the head's agent's, for the
nodes' rendezvous pre-flight); other nodes' ports are not checked.
"""


def worker_port(info: InstanceInfo, rank: int) -> int:
    """The port of the TensorFlow server of the worker with global rank ``rank``."""
    return info.head_port + WORKER_PORT_OFFSET + rank


def tf_config(info: InstanceInfo) -> dict[str, Any]:
    """The ``TF_CONFIG`` of this process: every worker's address, and this one's index.

    One worker per process of the pool, in global rank order (``node * P + local_rank``).
    """
    procs = info.procs_per_node
    workers = [
        host_port(peer.addr, worker_port(info, peer.node * procs + local))
        for peer in info.peers
        for local in range(procs)
    ]
    return {
        "cluster": {"worker": workers},
        "task": {"type": "worker", "index": global_rank(info)},
    }


@dataclass(frozen=True)
class TensorflowPlugin(Plugin):
    """See :func:`flotilla.plugins.tensorflow`."""

    name = "tensorflow"
    requires_cluster = True
    forms_group = True

    def transform(self, image: Any, cluster: Any) -> Any:
        """Add ``tensorflow`` (``tensorflow[and-cuda]`` with a CUDA accelerator)."""
        accelerator = getattr(cluster, "accelerator", None)
        cuda = accelerator is not None and bool(getattr(accelerator, "cuda", False))
        return extend(image, pip=["tensorflow[and-cuda]" if cuda else "tensorflow"])

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[None] | None:
        """Set ``TF_CONFIG``; nothing for a single process."""
        if not info.cluster or world_size(info) < 2:
            return None
        return environ({"TF_CONFIG": json.dumps(tf_config(info))})
