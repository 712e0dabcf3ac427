"""flotilla: run Python functions and distributed training jobs on ephemeral multi-node pools.

    import flotilla as sky

    @sky.function
    def hello():
        return sky.instance_info().node

    with sky.Compute(nodes=4) as pool:
        print(hello() @ pool)          # [0, 1, 2, 3]

The names below are the whole public API. They are loaded on first use, so that the node
agent (``python -m flotilla.agent``), which imports this package, starts fast.
"""

import builtins as _builtins
import sys as _sys

from ._version import __version__

TYPE_CHECKING = False
if TYPE_CHECKING:  # for type checkers: the same names as _EXPORTS (a test checks)
    from typing import Any

    from . import events as events
    from . import metrics as metrics
    from . import plugins as plugins
    from . import storage as storage
    from ._accelerators import Accelerator as Accelerator
    from ._accelerators import accelerators as accelerators
    from ._client.compute import Compute as Compute
    from ._client.compute import PoolState as PoolState
    from ._client.elastic import Nodes as Nodes
    from ._client.function import CallGroup as CallGroup
    from ._client.function import Function as Function
    from ._client.function import PendingCall as PendingCall
    from ._client.function import function as function
    from ._client.function import gather as gather
    from ._client.stream import stream as stream
    from ._collections import barrier as barrier
    from ._collections import counter as counter
    from ._collections import dict as dict
    from ._collections import lock as lock
    from ._collections import queue as queue
    from ._collections import registry as registry
    from ._collections import set as set
    from ._errors import ClusterRequiredError as ClusterRequiredError
    from ._errors import ConfigurationError as ConfigurationError
    from ._errors import FlotillaError as FlotillaError
    from ._errors import NodeLostError as NodeLostError
    from ._errors import PoolClosedError as PoolClosedError
    from ._errors import ProvisionCause as ProvisionCause
    from ._errors import ProvisionError as ProvisionError
    from ._errors import RemoteError as RemoteError
    from ._errors import SerializationError as SerializationError
    from ._errors import TaskTimeoutError as TaskTimeoutError
    from ._errors import WorkerDiedError as WorkerDiedError
    from ._health import HealthChecker as HealthChecker
    from ._image import Image as Image
    from ._image import PipIndex as PipIndex
    from ._info import InstanceInfo as InstanceInfo
    from ._info import Peer as Peer
    from ._info import instance_info as instance_info
    from ._output import silent as silent
    from ._output import stderr as stderr
    from ._output import stdout as stdout
    from ._providers.aws import AWS as AWS
    from ._providers.base import AgentProcess as AgentProcess
    from ._providers.base import Allocation as Allocation
    from ._providers.base import Machine as Machine
    from ._providers.base import Options as Options
    from ._providers.base import PoolSpec as PoolSpec
    from ._providers.base import Provider as Provider
    from ._providers.container import Container as Container
    from ._providers.fallback import Candidate as Candidate
    from ._providers.fallback import Spec as Spec
    from ._providers.gcp import GCP as GCP
    from ._providers.k8s import Kubernetes as Kubernetes
    from ._providers.lambda_cloud import LambdaCloud as LambdaCloud
    from ._providers.local import Local as Local
    from ._providers.market import offers as offers
    from ._providers.offers import Offer as Offer
    from ._providers.runpod import RunPod as RunPod
    from ._providers.settings import SSHHost as SSHHost
    from ._providers.slurm import Slurm as Slurm
    from ._providers.ssh import SSH as SSH
    from ._providers.vast import VastAI as VastAI
    from ._providers.verda import Verda as Verda
    from ._redaction import Secret as Secret
    from ._shard import shard as shard
    from ._volume import Volume as Volume
    from ._worker import Worker as Worker
    from .plugins._base import Plugin as Plugin
    from .storage import Storage as Storage
    from .storage import StorageError as StorageError
del TYPE_CHECKING  # not a public name

_EXPORTS: _builtins.dict[str, tuple[str, ...]] = {
    # module (relative to this package) -> the public names it defines. The one list of the
    # API: __all__ and lazy loading derive from it; tests check the TYPE_CHECKING block above.
    "_accelerators": ("Accelerator", "accelerators"),
    "_client.compute": ("Compute", "PoolState"),
    "_collections": ("barrier", "counter", "dict", "lock", "queue", "registry", "set"),
    "_client.elastic": ("Nodes",),
    "_client.function": ("CallGroup", "Function", "PendingCall", "function", "gather"),
    "_client.stream": ("stream",),
    "_errors": (
        "ClusterRequiredError",
        "ConfigurationError",
        "FlotillaError",
        "NodeLostError",
        "PoolClosedError",
        "ProvisionCause",
        "ProvisionError",
        "RemoteError",
        "SerializationError",
        "TaskTimeoutError",
        "WorkerDiedError",
    ),
    "_health": ("HealthChecker",),
    "_image": ("Image", "PipIndex"),
    "_redaction": ("Secret",),
    "_info": ("InstanceInfo", "Peer", "instance_info"),
    "_output": ("silent", "stderr", "stdout"),
    "_providers.aws": ("AWS",),
    "_providers.base": ("AgentProcess", "Allocation", "Machine", "Options", "PoolSpec", "Provider"),
    "_providers.container": ("Container",),
    "_providers.fallback": ("Candidate", "Spec"),
    "_providers.gcp": ("GCP",),
    "_providers.k8s": ("Kubernetes",),
    "_providers.local": ("Local",),
    "_providers.market": ("offers",),
    "_providers.offers": ("Offer",),
    "_providers.slurm": ("Slurm",),
    "_providers.settings": ("SSHHost",),
    "_providers.ssh": ("SSH",),
    "_providers.lambda_cloud": ("LambdaCloud",),
    "_providers.runpod": ("RunPod",),
    "_providers.vast": ("VastAI",),
    "_providers.verda": ("Verda",),
    "_shard": ("shard",),
    "_volume": ("Volume",),
    "_worker": ("Worker",),
    "storage": ("Storage", "StorageError"),
    "plugins._base": ("Plugin",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

_SUBMODULES = ("events", "metrics", "plugins", "storage")
"""Public modules: ``flotilla.plugins.torch()``, ``flotilla.metrics.CPU()``..."""

__all__ = ["__version__", *_SUBMODULES, *_MODULE_OF]


def _submodule(name: str) -> "Any":
    """``flotilla.{name}``, imported (by ``__import__``: ``importlib``'s package brings
    ``warnings``, ~0.5 ms of every node's start, which imports this package)."""
    full = f"{__name__}.{name}"
    __import__(full)
    return _sys.modules[full]


def __getattr__(name: str) -> "Any":
    if name in _SUBMODULES:  # flotilla.plugins.torch(), flotilla.storage.S3()
        return _submodule(name)
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'flotilla' has no attribute {name!r}")
    value = getattr(_submodule(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
