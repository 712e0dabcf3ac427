"""The JAX plugin: ``jax.distributed`` initialised across the pool's nodes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigurationError
from .._info import InstanceInfo
from ._base import Plugin
from ._env import environ, global_rank, host_port, world_size
from ._extend import extend

COORDINATOR_PORT_OFFSET = 1
"""The JAX coordinator listens on ``head_port + 1`` of the head node.

``head_port`` itself is torch's ``MASTER_PORT``: the offset lets ``plugins.torch()`` and
``plugins.jax()`` share a pool. (``head_port`` and the 63 ports after it are checked free
on the head node when the pool starts.)
"""


def coordinator_address(info: InstanceInfo) -> str:
    """``head_addr:head_port+1``, the JAX coordinator's address."""
    return host_port(info.head_addr, info.head_port + COORDINATOR_PORT_OFFSET)


def local_device_ids(info: InstanceInfo) -> list[int] | None:
    """The accelerators this process uses, when a node runs several processes.

    With ``procs_per_node`` P > 1 and A accelerators per node, local rank r gets the r-th
    of P equal slices (one device each when A == P). None means every local device (one
    process per node, or CPU nodes).
    """
    procs, count = info.procs_per_node, max(1, int(info.accelerators)) if info.accelerators else 0
    if procs <= 1 or count <= 0:
        return None
    per = max(count // procs, 1)
    first = (info.local_rank * per) % count
    return list(range(first, min(first + per, count)))


def jax_env(info: InstanceInfo) -> dict[str, str]:
    """The ``JAX_*`` variables of this process (one JAX process per pool process).

    ``JAX_LOCAL_DEVICE_COUNT`` is informational: the accelerators this process uses, or 1
    on CPU nodes (JAX's default of one CPU device per process).
    """
    ids = local_device_ids(info)
    devices = len(ids) if ids is not None else info.accelerators
    return {
        "JAX_COORDINATOR_ADDRESS": coordinator_address(info),
        "JAX_NUM_PROCESSES": str(world_size(info)),
        "JAX_PROCESS_ID": str(global_rank(info)),
        "JAX_LOCAL_DEVICE_COUNT": str(max(devices, 1)),
    }


def is_distributed(info: InstanceInfo) -> bool:
    """Whether this pool needs ``jax.distributed`` (cluster mode, two or more processes)."""
    return info.cluster and world_size(info) > 1


def check_cluster(plugin: str, cluster: Any) -> None:
    """Refuse a multi-node standalone pool (``Options(cluster=False)``) before it starts."""
    options = getattr(cluster, "options", None)
    if getattr(cluster, "nodes", 1) > 1 and not getattr(options, "cluster", True):
        raise ConfigurationError(
            f"plugin {plugin!r} on {cluster.nodes} nodes needs cluster mode (nodes that know "
            "each other), but the pool has Options(cluster=False): remove the plugin, use "
            "cluster=True, or use one node"
        )


@contextmanager
def distributed(info: InstanceInfo) -> Iterator[None]:
    """Set the ``JAX_*`` variables, ``jax.distributed.initialize()``; shut down on exit.

    Does nothing but yield when ``jax.distributed`` is already initialised in this process
    (another plugin did it) or the pool has a single node.
    """
    if not is_distributed(info):
        yield
        return
    env = jax_env(info)
    with environ(env):
        import jax

        jax_distributed: Any = jax.distributed  # (its shutdown() is untyped)
        if jax_distributed.is_initialized():
            yield
            return
        jax_distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=world_size(info),
            process_id=global_rank(info),
            local_device_ids=local_device_ids(info),
            cluster_detection_method="deactivate",  # everything is given: no auto-detection
        )
        try:
            yield
        finally:
            jax_distributed.shutdown()


@dataclass(frozen=True)
class JaxPlugin(Plugin):
    """See :func:`flotilla.plugins.jax`."""

    name = "jax"
    forms_group = True

    def transform(self, image: Any, cluster: Any) -> Any:
        """Add ``jax`` (``jax[cuda12]`` with a CUDA accelerator) to the image."""
        check_cluster(self.name, cluster)
        accelerator = getattr(cluster, "accelerator", None)
        cuda = accelerator is not None and bool(getattr(accelerator, "cuda", False))
        return extend(image, pip=["jax[cuda12]" if cuda else "jax"])

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[None] | None:
        """Initialise ``jax.distributed`` across the pool; nothing for a single process."""
        return distributed(info) if is_distributed(info) else None
