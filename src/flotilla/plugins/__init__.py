"""Built-in plugins: ready-made distributed setups for common frameworks.

    import flotilla as sky
    from flotilla import plugins

    with sky.Compute(nodes=4, plugins=[plugins.torch()]) as pool:
        results = train() @ pool      # torch.distributed is initialised on every node

Plugins are applied in the order given. Combine them freely; ports do not collide:
``torch`` rendezvouses on the head node's ``head_port``, the ``jax`` coordinator on
``head_port + 1``, TensorFlow worker ``k`` on ``head_port + 2 + k``, Ray's head on
``head_port + 16``, Dask's scheduler on ``head_port + 17``; the head's agent answers the
nodes' rendezvous pre-flight on ``head_port + 63``. The head's agent found the 64 ports
from ``head_port`` free when the pool started. ``ray()`` refuses ``torch()`` and
``accelerate()`` in the same pool (a plugin may define ``check_plugins(plugins)``, called
with the pool's plugins before anything starts, to refuse a combination).

Writing your own plugin
-----------------------
A plugin is any picklable object with one or both of these optional methods (subclass
:class:`flotilla.Plugin` to get defaults for both):

``transform(image, cluster) -> image``
    Runs on the client before the nodes are built. ``cluster`` is the
    :class:`~flotilla.PoolSpec` (``.nodes``, ``.accelerator``, ``.options``); ``image`` is
    the pool's ``flotilla.Image`` or None. Return a new image (``dataclasses.replace``) with
    your packages added; never mutate the one you are given. Raise
    :class:`~flotilla.ConfigurationError` to refuse a pool you cannot serve.
``around_process(info) -> context manager | None``
    Runs on every node, in each executor process, once, before its first task, with the
    node's :class:`~flotilla.InstanceInfo` (``node``, ``total_nodes``, ``head_addr``,
    ``head_port``, ``peers``, ``addr``...). Set environment variables and initialise your
    framework when the context is entered; tear down when it exits (the pool is closing).
    Return None when there is nothing to do. Import heavy frameworks inside this method,
    not at module level: the client may not have them installed. The hooks run with the
    garbage collector paused (imports are faster so), and what exists when the last one
    has returned is frozen (``gc.freeze``); tasks run with the collector on.

``around_pool(pool) -> context manager | None``
    Runs on the client, in the thread that opened the pool, once it runs; exited when the
    pool closes (before its nodes stop). ``pool`` is the running :class:`~flotilla.Compute`:
    point a library at it here (the joblib plugin makes ``joblib.Parallel`` use it).

Set ``requires_cluster = True`` on a plugin that needs nodes that know each other: pools
with ``Options(cluster=False)`` then refuse it before starting anything. Set
``procs_per_node = P`` to have every node run P processes (``info.local_rank`` 0..P-1,
``info.procs_per_node``); ``around_process`` then runs in each of them. Keep a plugin's
state small: it is pickled and sent to every node.

Example::

    import contextlib, os
    import flotilla as sky

    class Horovod(sky.Plugin):
        name = "horovod"
        requires_cluster = True

        @contextlib.contextmanager
        def _setup(self, info):
            os.environ["HOROVOD_RANK"] = str(info.node)
            yield

        def around_process(self, info):
            return self._setup(info)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # each plugin's module is imported when it is made: a node's executor
    # imports this package (``_base``) without paying for every plugin
    from ._accelerate import AcceleratePlugin
    from ._dask import DaskPlugin
    from ._gpu import CumlPlugin, MigPlugin, MpsPlugin
    from ._huggingface import HuggingfacePlugin
    from ._jax import JaxPlugin
    from ._joblib import JoblibPlugin
    from ._keras import KerasPlugin
    from ._ray import RayPlugin
    from ._tensorflow import TensorflowPlugin
    from ._torch import TorchPlugin

__all__ = [
    "accelerate",
    "cuml",
    "dask",
    "huggingface",
    "jax",
    "joblib",
    "keras",
    "mig",
    "mps",
    "ray",
    "sklearn",
    "tensorflow",
    "torch",
]


def torch(
    backend: str | None = None,
    cuda: str = "cu128",
    version: str = "latest",
    vision: str | None = None,
    audio: str | None = None,
    procs_per_node: int | None = None,
) -> TorchPlugin:
    """PyTorch: installs torch and initialises ``torch.distributed`` on every node.

    Args:
        backend: process group backend; None picks "nccl" when CUDA is available on the
            node and "gloo" otherwise.
        cuda: CUDA suffix of PyTorch's wheel index (``download.pytorch.org/whl/{cuda}``),
            used when the pool's accelerator runs CUDA; other pools use the CPU index.
        version: "latest" (unpinned), a version ("2.3.0", pinned with ``==``) or a
            constraint (">=2.3", "~=2.4", ">=2.3,<2.5"). Invalid: ValueError, here.
        vision: torchvision version, same forms; None does not install it.
        audio: torchaudio version, same forms; None does not install it.
        procs_per_node: processes (ranks) per node. Every node then runs that many
            executor processes, each a rank (``node * procs_per_node + local_rank``), and a
            broadcast returns one result per rank, in rank order. None (the default): one
            per accelerator of the pool (``accelerator="A100:8"``: 8), as torchrun's
            ``--nproc_per_node=gpu``; one on a pool without accelerators.

    In each process, for two or more ranks in all, it sets ``MASTER_ADDR`` (the head's
    address), ``MASTER_PORT`` (``head_port``), ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` and ``NODE_RANK``, and ``GLOO_SOCKET_IFNAME`` /
    ``NCCL_SOCKET_IFNAME`` (the interface carrying the node's address) unless already set,
    and, as torchrun does, ``OMP_NUM_THREADS=1`` unless set when several ranks share a
    machine (local nodes, ``procs_per_node > 1``);
    then calls ``torch.distributed.init_process_group(backend, store=...)`` once per
    process with the store ``init_method="env://"`` would make (rank 0 hosts it on
    ``MASTER_PORT``), and ``destroy_process_group()`` when the pool closes. Ranks other
    than 0 wait for rank 0's store to listen before they join (torch's own retry would
    add up to a second), and join only the store of their own group: after a group
    restart, the old rank 0's store may still be there a moment (each node starts its new
    processes once its own old ones are gone); they wait for the new one, up to the
    pool's start timeout, then fail saying what they found. ``torch._dynamo``, which
    DDP's constructor and the first optimizer step import, is imported during this setup,
    where it is a third cheaper. A single rank gets no setup. Needs cluster mode.
    """
    from ._torch import TorchPlugin

    return TorchPlugin(backend, cuda, version, vision, audio, procs_per_node)


def jax() -> JaxPlugin:
    """JAX: installs jax (``jax[cuda12]`` on CUDA pools) and initialises ``jax.distributed``.

    With two or more processes in the pool (nodes, or several processes per node that
    another plugin asked for), each process gets ``JAX_COORDINATOR_ADDRESS`` (the head
    node, port ``head_port + 1`` so that it does not collide with torch's
    ``MASTER_PORT``), ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (its global rank) and
    ``JAX_LOCAL_DEVICE_COUNT``; ``jax.distributed.initialize(...)`` runs before the first
    task and ``jax.distributed.shutdown()`` when the pool closes. Afterwards
    ``jax.devices()`` lists every process's devices. Several nodes need cluster mode; a
    single process gets no setup.
    """
    from ._jax import JaxPlugin

    return JaxPlugin()


def keras(backend: str = "jax") -> KerasPlugin:
    """Keras 3: installs keras and selects its backend before anything imports it.

    Args:
        backend: "jax", "torch" or "tensorflow" (ValueError otherwise), set as
            ``KERAS_BACKEND`` in each node's process.

    With the JAX backend on several nodes it also makes training data-parallel over every
    process's devices: ``keras.distribution.set_distribution(DataParallel(...))``, after
    ``jax.distributed`` is initialised (it initialises it itself when ``plugins.jax()`` is
    not in the pool; with it, either order works). Each node then feeds its own part of
    the data (``flotilla.shard``). For the torch backend, add ``plugins.torch()``.
    """
    from ._keras import KerasPlugin

    return KerasPlugin(backend)


def huggingface(models: Sequence[str] | None = None, token: str | None = None) -> HuggingfacePlugin:
    """HuggingFace: installs transformers, datasets, tokenizers, and accelerate and torch
    (what ``Trainer`` needs); sets ``HF_TOKEN``; fetches ``models`` into each node's cache
    while its environment is built (Skyward's signature).

    Args:
        models: hub repository ids (``["meta-llama/Llama-3.1-8B"]``) downloaded with
            ``huggingface_hub.snapshot_download`` as a setup step of the node's
            environment build, so that ``from_pretrained`` in a task reads them from disk
            (the hub's cache: ``HF_HOME``, default ``~/.cache/huggingface``; the hub is
            ``HF_ENDPOINT`` when set). A build that cannot fetch one fails the pool's start,
            naming it. The environment is built again when the list changes.
        token: a HuggingFace access token, set as ``HF_TOKEN`` in each node's process
            (the hub libraries read it from there) and, with ``models``, in the build that
            fetches them (for gated or private repositories). Never shown in the plugin's
            repr, the build's output or errors.

    For multi-node training, combine with ``plugins.torch()``.
    """
    from ._huggingface import make

    return make(models, token)


def tensorflow() -> TensorflowPlugin:
    """TensorFlow: installs tensorflow and sets ``TF_CONFIG`` for multi-worker training.

    With two or more processes in the pool, each gets ``TF_CONFIG`` as
    ``{"cluster": {"worker": ["addr:port", ...]}, "task": {"type": "worker", "index": k}}``
    with one worker per process in rank order (worker ``k`` on port ``head_port + 2 + k``
    of its node), which is what ``tf.distribute.MultiWorkerMirroredStrategy()`` reads.
    Needs cluster mode.
    """
    from ._tensorflow import TensorflowPlugin

    return TensorflowPlugin()


def accelerate(
    config: Mapping[str, Any] | None = None,
    backend: str | None = None,
    procs_per_node: int | None = None,
) -> AcceleratePlugin:
    """Hugging Face Accelerate: what ``accelerate launch`` would set, in every process.

    Args:
        config: accelerate's settings, shaped like the YAML ``accelerate config`` writes:
            ``{"fsdp": {"sharding_strategy": "FULL_SHARD", ...}}`` turns on FSDP,
            ``{"deepspeed": {"zero_stage": 2, ...}}`` DeepSpeed, ``"mixed_precision"``
            the dtype. Topology (ranks, world size, the head) comes from the pool.
        backend: the process group's backend, as for :func:`torch`.
        procs_per_node: processes per node (default: one per accelerator, else one):
            ``num_processes`` is ``nodes * procs_per_node``.

    Installs torch and accelerate, sets the torch plugin's variables and process group and
    the ``ACCELERATE_*``/``FSDP_*`` variables before the first task, so ``Accelerator()``
    and ``PartialState()`` in a task see the whole pool.
    """
    from ._accelerate import AcceleratePlugin

    return AcceleratePlugin(
        backend=backend, procs_per_node=procs_per_node, config=dict(config or {})
    )


def joblib(version: str = "latest") -> JoblibPlugin:
    """joblib over the pool: inside the pool's ``with`` block, ``joblib.Parallel(n_jobs=-1)``
    sends its batches to the nodes (one worker per process of the pool) instead of local
    processes. Installs joblib on the nodes (``version`` as for :func:`torch`)."""
    from ._joblib import JoblibPlugin

    return JoblibPlugin(version)


def sklearn(version: str = "latest") -> JoblibPlugin:
    """scikit-learn over the pool: every estimator, search and cross-validation run with
    ``n_jobs=-1`` inside the pool's ``with`` block fans out over the nodes (through the
    joblib plugin's backend). Installs scikit-learn and joblib on the nodes."""
    from ._joblib import JoblibPlugin

    return JoblibPlugin(sklearn=version)


def mig(profile: str) -> MigPlugin:
    """NVIDIA MIG: each worker process on its own Multi-Instance GPU slice.

    Args:
        profile: the MIG profile of the slices, e.g. ``"1g.10gb"``, ``"3g.40gb"``.

    The node's environment build enables MIG mode (``nvidia-smi -mig 1``) and creates one
    GPU instance of ``profile`` per worker slot (``Worker(concurrency=N)``: N); before its
    first task, worker process ``k`` gets ``CUDA_VISIBLE_DEVICES`` set to the ``k``-th
    ``MIG-...`` UUID ``nvidia-smi -L`` lists. Needs a MIG-capable GPU (A100, A30, H100)
    and root on the node.
    """
    from ._gpu import MigPlugin

    return MigPlugin(profile)


def mps(
    active_thread_percentage: int | None = None, pinned_memory_limit: str | None = None
) -> MpsPlugin:
    """NVIDIA MPS: the worker processes of a node share its GPUs through the Multi-Process
    Service.

    Args:
        active_thread_percentage: the most of the GPU's compute one process may use (1-100),
            ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``.
        pinned_memory_limit: per-device pinned memory limit, e.g. ``"0=2G"``,
            ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``.

    Each process gets ``CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps`` and
    ``CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log`` (and the two above when given); the
    control daemon (``nvidia-cuda-mps-control -d``) is started before the first task.
    """
    from ._gpu import MpsPlugin

    return MpsPlugin(active_thread_percentage, pinned_memory_limit)


def cuml(cuda: str = "cu12") -> CumlPlugin:
    """RAPIDS cuML: installs ``cuml-<cuda>`` (from ``pypi.nvidia.com``, for that package
    only) and runs ``cuml.accel.install()`` in every process, so that scikit-learn
    estimators run on the GPU unchanged.

    Args:
        cuda: the CUDA suffix of the wheels (``"cu12"``).
    """
    from ._gpu import CumlPlugin

    return CumlPlugin(cuda)


def ray(
    version: str = "latest",
    dashboard: bool = False,
    object_store_memory: int | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    resources: Mapping[str, float] | None = None,
) -> RayPlugin:
    """Ray: a Ray cluster over the pool's nodes, up before the first task, gone with the pool.

    Args:
        version: Ray's version, as for :func:`torch` ("latest", "2.60.0", ">=2.50").
            Installed with the node's own pip/uv configuration (a company mirror applies).
        dashboard: start Ray's dashboard on the head (installs ``ray[default]``); it
            listens on the head's pool address at a free port, printed when the pool starts.
        object_store_memory: bytes of each node's object store (None: Ray's default, 30%
            of memory; at least 75 MiB).
        num_cpus, num_gpus: what each node offers Ray (None: what Ray detects).
        resources: custom resources per node (``{"disk": 1}``).

    Node 0 runs the head (``ray start --head``), every other node a worker node joining it,
    each bound to the node's pool address (on machines with several interfaces, the pool's).
    The head's port comes from the ports found free on the head when the pool started; Ray's
    other ports are the kernel's picks of free ones: a port another process holds is never
    used. The pool runs once every node is alive in the cluster; the head prints its
    address. In tasks, ``RAY_ADDRESS`` is set, so ``ray.init()`` (no address) joins the
    cluster (``ray.init(ignore_reinit_error=True)`` when several tasks share a process).

    Ray's processes stop with the pool (the block's end, Ctrl-C, a dead client through the
    agents' watchdog) and their temp dirs (``/tmp/ray/flotilla-<pool>-<node>``) are
    removed. The Ray cluster is one group: a lost node replaced, or a restart of the pool's
    processes, starts the cluster again on the pool's nodes (Ray jobs in flight end). Ray
    owns its scheduling, objects and actors; flotilla owns the nodes. Cannot share a pool
    with :func:`torch` or :func:`accelerate` (ConfigurationError): use Ray Train.
    Needs cluster mode.
    """
    from ._ray import RayPlugin

    return RayPlugin(
        version,
        dashboard,
        object_store_memory,
        num_cpus,
        num_gpus,
        dict(resources or {}),
    )


def dask(
    version: str = "latest", threads: int | None = None, memory_limit: str = "auto"
) -> DaskPlugin:
    """Dask: a ``distributed`` scheduler on node 0 and one worker per node, with the pool.

    Args:
        version: the ``distributed`` version (dask follows), as for :func:`torch`.
        threads: threads per worker (None: the node's CPUs).
        memory_limit: each worker's memory limit, Dask's notation ("auto", "4GiB").

    The scheduler listens on the head's pool address at ``head_port + 17``; each worker
    binds its node's pool address. The pool runs once every worker has registered. In
    tasks ``DASK_SCHEDULER_ADDRESS`` is set, so ``distributed.Client()`` (no address)
    connects; from the client, ``pool.dask_client()`` gives a Client through an SSH tunnel
    to node 0 (or directly, for nodes on this machine), closed with the pool. Every Dask
    process stops with the pool. Needs cluster mode.
    """
    from ._dask import DaskPlugin

    return DaskPlugin(version, threads, memory_limit)
