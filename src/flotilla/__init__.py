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

import importlib as _importlib
import typing as _typing

from ._version import __version__

if _typing.TYPE_CHECKING:
    from . import plugins
    from ._accelerators import Accelerator, accelerators
    from ._compute import Compute, PoolState
    from ._errors import (
        ConfigurationError,
        FlotillaError,
        NodeLostError,
        PoolClosedError,
        ProvisionError,
        RemoteError,
        SerializationError,
        TaskTimeoutError,
        WorkerDiedError,
    )
    from ._function import CallGroup, Function, PendingCall, function, gather
    from ._image import Image, Secret
    from ._info import InstanceInfo, Peer, instance_info
    from ._local import Local
    from ._output import silent, stderr, stdout
    from ._plugins import Plugin
    from ._provider import AgentProcess, Options, PoolSpec, Provider
    from ._shard import shard
    from ._ssh import SSH, SSHHost

_EXPORTS: dict[str, str] = {
    "Accelerator": "_accelerators",
    "accelerators": "_accelerators",
    "Compute": "_compute",
    "PoolState": "_compute",
    "ConfigurationError": "_errors",
    "FlotillaError": "_errors",
    "NodeLostError": "_errors",
    "PoolClosedError": "_errors",
    "ProvisionError": "_errors",
    "RemoteError": "_errors",
    "SerializationError": "_errors",
    "TaskTimeoutError": "_errors",
    "WorkerDiedError": "_errors",
    "CallGroup": "_function",
    "Function": "_function",
    "PendingCall": "_function",
    "function": "_function",
    "gather": "_function",
    "Image": "_image",
    "Secret": "_image",
    "InstanceInfo": "_info",
    "Peer": "_info",
    "instance_info": "_info",
    "Local": "_local",
    "silent": "_output",
    "stderr": "_output",
    "stdout": "_output",
    "Plugin": "_plugins",
    "AgentProcess": "_provider",
    "Options": "_provider",
    "PoolSpec": "_provider",
    "Provider": "_provider",
    "shard": "_shard",
    "SSH": "_ssh",
    "SSHHost": "_ssh",
}

__all__ = [
    "SSH",
    "Accelerator",
    "AgentProcess",
    "CallGroup",
    "Compute",
    "ConfigurationError",
    "FlotillaError",
    "Function",
    "Image",
    "InstanceInfo",
    "Local",
    "NodeLostError",
    "Options",
    "Peer",
    "PendingCall",
    "Plugin",
    "PoolClosedError",
    "PoolSpec",
    "PoolState",
    "Provider",
    "ProvisionError",
    "RemoteError",
    "SSHHost",
    "Secret",
    "SerializationError",
    "TaskTimeoutError",
    "WorkerDiedError",
    "__version__",
    "accelerators",
    "function",
    "gather",
    "instance_info",
    "plugins",
    "shard",
    "silent",
    "stderr",
    "stdout",
]


def __getattr__(name: str) -> _typing.Any:
    if name == "plugins":  # the built-in plugins: flotilla.plugins.torch() ...
        return _importlib.import_module(".plugins", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flotilla' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
