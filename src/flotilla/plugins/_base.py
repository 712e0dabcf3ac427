"""The plugin interface.

A plugin is a small object with optional hooks, applied in the order given to ``Compute``:

``transform(image, cluster) -> image``
    Client side, before node environments are built: add packages, indexes, env vars.
``around_process(info) -> context manager | None``
    Node side, entered once per executor process before its first task (with the node's
    :class:`~flotilla.InstanceInfo`) and exited when the executor shuts down. Set
    environment variables and initialise the framework here (``init_process_group``...).

A plugin that only makes sense in cluster mode sets ``requires_cluster = True``; pools with
``Options(cluster=False)`` then refuse it before anything starts. A plugin that sets
``procs_per_node = P`` (None: one per accelerator of the pool) makes every node run P
executor processes (local ranks 0..P-1, in
``InstanceInfo.local_rank``); a broadcast then runs once per process and returns
``nodes * P`` results in global rank order (``node * P + local_rank``). Plugins travel to the
nodes pickled, so keep their state small and picklable.

A plugin whose hook imports a framework that is slow to import (torch: seconds of CPU) names
its modules in ``preload``: each node's agent imports them once, before it forks its
executor processes, in the executors' environment (the Image's packages, the pool's
variables), so every executor process, and every process a group restart starts again, has
them already. Name only modules that start no threads as they are imported (a fork keeps
the calling thread alone), and set what a framework reads at import time (``OMP_*``...)
in the Image's environment, not in ``around_process``: set there, a preloaded framework has
read it already (the torch plugin applies its thread count itself).

A plugin whose processes form one communication group (a torch process group, JAX's
distributed runtime, a TensorFlow collective) sets ``forms_group = True``. A lone replacement
process could not rejoin such a group, so in such a pool (with two or more processes) a
call that dies, times out or is cancelled while running, or one that raises while other
processes of the same broadcast still run (they may wait for it in a collective), restarts
every process of the pool, as torchrun restarts all workers: the calls the others were
running or had queued end with a WorkerDiedError naming the cause, and the pool carries on
with a fresh group. A broadcast call is not retried there (``retries``): run the broadcast
again.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from .._info import InstanceInfo


class Plugin:
    """Base class for plugins; every hook is optional."""

    name: str = "plugin"
    requires_cluster: bool = False
    procs_per_node: int | None = 1
    forms_group: bool = False
    preload: tuple[str, ...] = ()

    def transform(self, image: Any, cluster: Any) -> Any:
        """Return the image the nodes should build (client side)."""
        return image

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[Any] | None:
        """Context entered once per executor process (node side)."""
        return None

    def around_pool(self, pool: Any) -> AbstractContextManager[Any] | None:
        """Context entered on the client once the pool runs, in the thread that opened it,
        and exited when it closes (``pool`` is the running ``Compute``)."""
        return None
