"""An in-process provider for unit tests of the client, as httpx's ``MockTransport`` is for
HTTP clients: the real ``Compute``, dispatcher and node handles run against agents that
live in the test process and speak flotilla's real frame protocol, with scripted answers.

    fake = FakeProvider()
    fake.on("work", lambda call: call.rank)         # the value a call returns
    fake.on("block", lambda call: HANG)             # never answers (until restart/cancel/loss)
    fake.on("flaky", lambda call: DIE if call.attempt == 1 else "ok")
    with sky.Compute(provider=fake, nodes=3) as pool:
        ...
        fake.live[1].lose()                          # the agent's stream ends: node 1 is lost

A handler gets a :class:`FakeCall` and returns the call's value, raises (the call raises
that), or returns an action: ``HANG``, ``DIE`` (the process running it dies: WorkerDied),
``LOSE`` (the whole agent is lost with it). Functions without a handler run here, in the
test process. Nothing is forked: a pool starts in milliseconds and every step is
deterministic, so the dispatcher's policy can be tested call by call.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from flotilla._errors import ProvisionError
from flotilla._info import InstanceInfo
from flotilla._providers.base import (
    AgentProcess,
    Allocation,
    FramesCallback,
    GiveUp,
    Machine,
    PoolSpec,
    Provider,
)
from flotilla._wire.frames import TASK_HEAD, Buffer, FrameReader, Kind, Status
from flotilla._wire.serialize import decode, encode, pickle_obj

HANG = "hang"
DIE = "die"
LOSE = "lose"
Frame = tuple[int, int, bytes | bytearray]


@dataclass(eq=False)
class FakeCall:
    """One call as a fake agent received it.

    Attributes:
        agent: the agent that got it.
        tid: its task id on that agent.
        worker: the local rank it was sent to.
        name: the function's name.
        args, kwargs: its arguments.
        attempt: how many calls of this function the provider got so far, this one included.
        answered: how it ended ("ok", "error", "died", "aborted", "cancelled"), "" while it
            runs or hangs.
    """

    agent: FakeAgent
    tid: int
    worker: int
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    attempt: int
    answered: str = ""

    @property
    def rank(self) -> int:
        """The rank of the node that got it (from the agent's configuration)."""
        return self.agent.info.node


class FakeAgent(AgentProcess):
    """An agent in the test process: it parses what the client writes and answers as
    ``python -m flotilla.agent`` would, on the client's event loop."""

    def __init__(self, provider: FakeProvider, machine: Machine) -> None:
        self.provider = provider
        self.machine = machine
        self.address = machine.address
        self.host = machine.host
        self.pid = 100_000 + next(provider.pids)
        self.config: dict[str, Any] = {}
        self.info = InstanceInfo(-1, 0, False, "", 0, 0, (), "")
        self.received: list[Frame] = []  # every frame the client sent, in order
        self.restarts: list[int] = []  # the generations of RESTART frames
        self.status: int | None = None  # exit status once ended
        self._reader = FrameReader()
        self._lock = threading.RLock()
        self._functions: dict[int, Callable[..., Any]] = {}
        self._queues: dict[int, deque[FakeCall]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_frames: FramesCallback | None = None
        self._ended = threading.Event()

    # -- the AgentProcess interface ----------------------------------------------------
    def write(self, parts: Sequence[Buffer], give_up: GiveUp | None = None) -> None:
        with self._lock:
            if self.status is not None:
                raise BrokenPipeError(32, "Broken pipe (fake agent ended)")
            for kind, ident, body in self._reader.feed(b"".join(bytes(p) for p in parts)):
                self.received.append((kind, ident, body))
                self._handle(kind, ident, body)

    def start_reading(
        self,
        loop: asyncio.AbstractEventLoop,
        on_frames: FramesCallback,
        on_stderr: Callable[[bytes], None],
    ) -> None:
        self._loop, self._on_frames = loop, on_frames
        hello = {
            "pid": self.pid,
            "host": self.host,
            "port": 29500 + self.pid % 1000,
            "python": sys.executable,  # the client's interpreter, as a local agent's
            "python_version": "%d.%d.%d" % sys.version_info[:3],  # noqa: UP031
        }
        self._send(Kind.HELLO, 0, json.dumps(hello).encode())

    async def wait(self, timeout: float) -> int | None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._ended.wait, timeout)
        return self.status

    async def terminate(self) -> None:
        self.end(-15)

    def exit_status(self) -> int | None:
        return self.status

    # -- what tests do to it -----------------------------------------------------------
    def lose(self, status: int = -9, report: bool = True) -> None:
        """The agent dies (killed by SIGKILL by default): its stream ends. With ``report``
        False the end of stream is not delivered yet (writes already fail): call
        :meth:`report_end` (the window between a death and the client noticing it)."""
        self.end(status, report)

    def end(self, status: int, report: bool = True) -> None:
        with self._lock:
            if self.status is not None:
                return
            self.status = status
        self._ended.set()
        if report:
            self.report_end()

    def report_end(self) -> None:
        if self._loop is not None and self._on_frames is not None:
            self._loop.call_soon_threadsafe(self._on_frames, None)

    def hanging(self) -> list[FakeCall]:
        """The calls it holds without answering."""
        with self._lock:
            return [q[0] for q in self._queues.values() if q and not q[0].answered]

    def answer(self, call: FakeCall, value: Any) -> None:
        """Answer a hanging call with ``value``; the calls queued behind it run."""
        with self._lock:
            self._result(call, Status.OK, value)
            self._next(call.worker)

    # -- the protocol ------------------------------------------------------------------
    def _send(self, kind: int, ident: int, body: bytes) -> None:
        assert self._loop is not None and self._on_frames is not None
        self._loop.call_soon_threadsafe(self._deliver, [(int(kind), ident, body)])

    def _deliver(self, frames: list[Frame]) -> None:
        if self._on_frames is not None:
            self._on_frames(frames)

    def _handle(self, kind: int, ident: int, body: bytes | bytearray) -> None:
        if kind == Kind.CONFIG:
            n = int.from_bytes(body[:4], "little")
            self.config = json.loads(bytes(body[4 : 4 + n]))
            self.info = InstanceInfo.from_json(self.config["compute_pool"])
            if self.provider.fail_config:
                error = {"error": "fake executor failed to start", "stderr_tail": ""}
                self._send(Kind.READY, 0, json.dumps(error).encode())
                return
            procs = int(self.config.get("procs", 1))
            ready = {"pids": [self.pid] * procs, "restarts": 0, "shm": False}
            self._send(Kind.READY, 0, json.dumps(ready).encode())
        elif kind == Kind.DEFINE:
            self._functions[ident] = decode(body)
        elif kind == Kind.TASK:
            _timeout, worker = TASK_HEAD.unpack_from(body)
            key, args, kwargs = decode(body, TASK_HEAD.size)
            fn = self._functions[key]
            name = getattr(fn, "__name__", "?")
            call = FakeCall(self, ident, worker, name, fn, args, kwargs, self.provider.count(name))
            self.provider.calls.append(call)
            queue = self._queues.setdefault(worker, deque())
            queue.append(call)
            if len(queue) == 1:
                self._run(call)
        elif kind == Kind.RESTART:
            self.restarts.append(ident)
            for queue in self._queues.values():
                while queue:
                    self._result(queue.popleft(), Status.ABORTED, bytes(body), "aborted")
        elif kind == Kind.CANCEL:
            for worker, queue in self._queues.items():
                for call in list(queue):
                    if call.tid == ident:
                        head = queue[0] is call
                        queue.remove(call)
                        self._result(call, Status.CANCELLED, None, "cancelled")
                        if head:
                            self._next(worker, popped=True)
                        return
        elif kind == Kind.SHUTDOWN:
            self.end(0)

    def _run(self, call: FakeCall) -> None:
        self._send(Kind.STARTED, call.tid, b"")  # as the agent does before a call starts
        handler = self.provider.handlers.get(call.name)
        try:
            value = handler(call) if handler else call.fn(*call.args, **call.kwargs)
        except Exception as e:
            self._result(call, Status.ERROR, e)
            self._next(call.worker)
            return
        if value == HANG:
            return
        if value == LOSE:
            self.lose()
            return
        if value == DIE:
            if self.config.get("group"):  # as the agent does: the group must restart
                reason = "the process running a call was killed by SIGKILL"
                self._send(Kind.BROKEN, self.provider.generation(self), reason.encode())
            death = {"exitcode": -9, "stderr_tail": "fake death", "pid": self.pid}
            self._result(call, Status.DIED, death, "died")
        else:
            self._result(call, Status.OK, value)
        self._next(call.worker)

    def _next(self, worker: int, popped: bool = False) -> None:
        queue = self._queues[worker]
        if not popped and queue:
            queue.popleft()
        if queue and self.status is None:
            self._run(queue[0])

    def _result(self, call: FakeCall, status: int, value: Any, how: str = "") -> None:
        if status == Status.OK:
            payload = b"".join(bytes(p) for p in encode(pickle_obj(value)))
        elif status == Status.ERROR:
            tb = "".join(traceback.format_exception(value))
            described = (cloudpickle.dumps(value), type(value).__qualname__, str(value), tb)
            payload = b"".join(bytes(p) for p in encode(pickle_obj(described)))
        elif status == Status.DIED:
            payload = json.dumps(value).encode()
        else:
            payload = value or b""
        call.answered = how or ("ok" if status == Status.OK else "error")
        self._send(Kind.RESULT, call.tid, bytes((status,)) + payload)


class FakeAllocation(Allocation):
    """Machines that are names; replacing one makes a new name."""

    def __init__(self, provider: FakeProvider, spec: PoolSpec) -> None:
        super().__init__(spec, [provider.machine(rank) for rank in range(spec.nodes)])
        self.provider = provider

    async def start_agent(self, machine: Machine) -> AgentProcess:
        gate = self.provider.start_gate
        if gate is not None:  # a test holds the start of agents
            await asyncio.get_running_loop().run_in_executor(None, gate.wait)
        if machine.ident in self.provider.broken_machines:
            raise ProvisionError(f"{machine.host}: the fake machine cannot start an agent")
        agent = FakeAgent(self.provider, machine)
        self.provider.agents.append(agent)
        self.provider.events.append(("start", machine.rank, machine.ident))
        return agent

    async def replacement(self, rank: int, reason: str) -> Machine:
        self.provider.events.append(("replace", rank, reason))
        if self.provider.no_spares:
            raise ProvisionError(f"no machine to replace node {rank} with")
        if self.provider.replace_error is not None:
            raise self.provider.replace_error
        return self.provider.machine(rank)

    async def free(self) -> None:
        self.provider.events.append(("release", -1, ""))


@dataclass(eq=False)
class FakeProvider(Provider):
    """A provider whose machines and agents live in this process.

    Attributes:
        handlers: function name -> handler (see the module docstring).
        calls: every call any agent received, in order.
        agents: every agent started, in order.
        events: ("start", rank, machine) / ("replace", rank, reason) / ("release", -1, "").
        no_spares: replacing a machine fails (a ProvisionError).
        replace_error: when set, what replacing a machine raises.
        broken_machines: idents of machines on which no agent starts.
        fail_config: executors fail to start (READY with an error).
        start_gate: when set, agents start only once it is set (a slow provider).
    """

    handlers: dict[str, Callable[[FakeCall], Any]] = field(default_factory=dict)
    calls: list[FakeCall] = field(default_factory=list)
    agents: list[FakeAgent] = field(default_factory=list)
    events: list[tuple[str, int, str]] = field(default_factory=list)
    no_spares: bool = False
    replace_error: BaseException | None = None
    broken_machines: set[str] = field(default_factory=set)
    fail_config: bool = False
    start_gate: threading.Event | None = None
    allocation: FakeAllocation | None = None

    name = "fake"
    shares_filesystem = True

    def __post_init__(self) -> None:
        self.pids = itertools.count()
        self._machines = itertools.count()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def on(self, name: str, handler: Callable[[FakeCall], Any]) -> None:
        """Answer calls of the function ``name`` with ``handler``."""
        self.handlers[name] = handler

    async def acquire(self, spec: PoolSpec) -> FakeAllocation:
        self.allocation = FakeAllocation(self, spec)
        return self.allocation

    def machine(self, rank: int) -> Machine:
        n = next(self._machines)
        return Machine(rank, f"fake{n}", f"10.99.0.{n + 1}", f"fake-machine-{n}")

    def count(self, name: str) -> int:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + 1
            return self._counts[name]

    def generation(self, agent: FakeAgent) -> int:
        return agent.restarts[-1] if agent.restarts else 0

    @property
    def live(self) -> list[FakeAgent]:
        """The agent currently serving each rank (the last one started at that rank)."""
        by_rank: dict[int, FakeAgent] = {}
        for agent in self.agents:
            if agent.info.node >= 0:
                by_rank[agent.info.node] = agent
        return [by_rank[r] for r in sorted(by_rank)]
