"""The provider interface.

A provider does one thing: start one agent command per node and hand back, per node, its
stdio (the protocol channel), the address peers use to reach it, and a way to terminate
it. Everything else (bootstrap, protocol, dispatch, plugins) is provider-independent, so
Local, SSH, SLURM and cloud providers share one path and run the same agent entrypoint.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._accelerators import Accelerator
from .._wire.frames import Buffer

FramesCallback = Callable[[list[tuple[int, int, bytes | bytearray]] | None], None]
"""Receives the frames an agent sent; None at end of stream (the agent is gone)."""


@dataclass(frozen=True)
class Options:
    """Pool options.

    Attributes:
        cluster: True (default): nodes know each other (peers, head) for distributed
            frameworks. False: standalone workers, no peers and no head; plugins that need
            a cluster are refused.
        start_timeout: seconds to wait for every node to be up and initialised.
        heartbeat_timeout: an agent that hears nothing from the client for this long
            assumes the client is gone and exits (end of stream is noticed at once).
        shutdown_grace: seconds a node's process gets to exit cleanly when the pool closes
            (plugins' teardown runs then) before it is killed.
        env: environment variables set in every task process (values may be ``Secret``).
    """

    cluster: bool = True
    start_timeout: float = 120.0
    heartbeat_timeout: float = 30.0
    shutdown_grace: float = 2.0
    env: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("start_timeout", "heartbeat_timeout", "shutdown_grace"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"Options.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class PoolSpec:
    """What a pool asks of its provider.

    Attributes:
        pool_id: unique identifier of this pool.
        nodes: number of nodes.
        accelerator: accelerators wanted per node, or None.
        image: the node environment (an ``Image``), or None for the provider's default.
        plugins: plugins, in order.
        options: pool options.
    """

    pool_id: str
    nodes: int
    accelerator: Accelerator | None
    image: Any
    plugins: tuple[Any, ...]
    options: Options


class AgentProcess(ABC):
    """One running agent, as its provider started it.

    Attributes:
        address: the address other nodes use to reach this node.
        host: a name for this node in messages (host name or address).
    """

    address: str
    host: str

    @abstractmethod
    def write(self, parts: Sequence[Buffer]) -> None:
        """Write protocol bytes to the agent's stdin (any thread but the event loop's).

        It may block until written, but must never wait for the event loop: callers hold
        the node's write lock. Raises OSError (BrokenPipeError) when the agent is gone.
        Callers serialize writes.
        """

    @abstractmethod
    def start_reading(
        self,
        loop: asyncio.AbstractEventLoop,
        on_frames: FramesCallback,
        on_stderr: Callable[[bytes], None],
    ) -> None:
        """Deliver the agent's stdout as frames and its stderr as bytes, on ``loop``."""

    @abstractmethod
    async def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the agent to exit; its exit status, or None."""

    @abstractmethod
    async def terminate(self) -> None:
        """Stop the agent (politely, then by force) and release everything it held."""

    def exit_status(self) -> int | None:
        """The agent's exit status if known (negative: killed by that signal)."""
        return None


class Provider(ABC):
    """Starts agents. Subclass it to add a new place to run."""

    name: str = "provider"
    home: str = "~/.flotilla"
    """Where nodes keep built environments between pools."""
    shares_filesystem: bool = False
    """True when nodes see the client's files (then user modules are imported, not shipped)."""

    def validate(self, spec: PoolSpec) -> None:  # noqa: B027 - optional hook
        """Refuse, with a ConfigurationError, what this provider cannot honour.

        Called before anything is provisioned.
        """

    @abstractmethod
    async def start(self, spec: PoolSpec, command: list[str]) -> list[AgentProcess]:
        """Start ``command`` (the agent) once per node; return them in rank order.

        On failure, stop whatever was started and raise ProvisionError.
        """

    def agent_command(self) -> list[str]:
        """The agent command line (``python -m flotilla.agent``) for this provider's nodes."""
        return ["python3", "-m", "flotilla.agent"]
