"""What a provider is built from: the extension API for providers outside flotilla.

A provider gets machines for a pool and starts flotilla's agent on each (see
``docs/providers.md``). Subclass :class:`Provider` (``acquire``, ``validate``) and
:class:`Allocation` (``start_agent``; ``replacement`` and ``free`` for what it holds); a
provider whose machines are reached through a command that runs a command there (``ssh``,
``kubectl exec -i``, ``ip netns exec``) subclasses :class:`ShellAllocation` instead and
supplies a :class:`RemoteShell`: the launch (bundle upload, agent start, timeouts, errors
with a :class:`ProvisionCause`) is flotilla's.

An instance works in ``Compute(provider=...)``.
"""

from ._errors import ConfigurationError, ProvisionCause, ProvisionError
from ._providers.base import (
    AgentProcess,
    Allocation,
    AllocationState,
    Machine,
    MachineState,
    Options,
    PoolSpec,
    Provider,
)
from ._providers.bootstrap import NoAnswer
from ._providers.launch import RemoteShell, ShellAllocation, start_remote_agent
from ._providers.pipe import PipeAgent

__all__ = [
    "AgentProcess",
    "Allocation",
    "AllocationState",
    "ConfigurationError",
    "Machine",
    "MachineState",
    "NoAnswer",
    "Options",
    "PipeAgent",
    "PoolSpec",
    "Provider",
    "ProvisionCause",
    "ProvisionError",
    "RemoteShell",
    "ShellAllocation",
    "start_remote_agent",
]
