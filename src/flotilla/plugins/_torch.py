"""The PyTorch plugin: torch wheels in the image, ``torch.distributed`` ready on the nodes."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .._errors import ConfigurationError
from .._info import InstanceInfo
from ._base import Plugin
from ._env import environ, global_rank, group_setting, unless_set, world_size
from ._extend import extend
from ._net import interface_for, wait_listening
from ._versions import requirement

WHEEL_INDEX = "https://download.pytorch.org/whl/{}"
"""PyTorch's wheel index; ``{}`` is the ``cuda`` suffix ("cu128") or "cpu"."""

BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl")

GROUP_KEY = "flotilla/group/{}"
"""Set in the group's store (on ``head_port``) by its rank 0, with the group's generation
(its restarts so far): the other ranks join only the store that has their generation's key.
A group restarts node by node (each agent starts its new processes once its old ones are
gone), so a new rank may find the old group's store still there, its rank 0 not killed yet:
joining it paired the rank with the old rank 0, and the new rank 0 waited for it for good."""
JOIN_RETRY = 0.05
"""Seconds between two attempts to join the group's store (the last one ended or failed)."""


def rank_env(info: InstanceInfo, local_rank: int = 0, procs_per_node: int = 1) -> dict[str, str]:
    """The torchrun-style variables of one process of the pool.

    Process ``local_rank`` of node ``info.node`` gets global rank
    ``node * procs_per_node + local_rank`` out of ``total_nodes * procs_per_node``;
    the rendezvous is on the head node (``head_addr:head_port``).
    """
    if procs_per_node < 1:
        raise ConfigurationError(f"procs_per_node must be at least 1, got {procs_per_node}")
    if not 0 <= local_rank < procs_per_node:
        raise ConfigurationError(f"local_rank must be in 0..{procs_per_node - 1}, got {local_rank}")
    return {
        "MASTER_ADDR": info.head_addr,
        "MASTER_PORT": str(info.head_port),
        "WORLD_SIZE": str(info.total_nodes * procs_per_node),
        "RANK": str(info.node * procs_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(procs_per_node),
        "NODE_RANK": str(info.node),
    }


def socket_ifname_env(addr: str) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for the interface carrying ``addr``.

    Only the variables the user has not set; nothing when no local interface carries it.
    """
    name = interface_for(addr)
    if name is None:
        return {}
    return unless_set({"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name})


def threads_env(info: InstanceInfo) -> dict[str, str]:
    """``OMP_NUM_THREADS=1`` when several ranks of the pool share this machine.

    What torchrun does for several workers per node: each rank would otherwise use every
    core for its intra-op threads and the ranks would oversubscribe the machine. Ranks
    share a machine when their nodes have the same address (the local provider's nodes),
    or when a node runs several processes. Nothing when the user has set the variable.
    """
    nodes_here = sum(1 for peer in info.peers if peer.addr == info.addr) or 1
    if nodes_here * info.procs_per_node < 2:
        return {}
    return unless_set({"OMP_NUM_THREADS": "1"})


@dataclass(frozen=True)
class TorchPlugin(Plugin):
    """See :func:`flotilla.plugins.torch`."""

    backend: str | None = None
    cuda: str = "cu128"
    version: str = "latest"
    vision: str | None = None
    audio: str | None = None
    procs_per_node: int | None = None

    name = "torch"
    requires_cluster = True
    forms_group = True
    preload = ("torch", "torch._dynamo", "torch.distributed")  # see _process_group

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigurationError(
                f"torch backend must be one of {', '.join(BACKENDS)} or None (auto), "
                f"got {self.backend!r}"
            )
        if not isinstance(self.cuda, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", self.cuda):
            raise ConfigurationError(
                f"cuda must be a wheel index suffix such as 'cu128', got {self.cuda!r}"
            )
        if self.procs_per_node is not None and (
            isinstance(self.procs_per_node, bool)
            or not isinstance(self.procs_per_node, int)
            or self.procs_per_node < 1
        ):
            raise ConfigurationError(
                f"procs_per_node must be a positive integer, got {self.procs_per_node!r}"
            )
        self.requirements()  # a bad version is an error now, not on the nodes

    def requirements(self) -> list[str]:
        """The pip requirements: torch, and torchvision/torchaudio when asked for."""
        reqs = [requirement("torch", self.version, "torch version")]
        if self.vision is not None:
            reqs.append(requirement("torchvision", self.vision, "vision (torchvision version)"))
        if self.audio is not None:
            reqs.append(requirement("torchaudio", self.audio, "audio (torchaudio version)"))
        return reqs

    def index_url(self, cluster: Any) -> str:
        """The CUDA wheel index when the pool's accelerator runs CUDA, the CPU one otherwise."""
        accelerator = getattr(cluster, "accelerator", None)
        cuda = accelerator is not None and bool(getattr(accelerator, "cuda", False))
        return WHEEL_INDEX.format(self.cuda if cuda else "cpu")

    def transform(self, image: Any, cluster: Any) -> Any:
        """Add torch (+ vision/audio) and the matching wheel index to the image: that
        index serves these packages only, not the image's others."""
        url = self.index_url(cluster)
        names = [re.split(r"[\s\[<>=!~;@]", r, maxsplit=1)[0] for r in self.requirements()]
        return extend(
            image, pip=self.requirements(), pip_indexes=[url], index_packages={url: names}
        )

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[None] | None:
        """Initialise the default process group; nothing for a single process."""
        if not info.cluster or world_size(info) < 2:
            return None
        return self._process_group(info)

    @contextmanager
    def _process_group(self, info: InstanceInfo) -> Iterator[None]:
        # the pool's processes per node: this plugin's procs_per_node, or more if another
        # plugin asked for more (every process of the pool is a rank)
        local_rank = info.local_rank
        env = rank_env(info, local_rank, info.procs_per_node)
        env.update(socket_ifname_env(info.addr))
        env.update(threads_env(info))
        with environ(env):
            import torch

            # torch._dynamo is imported by DDP's constructor and by every optimizer's first
            # step: a second of CPU. Here it is imported while the executor has the garbage
            # collector paused (enter_plugins), a third faster than in the user's code. All
            # three are usually imported already: the agent preloads them (preload above),
            # before OMP_NUM_THREADS is set here, so its value is applied explicitly.
            import torch._dynamo
            import torch.distributed as dist

            if "OMP_NUM_THREADS" in env:
                torch.set_num_threads(int(env["OMP_NUM_THREADS"]))

            cuda = torch.cuda.is_available()
            backend = self.backend or ("nccl" if cuda else "gloo")
            if cuda and torch.cuda.device_count() > 0:
                torch.cuda.set_device(local_rank % torch.cuda.device_count())
            created = False
            if not dist.is_initialized():
                rank, size = global_rank(info), world_size(info)
                store = group_store(info, rank, size, backend)
                dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size)
                created = True
            try:
                yield
            finally:
                if created and dist.is_initialized():
                    dist.destroy_process_group()


def group_store(info: InstanceInfo, rank: int, size: int, backend: str) -> Any:
    """The group's store, as ``init_process_group(init_method="env://")`` makes it (rank 0
    hosts it on ``MASTER_ADDR:MASTER_PORT``, the others are its clients), of this
    generation of the group (see :data:`GROUP_KEY`). A rank other than 0 waits for it up
    to the pool's start timeout, then fails saying what it found."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_timeout

    TCPStore = dist.TCPStore  # type: ignore[attr-defined]  # (set where c10d is built)

    default = _get_default_timeout(dist.Backend(backend))  # (env:// gives its store this timeout)
    generation = int(group_setting("generation", 0))
    key = GROUP_KEY.format(generation)
    host, port = info.head_addr, info.head_port
    if rank == 0:
        try:
            store = TCPStore(
                host,
                port,
                size,
                is_master=True,
                timeout=default,
                multi_tenant=True,
                wait_for_workers=False,
            )
        except RuntimeError as e:
            raise RuntimeError(
                f"node 0 cannot start the torch group's store on port {port} (MASTER_PORT): "
                f"{_first_line(e)}; another process may hold the port"
            ) from e
        store.set(key, str(generation))
        return store
    timeout = float(group_setting("start_timeout", 0.0)) or default.total_seconds()
    deadline = time.monotonic() + timeout
    found = "nothing listened there"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(
                f"rank {rank} found no store of its group (generation {generation}) at "
                f"{host}:{port} (MASTER_ADDR:MASTER_PORT) within {timeout:g} s "
                f"(Options(start_timeout=...)); last: {found}. Rank 0 (node 0) did not start "
                "it, or another process holds the port"
            )
        if not wait_listening(host, port, left):
            continue
        try:
            store = TCPStore(
                host,
                port,
                size,
                is_master=False,
                timeout=timedelta(seconds=left),
                wait_for_workers=False,
            )
            store.wait([key])  # (on the old group's store: until that store is gone)
        except RuntimeError as e:  # (torch's DistError: the store ended, or timed out)
            found = _first_line(e)
            time.sleep(JOIN_RETRY)
            continue
        store.set_timeout(default)
        return store


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
