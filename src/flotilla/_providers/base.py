"""The provider model: where nodes come from.

A provider gets machines and starts the agent on them, in four separate steps that every
backend implements (as submitit's executors and dask's ``ProcessInterface`` do):

1. **acquire** (:meth:`Provider.acquire`): get N machines for a pool, an
   :class:`Allocation` (local process folders, a set of SSH hosts, a SLURM job, cloud
   instances). Nothing runs on them yet.
2. **start an agent** (:meth:`Allocation.start_agent`): run ``python -m flotilla.agent`` on
   one machine and hand back its stdio as an :class:`AgentProcess` (the protocol channel),
   with the address peers use to reach it.
3. **replace** (:meth:`Allocation.replace`): the machine at rank k is lost; get another one
   for that rank (a new process tree, a spare or reconnected host, a new SLURM step or
   instance). The client calls :meth:`Allocation.renew` (replace, then start the agent
   there), which a provider with several candidates overrides to try the next one when
   the agent does not start (the SSH provider's spares).
4. **release** (:meth:`Allocation.release`): give everything back. Idempotent.

The :class:`Allocation` base class keeps the books (machine and allocation states, the
idempotent release); a provider implements only getting and giving back its own resources
(:meth:`Provider.acquire`, :meth:`Allocation.replacement`, :meth:`Allocation.free`) and
starting an agent (``launch.ShellAllocation`` for machines reached through a remote shell).

Everything else (bootstrap, protocol, dispatch, plugins) is provider-independent, so every
backend shares one path (:meth:`Provider.start`) and runs the same agent entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Self

from .._accelerators import Accelerator
from .._errors import ConfigurationError, ProvisionError, check_number
from .._wire.frames import Buffer, Kind, frame
from .._worker import Worker
from . import ledger
from .offers import Offer

logger = logging.getLogger("flotilla")

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
        heartbeat_timeout: a node whose agent sends nothing for this long (a frozen
            process or VM, a network black hole) is declared lost by the client (then
            replaced, see ``replace_lost_nodes``), and an agent that hears nothing from the
            client for this long assumes it is gone and exits (end of stream is noticed at
            once either way).
        shutdown_grace: seconds a node's process gets to exit cleanly when the pool closes
            (plugins' teardown runs then) before it is killed.
        env: environment variables set in every task process (values may be ``Secret``).
        replace_lost_nodes: True (default): a node whose agent is lost (killed, host gone,
            connection dropped) is replaced at the same rank through the provider (a new
            process tree, a spare or reconnected host...) and the pool keeps its size; in a
            pool whose processes form one group every process is restarted with it. False:
            the node stays lost; broadcasts then fail naming it.
        provision_timeout: Skyward's name for ``start_timeout`` (when given, it is the one
            used).
        worker: :class:`Worker`: task slots per node (default: one); ``Compute(worker=)``
            takes precedence.
        autoscale_idle_timeout: Skyward's: in an elastic pool (``nodes=(desired, max)``
            or :class:`flotilla.Nodes`), seconds its nodes may stay idle (or under a third
            busy) before it shrinks towards ``min`` (to none with ``min=0``).
        autoscale_cooldown: Skyward's: the fewest seconds between two of an elastic
            pool's decisions to shrink (growing for queued calls is never held back).
        relay: True (default): a broadcast of a large argument to many remote nodes is
            relayed from node to node (the client sends one copy; authenticated, checked
            with a sha256 at every hop, but not encrypted between the nodes: see
            ``_client/fanout.py``). False: the client sends every node its own copy over
            its own connection (SSH), as smaller broadcasts always go.
        health_checker: Skyward's :class:`flotilla.HealthChecker`: a check every node
            passes before its first call, and that replaces a node after its failures in
            a row (see ``flotilla/_health.py``); None (default): none.
    """

    cluster: bool = True
    start_timeout: float = 120.0
    heartbeat_timeout: float = 10.0
    shutdown_grace: float = 2.0
    env: dict[str, Any] = field(default_factory=dict)
    replace_lost_nodes: bool = True
    provision_timeout: float | None = None
    worker: Worker | None = None
    autoscale_idle_timeout: float = 60.0
    autoscale_cooldown: float = 30.0
    relay: bool = True
    health_checker: Any = None

    def __repr__(self) -> str:  # env values may be secrets: never shown
        from .._redaction import shown_env

        return (
            f"Options(cluster={self.cluster!r}, start_timeout={self.start_timeout!r}, "
            f"heartbeat_timeout={self.heartbeat_timeout!r}, "
            f"shutdown_grace={self.shutdown_grace!r}, env={shown_env(self.env)!r}, "
            f"replace_lost_nodes={self.replace_lost_nodes!r}, "
            f"autoscale_idle_timeout={self.autoscale_idle_timeout!r}, "
            f"autoscale_cooldown={self.autoscale_cooldown!r}"
            + ("" if self.relay else ", relay=False")
            + ("" if self.health_checker is None else f", health_checker={self.health_checker!r}")
            + ")"
        )

    def __post_init__(self) -> None:
        if self.worker is not None and not isinstance(self.worker, Worker):
            raise ConfigurationError(
                f"Options.worker must be a flotilla.Worker, got {type(self.worker).__name__}"
            )
        if self.provision_timeout is not None:
            object.__setattr__(self, "start_timeout", self.provision_timeout)
        if not isinstance(self.relay, bool):
            raise ConfigurationError(f"Options.relay must be True or False, got {self.relay!r}")
        if self.health_checker is not None:
            from .._health import HealthChecker

            if not isinstance(self.health_checker, HealthChecker):
                raise ConfigurationError(
                    "Options.health_checker must be a flotilla.HealthChecker(fn, interval=...), "
                    f"got {type(self.health_checker).__name__}"
                )
        if not isinstance(self.replace_lost_nodes, bool):
            raise ConfigurationError(
                f"Options.replace_lost_nodes must be True or False, got {self.replace_lost_nodes!r}"
            )
        for name in ("autoscale_idle_timeout", "autoscale_cooldown"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ConfigurationError(
                    f"Options.{name} must be a number of seconds (>= 0), got {value!r}"
                )
        for name in ("start_timeout", "heartbeat_timeout", "shutdown_grace"):
            value = getattr(self, name)
            if name == "start_timeout" and self.provision_timeout is not None:
                name = "provision_timeout"
            check_number(value, f"Options.{name} must be a positive number, got {value!r}", above=0)


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
        vcpus: CPUs wanted per node, or None (the provider's default).
        memory_gb: memory wanted per node in GiB, or None (the provider's default).
        max_nodes: an elastic pool's largest size (0: a pool of ``nodes`` nodes). Its
            machines are then acquired one by one (:meth:`Allocation.candidate`).
        max_hourly_cost: the most the whole pool may cost per hour (USD), or None: a
            provider that knows its prices refuses offers above it before renting.
        max_node_hourly_cost: the most one node may cost per hour (USD; Skyward's
            ``Spec(max_hourly_cost=)``), or None: offers above it are not taken.
        keep_agents: seconds the agents wait for a new client once theirs is gone (a
            named cluster's pool, ``Compute.keep_agents``): what holds the nodes must
            then outlive the client while they run (0: the nodes end with it).
    """

    pool_id: str
    nodes: int
    accelerator: Accelerator | None
    image: Any
    plugins: tuple[Any, ...]
    options: Options
    vcpus: float | None = None
    memory_gb: float | None = None
    max_nodes: int = 0
    max_hourly_cost: float | None = None
    max_node_hourly_cost: float | None = None
    keep_agents: float = 0.0

    @property
    def most(self) -> int:
        """The most nodes the pool may have at once."""
        return max(self.nodes, self.max_nodes)


GiveUp = Callable[[float], bool]
"""Asked by a waiting write with the seconds it made no progress: True to abandon it."""


class AgentProcess(ABC):
    """One running agent, as its provider started it.

    Attributes:
        address: the address other nodes use to reach this node.
        host: a name for this node in messages (host name or address).
    """

    address: str
    host: str

    @abstractmethod
    def write(self, parts: Sequence[Buffer], give_up: GiveUp | None = None) -> None:
        """Write protocol bytes to the agent's stdin (any thread but the event loop's).

        It may block until written, but must never wait for the event loop: callers hold
        the node's write lock. While it waits it asks ``give_up(seconds without
        progress)`` now and then: when that says True the write is abandoned (and so is
        every later one: the stream is cut mid-frame). Raises OSError (BrokenPipeError)
        when the agent is gone or the write was abandoned. Callers serialize writes.
        """

    def try_write(self, data: bytes) -> bool:
        """Write a small frame whole if that needs no wait; whether it was (the event
        loop's writes, e.g. PING: they never wait). Raises OSError when the agent is gone."""
        self.write([data])
        return True

    @abstractmethod
    def start_reading(
        self,
        loop: asyncio.AbstractEventLoop,
        on_frames: FramesCallback,
        on_stderr: Callable[[bytes], None],
    ) -> None:
        """Deliver the agent's stdout as frames and its stderr as bytes, on ``loop``."""

    def hold_direct(self) -> bool:
        """Optionally keep the loop from reading the agent's stdout from now on, for the
        calling thread, about to write one call and wait for its answer
        (:meth:`read_direct`): the answer then waits for that thread even when it comes
        before the thread reads (it was preempted in its write), instead of waking the
        loop's thread, which would then wake the caller. Whether it was held; then
        :meth:`read_direct` or :meth:`release_direct` must follow, in the same thread.
        The default holds nothing."""
        return False

    def release_direct(self) -> None:  # noqa: B027 - see hold_direct
        """Give the loop back its reading, if the calling thread held it
        (:meth:`hold_direct`) and did not read (else nothing: any thread may call it)."""

    def read_direct(  # noqa: B027 - optional: the default leaves reading to the loop
        self,
        on_frames: FramesCallback,
        done: Callable[[], bool],
        budget: float,
        kinds: Collection[int],
        quiet: Callable[[], bool] | None = None,
    ) -> None:
        """Optionally read the agent's stdout in the calling thread until ``done()`` or
        for ``budget`` seconds, delivering frames of ``kinds`` there and leaving everything
        else to the loop, in order (a shortcut for a caller waiting for one result); what
        the thread held (:meth:`hold_direct`) is released here. When ``done()`` and
        ``quiet()`` (nothing else awaited), the loop's reading may stay off until
        :meth:`watch`. The default does nothing: the loop reads."""

    def watch(self) -> None:  # noqa: B027 - see read_direct
        """Give the loop its reading back if a lone call's :meth:`read_direct` left it
        off (any thread, never waits): before a call whose answer is the loop's, and on
        each heartbeat tick, so that nothing the agent says waits longer than that."""

    @abstractmethod
    async def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the agent to exit; its exit status, or None."""

    @abstractmethod
    async def terminate(self) -> None:
        """Stop the agent (politely, then by force) and release everything it held."""

    def exit_status(self) -> int | None:
        """The agent's exit status if known (negative: killed by that signal)."""
        return None


class MachineState(Enum):
    """Lifecycle of one machine of an allocation::

        PENDING --reachable / agent started--> RUNNING
        PENDING | RUNNING --gone (agent exited, host down, preempted)--> LOST
        PENDING | RUNNING | LOST --released--> RELEASED

    A LOST machine is never reused as it is: :meth:`Allocation.replace` puts a new
    :class:`Machine` at its rank.
    """

    PENDING = "pending"
    RUNNING = "running"
    LOST = "lost"
    RELEASED = "released"


@dataclass(frozen=True)
class Machine:
    """One machine of an allocation.

    Attributes:
        rank: the node rank it serves.
        host: a name for it in messages (host name, node name, instance id).
        address: the address other nodes use to reach it.
        ident: what the provider knows it by (a work folder, ``user@host:port``, a SLURM
            node name, an EC2 instance id); unique within the allocation's history.
    """

    rank: int
    host: str
    address: str
    ident: str


class AllocationState(Enum):
    """Lifecycle of an allocation::

    ACQUIRING --every machine granted--> READY --release()--> RELEASING --> RELEASED
    ACQUIRING --failure / cancelled--> RELEASING --> RELEASED
    READY --replace(k)--> READY (machine k is a new one)
    """

    ACQUIRING = "acquiring"
    READY = "ready"
    RELEASING = "releasing"
    RELEASED = "released"


CREATES_WAIT = 60.0
"""Seconds a release waits for the creates already sent to answer before it looks for
what they made (a create's answer lost past that is found by the provider's sweep all the
same when it lists by the pool's key)."""

LostCallback = Callable[[int, str], None]
"""Called with (rank, reason) when a provider learns that a machine is gone."""


class Allocation(ABC):
    """The machines a provider acquired for one pool. All methods run on the client's loop.

    The base class keeps the books: the machine at each rank, each machine's state and the
    allocation's; a provider implements :meth:`start_agent`, and gets and gives back its own
    resources in :meth:`replacement` and :meth:`free`.

    Attributes:
        spec: the pool's request.
        machines: the current machine of each rank, in rank order (assigning the list
            records its machines as PENDING; :meth:`put` changes one rank's).
        state: where the allocation is in its lifecycle.
        machine_states: the state of every machine the allocation ever held, by ident.
        delivered_env: names of the pool's ``env`` variables its agents already have in
            their environment, where the provider put them (a Kubernetes Secret the pods
            refer to): the client does not send them to the nodes.
        created: (what, key) of every create call sent or about to be sent
            (:meth:`creating`), in order.
        ending: set once the allocation is being released (or given back as the process
            exits): a provider's waits in worker threads stop, and no create is sent.
    """

    delivered_env: frozenset[str] = frozenset()

    def __init__(self, spec: PoolSpec, machines: Sequence[Machine]) -> None:
        self.spec = spec
        self.state = AllocationState.READY
        self.machine_states: dict[str, MachineState] = {}
        self._machines: list[Machine] = []
        self.machines = list(machines)
        self._on_lost: LostCallback | None = None
        self.created: list[tuple[str, str]] = []
        self.ending = threading.Event()
        self._creates = threading.Condition()
        self._in_flight = 0
        self._sweep_lock = threading.Lock()
        self._swept = False

    @property
    def machines(self) -> list[Machine]:
        return self._machines

    @machines.setter
    def machines(self, machines: Sequence[Machine]) -> None:
        self._machines = list(machines)
        for machine in machines:
            self.machine_states.setdefault(machine.ident, MachineState.PENDING)

    @abstractmethod
    async def start_agent(self, machine: Machine) -> AgentProcess:
        """Start the agent (``python -m flotilla.agent``) on ``machine``; ProvisionError
        naming the machine. A machine reached through a remote shell: see
        ``launch.ShellAllocation``."""

    async def replace(self, rank: int, reason: str) -> Machine:
        """Put a new machine at ``rank`` (its current one is lost, for ``reason``; see
        :meth:`replacement`), which is then PENDING and the old one RELEASED.
        ProvisionError when no machine can be had."""
        machine = await self.replacement(rank, reason)
        self.put(rank, machine)
        return machine

    async def replacement(self, rank: int, reason: str) -> Machine:
        """A new machine for ``rank``, whose current machine is lost for ``reason``, after
        giving back what the old one held. ProvisionError when none can be had (the
        default: this provider cannot replace machines)."""
        raise ProvisionError(
            f"{self.machines[rank].host}: {reason}; this provider cannot replace machines"
        )

    def put(self, rank: int, machine: Machine) -> None:
        """Make ``machine`` (PENDING) the machine at ``rank``, in place of the current one
        (RELEASED)."""
        self.mark(self.machines[rank], MachineState.RELEASED)
        self._machines[rank] = machine
        self.mark(machine, MachineState.PENDING)

    async def renew(self, rank: int, reason: str) -> AgentProcess:
        """Replace the lost machine at ``rank`` (:meth:`replace`) and start the agent
        on the new one, which is then RUNNING. ProvisionError when no machine
        can be had or its agent does not start.

        Providers with several candidates for a rank (the SSH provider's spare hosts)
        override it to set a machine whose agent does not start aside and try the next.
        """
        machine = await self.replace(rank, reason)
        agent = await self.start_agent(machine)
        self.mark(machine, MachineState.RUNNING)
        return agent

    # -- elastic pools: machines added and removed one by one ----------------------------
    async def candidate(self, rank: int) -> Machine | None:
        """A new machine for an elastic pool, to serve ``rank`` (the next one) if its
        agent starts; not one of :attr:`machines` until :meth:`admit`. None when none can
        be had now (the pool asks again later). Providers with ``elastic`` implement it."""
        raise ProvisionError(f"{type(self).__name__} cannot add machines to a pool")

    async def give_back(self, machine: Machine, failed: bool) -> None:  # noqa: B027
        """Take back a machine of :meth:`candidate`'s: one whose agent did not start
        (``failed``: it may be offered again later) or one an elastic pool released."""

    def admit(self, machine: Machine) -> Machine:
        """Make a candidate (whose agent started) the machine at the next rank; it as
        such (RUNNING)."""
        machine = dataclasses.replace(machine, rank=len(self._machines))
        self._machines.append(machine)
        self.mark(machine, MachineState.RUNNING)
        return machine

    def remove_last(self) -> Machine:
        """Take the machine at the last rank out of the allocation (an elastic pool
        shrinks); give it back with :meth:`give_back`."""
        machine = self._machines.pop()
        self.mark(machine, MachineState.RELEASED)
        return machine

    async def release(self) -> None:
        """Release every machine the allocation ever held (:meth:`free`). Idempotent; never
        raises: what could not be given back is logged."""
        if self.state in (AllocationState.RELEASING, AllocationState.RELEASED):
            return
        self.state = AllocationState.RELEASING
        self.ending.set()
        try:
            await self.free()
        except Exception as e:
            logger.warning("pool %s: could not release everything: %s", self.spec.pool_id, e)
        finally:
            for ident in self.machine_states:
                self.machine_states[ident] = MachineState.RELEASED
            self.state = AllocationState.RELEASED
            ledger.leave(self)

    async def free(self) -> None:
        """Give back everything the allocation holds (called once, by :meth:`release`):
        by default :meth:`sweep_now` in a worker thread (what :meth:`sweep` gives back)."""
        await asyncio.get_running_loop().run_in_executor(None, self.sweep_now)

    # -- what was created: recorded before it is sent, given back even at exit ----------
    @contextlib.contextmanager
    def creating(self, what: str, key: str) -> Iterator[None]:
        """Held around every call that creates something (``what``: "instance",
        "overlay network"...), with ``key``, what finds it again (the pool's label or tag,
        the provider's idempotency token). It is recorded BEFORE the call is sent, and the
        allocation is on the process's ledger (``ledger``) until its release ends: an
        acquire cut short, even by the process's exit, gives it back (:meth:`sweep`).
        ProvisionError, sending nothing, once the allocation is :attr:`ending`."""
        with self._creates:
            try:
                if self.ending.is_set():
                    raise RuntimeError("the pool is being released")
                ledger.enter(self)
            except RuntimeError as e:
                raise ProvisionError(
                    f"pool {self.spec.pool_id}: not creating {what}: {e}"
                ) from None
            self.created.append((what, key))
            self._in_flight += 1
        try:
            yield
        finally:
            with self._creates:
                self._in_flight -= 1
                self._creates.notify_all()

    def sweep(self) -> None:  # noqa: B027 - optional hook
        """Give back, synchronously (any thread, no event loop), everything the
        allocation may have created (:attr:`created`: find it by its keys), and what it
        holds. Idempotent: what is already gone is no error. Nothing by default (what a
        provider starts that way ends with its agents' connections)."""

    def sweep_now(self) -> None:
        """Stop the allocation's waits (:attr:`ending`), let the creates already sent
        answer (up to :data:`CREATES_WAIT` s), then :meth:`sweep`, once (a second call
        waits for the first). Synchronous: the release's, and the process exit's
        (``ledger.end_all``)."""
        self.ending.set()
        deadline = time.monotonic() + CREATES_WAIT
        with self._creates:
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._creates.wait(left)
        with self._sweep_lock:
            if not self._swept:
                self._swept = True
                self.sweep()

    def end_now(self) -> None:
        """Give everything back now (:meth:`sweep_now`), the process exiting: its release
        on the event loop may never end."""
        if self.created:
            print(
                f"flotilla: pool {self.spec.pool_id}: giving back what it created "
                f"({', '.join(sorted({what for what, _ in self.created}))})",
                file=sys.stderr,
                flush=True,
            )
        self.sweep_now()
        ledger.leave(self)

    def watch(self, on_lost: LostCallback) -> None:
        """Report machines the provider learns are gone (a SLURM node DOWN, a spot
        interruption notice) to ``on_lost(rank, reason)``. A lost agent is noticed by the
        client anyway; this is for what only the provider can see."""
        self._on_lost = on_lost

    def mark(self, machine: Machine, state: MachineState) -> None:
        """Record ``machine``'s new state."""
        self.machine_states[machine.ident] = state

    def report_lost(self, rank: int, reason: str) -> None:
        """Tell the watcher (if any) that the machine at ``rank`` is gone."""
        self.mark(self.machines[rank], MachineState.LOST)
        if self._on_lost is not None:
            self._on_lost(rank, reason)


class Provider(ABC):
    """Gets machines and starts agents on them. Subclass it to add a new place to run:
    implement :meth:`acquire` (and an :class:`Allocation`), and :meth:`validate`."""

    name: str = "provider"
    settings_type: ClassVar[type[Any] | None] = None
    """The provider's settings: a frozen dataclass whose fields, documented in its
    docstring's ``Attributes:``, are the constructor's keyword arguments (the command line
    derives ``flotilla launch``'s flags from them)."""
    home: str = "~/.flotilla"
    """Where nodes keep built environments between pools."""
    shares_filesystem: bool = False
    """True when nodes see the client's files (then user modules are imported, not shipped)."""
    elastic: bool = False
    """Its allocations add and remove machines one by one (:meth:`Allocation.candidate`):
    it serves elastic pools."""
    fractional_accelerators: bool = False
    """It can give a node a slice of one accelerator (``accelerators.L4(count=0.5)``);
    pools asking for one are refused before anything starts otherwise."""
    python_pinned: bool = False
    """The user named the nodes' interpreter (``python=``): flotilla only checks that it
    is the client's Python minor version, and never looks for another one (see
    ``_client/interpreter.py``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A constructor derived from a settings class (``options.provider_init``) gives
        the class its :attr:`settings_type`."""
        super().__init_subclass__(**kwargs)
        derived = getattr(cls.__dict__.get("__init__"), "settings_type", None)
        if derived is not None:
            cls.settings_type = derived

    def __repr__(self) -> str:
        """``Name(field=value, ...)``: the settings fields (of :attr:`settings_type`) that
        differ from their defaults, never a secret one; a provider without settings is
        shown as an object is."""
        settings = getattr(self, "settings", None)
        if self.settings_type is None or not isinstance(settings, self.settings_type):
            return super().__repr__()
        from .options import changed

        args = ", ".join(f"{k}={v!r}" for k, v in changed(settings).items())
        return f"{type(self).__name__}({args})"

    @classmethod
    def from_settings(cls, settings: Any) -> Self:
        """The provider made from a :attr:`settings_type` object (``cls(settings=...)`` when
        its constructor is derived from the settings, see ``options.provider_init``)."""
        param = inspect.signature(cls).parameters.get("settings")
        if param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY:
            return cls(settings=settings)  # type: ignore[call-arg]
        return cls(**{f.name: getattr(settings, f.name) for f in fields(settings)})

    def make_settings(self, settings: Any, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
        """The settings of a constructor derived from :attr:`settings_type` (see
        ``options.provider_init``): ``settings=`` (its fields replaced by ``options``), else
        the settings made of ``args`` and ``options``; checked. Sets :attr:`python_pinned`
        from their ``python``."""
        from .options import make_settings

        assert self.settings_type is not None
        made = make_settings(self.settings_type, type(self).__name__, settings, args, options)
        self.python_pinned = getattr(made, "python", None) is not None
        return made

    def validate(self, spec: PoolSpec) -> None:  # noqa: B027 - optional hook
        """Refuse, with a ConfigurationError, what this provider cannot honour.

        Called before anything is provisioned.
        """

    def offers(self, spec: PoolSpec) -> list[Offer] | None:
        """What this provider offers now for one node of ``spec`` (``offers.Offer``:
        type, count, price per node-hour, region, spot), cheapest first; None when it
        cannot tell (the default)."""
        return None

    @abstractmethod
    async def acquire(self, spec: PoolSpec) -> Allocation:
        """Get ``spec.nodes`` machines. On failure release what was got and raise
        ProvisionError; on cancellation release too."""

    async def start(self, spec: PoolSpec) -> tuple[Allocation, list[AgentProcess]]:
        """The one path every provider shares: acquire, then start the agents on every
        machine at once. The first failure in rank order is raised (root cause first),
        after everything started was stopped and the allocation released."""
        allocation = await self.acquire(spec)
        try:
            agents = await start_agents(allocation, allocation.machines)
        except BaseException:
            await allocation.release()
            raise
        return allocation, agents


async def start_agents(allocation: Allocation, machines: Sequence[Machine]) -> list[AgentProcess]:
    """Start an agent on each of ``machines`` at once; in their order. On a failure (or
    cancellation) every agent started is terminated and the first failure in order raised.
    The agents started are kept alive while the others start (:func:`_keep_alive`)."""
    agents = await _all_or_none(
        [allocation.start_agent(m) for m in machines], _ping_every(allocation)
    )
    for m in machines:
        allocation.mark(m, MachineState.RUNNING)
    return agents


async def restart_agents(
    allocation: Allocation, lost: int, ranks: Sequence[int], reason: str
) -> list[AgentProcess]:
    """Agents for ``ranks`` (in their order) after the machine at rank ``lost`` was lost
    (for ``reason``): a new machine for ``lost`` (:meth:`Allocation.renew`), the others on
    the machines they have; all at once. On a failure (or cancellation) every agent
    started is terminated and the first failure in rank order raised."""
    others = [allocation.machines[r] for r in ranks if r != lost]
    agents = await _all_or_none(
        [
            allocation.renew(r, reason)
            if r == lost
            else allocation.start_agent(allocation.machines[r])
            for r in ranks
        ],
        _ping_every(allocation),
    )
    for m in others:
        allocation.mark(m, MachineState.RUNNING)
    return agents


def _ping_every(allocation: Allocation) -> float:
    """Seconds between two keep-alive PINGs to the agents of a start: as the pool's
    heartbeat pings them (a quarter of ``Options(heartbeat_timeout=...)``, which a cloud
    provider's ``ttl`` exceeds, see ``cloud.market.check_ttl``)."""
    return allocation.spec.options.heartbeat_timeout / 4


async def _keep_alive(tasks: Sequence[asyncio.Task[AgentProcess]], every: float) -> None:
    """PING the agents of ``tasks`` that started, every ``every`` s, until cancelled: from
    the moment an agent runs, not once all of them do. Each frame from the client renews
    the agent's silence limit and, on a cloud instance, its watchdog's contact
    (``_node/cloud.py``): an instance whose agent started first must not power itself off
    ``ttl`` s later while the others still start (a slow instance, a busy client)."""
    ping = b"".join(bytes(part) for part in frame(Kind.PING, 0))
    while True:
        await asyncio.sleep(every)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                with contextlib.suppress(OSError):  # gone: its start's failure tells
                    task.result().try_write(ping)


async def _all_or_none(
    starts: Sequence[Coroutine[Any, Any, AgentProcess]], ping_every: float
) -> list[AgentProcess]:
    """Run the agent ``starts`` at once; their agents in order, or, on a failure (or
    cancellation), none: every agent started is terminated, the first failure in order
    raised. The agents started are PINGed every ``ping_every`` s meanwhile
    (:func:`_keep_alive`)."""
    tasks = [asyncio.create_task(start) for start in starts]
    pings = asyncio.create_task(_keep_alive(tasks, ping_every))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pings.cancel()  # (it writes between two sleeps: from here on, never)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed or not all(t.done() for t in tasks):  # an error, or we were cancelled
            for t in tasks:
                t.cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            for agent in done:
                if isinstance(agent, AgentProcess):
                    await agent.terminate()
    if failed:
        raise failed[0].exception()  # type: ignore[misc]
    return [t.result() for t in tasks]
