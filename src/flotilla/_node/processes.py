"""The executors' processes: forked with their pipes, their output forwarded, ended and
closed (standard library only).

:class:`ExecutorProcesses` is the part of the :class:`~flotilla._node.supervisor.Supervisor`
that deals with processes: it forks each executor (:mod:`flotilla._node.executor`) with
four pipes (tasks in, results out, its stdout and stderr), or one process for every thread
slot, in a process group of its own that dies with the agent (:func:`die_with_agent`: a
fifth pipe, its lifeline); forwards what they write to
the client as OUTPUT frames (stderr's last lines kept to explain a death); kills a slot's
process group and closes its pipes. What the executors are given and what their ends mean
is the supervisor's (see its module docstring).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import select
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from .._system.procs import die_with_parent
from .._wire.bodies import Config
from .._wire.frames import HEADER, Buffer, FrameReader, Kind, frame
from .batching import Policy
from .eventloop import Outbox, Poller

STDERR_TAIL_LINES = 40
"""Lines of an executor's (or the build's) stderr kept to explain its death."""


class ExecState(Enum):
    """Lifecycle of an executor process (transitions in the module docstring)."""

    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass
class Task:
    """A call sent to a slot: its TASK frame, kept to send again to a new executor."""

    ident: int
    timeout: float
    frame: list[Buffer]
    deadline: float = 0.0
    announced: bool = False  # STARTED was sent to the client
    cancelled: bool = False  # cancelled once given to the executor (the client was told)


@dataclass(eq=False)
class Executor:
    """One executor process and the pipes the agent holds to it."""

    slot: Slot
    pid: int
    to_fd: int
    from_fd: int
    out_fd: int
    err_fd: int
    outbox: Outbox
    life_fd: int = -1  # the write end of its lifeline (see die_with_agent); -1: another's
    reader: FrameReader = field(default_factory=FrameReader)
    state: ExecState = ExecState.STARTING
    stderr_tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    partial_err: bytes = b""
    stored: bool = False  # it used the distributed collections


@dataclass(eq=False)
class Slot:
    """One local rank of the node: its executor (replaced when it dies) and its tasks.

    ``tasks`` are run in order; the first ``fed`` of them were sent to the current executor
    (``tasks[0]`` is the one running once ``fed``); the others stay here until their turn.
    """

    rank: int
    tasks: deque[Task] = field(default_factory=deque)
    executor: Executor | None = None
    fed: int = 0
    restarts: int = 0
    ready: bool = False
    quick: bool = False  # its last task took less than QUICK: give it a WINDOW ahead
    began: float = 0.0  # when tasks[0] began (monotonic), once fed


class ExecutorProcesses:
    """The executors' processes of a :class:`~flotilla._node.supervisor.Supervisor` (see
    the module docstring): the supervisor sets these attributes and gives each new
    process its slot's work (``_began``)."""

    sel: Poller
    client: Outbox
    agent_fds: tuple[int, ...]
    config: Config | None
    blob: bytes
    slots: list[Slot]
    stopping: bool
    threads: bool
    shared_death: str
    policy: Policy
    requests: dict[int, tuple[Executor, int]]
    inherited: Callable[[], list[int]]

    def _began(self, slot: Slot, ex: Executor) -> None:
        raise NotImplementedError

    def _start(self, slot: Slot) -> None:
        assert self.config is not None
        if self.stopping:
            return
        if self.threads:
            self._start_threads()
            return
        r_task, w_task = os.pipe()
        r_res, w_res = os.pipe()
        others = [o.executor for o in self.slots if o.executor is not None]
        theirs = [
            fd for ex in others for fd in (ex.to_fd, ex.from_fd, ex.out_fd, ex.err_fd, ex.life_fd)
        ]
        pid, r_out, r_err, life = self._fork([w_task, r_res, *theirs])
        if pid == 0:  # the executor
            try:
                from .executor import main

                main({**self.config, "local_rank": slot.rank}, self.blob, r_task, w_res)
            finally:
                os._exit(70)
        for fd in (r_task, w_res):
            os.close(fd)
        ex = Executor(slot, pid, w_task, r_res, r_out, r_err, Outbox(w_task), life)
        self._began(slot, ex)

    def _fork(self, close: list[int]) -> tuple[int, int, int, int]:
        """Fork an executor, its stdout and stderr into pipes the agent reads. In the agent:
        (its pid, the read ends of those pipes, the write end of its lifeline). In the
        executor: (0, -1, -1, -1), once it closed the agent's descriptors and ``close``
        (-1s skipped), took a process group of its own, the child's policy and death with
        the agent, and stdin from /dev/null (it exits 70 if any of that fails)."""
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        r_life, w_life = os.pipe()
        sys.stderr.flush()
        pid = os.fork()
        if pid != 0:
            for fd in (w_out, w_err, r_life):
                os.close(fd)
            return pid, r_out, r_err, w_life
        try:
            self.sel.close()
            for fd in (*self.agent_fds, *self.inherited(), *close, r_out, r_err, w_life):
                if fd >= 0:
                    os.close(fd)
            os.setpgid(0, 0)
            self.policy.in_child()
            die_with_agent(r_life)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(w_out, 1)
            os.dup2(w_err, 2)
            for fd in (devnull, w_out, w_err):
                os.close(fd)
        except BaseException:
            os._exit(70)
        return 0, -1, -1, -1

    def _start_threads(self) -> None:
        """Start the process of every thread slot, once none is left (see the module
        docstring): the first slot in its main thread, the others in threads."""
        assert self.config is not None
        if any(s.executor is not None for s in self.slots):
            return  # the others' ends are still to be read: the last one starts it
        pipes = [(os.pipe(), os.pipe()) for _ in self.slots]  # (task r, w), (result r, w)
        pid, r_out, r_err, life = self._fork([fd for (_, w), (r, _) in pipes for fd in (w, r)])
        if pid == 0:  # the executor
            try:
                from .executor import main

                (r_first, _), (_, w_first) = pipes[0]
                others = [
                    (s.rank, p[0][0], p[1][1])
                    for s, p in zip(self.slots[1:], pipes[1:], strict=True)
                ]
                config: Config = {**self.config, "local_rank": self.slots[0].rank}
                main(config, self.blob, r_first, w_first, others)
            finally:
                os._exit(70)
        self.shared_death = ""
        for slot, ((r_task, w_task), (r_res, w_res)) in zip(self.slots, pipes, strict=True):
            os.close(r_task)
            os.close(w_res)
            first = slot is self.slots[0]
            out, err, mine = (r_out, r_err, life) if first else (-1, -1, -1)
            self._began(slot, Executor(slot, pid, w_task, r_res, out, err, Outbox(w_task), mine))

    def _on_output(self, ex: Executor, stream: int) -> None:
        self._forward_output(ex, ex.out_fd if stream == 1 else ex.err_fd, stream)

    def _forward_output(self, ex: Executor, fd: int, stream: int) -> bool:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not data:
            self.sel.unregister(fd)
            return False
        if stream == 2:
            lines = (ex.partial_err + data).split(b"\n")
            ex.partial_err = lines.pop()[-4096:]
            ex.stderr_tail.extend(line[-1000:] for line in lines)
        self.client.send(frame(Kind.OUTPUT, stream | ex.slot.rank << 8, data))
        return True

    def _drain_output(self, ex: Executor) -> None:
        """Forward what the executor wrote before it exited."""
        for fd, stream in ((ex.out_fd, 1), (ex.err_fd, 2)):
            while fd in self.sel and self._forward_output(ex, fd, stream):
                pass

    def _kill(self, slot: Slot) -> None:
        ex = slot.executor
        if ex is None:
            return
        if self.threads and not self.shared_death:
            self.shared_death = (
                "was replaced with the node's other thread slots: they share one process, "
                f"and the call of slot {slot.rank} had to be stopped"
            )
        kill_group(ex.pid)
        reap(ex.pid, wait=True)
        self._close(ex)

    def _close(self, ex: Executor) -> None:
        for fd in (ex.from_fd, ex.out_fd, ex.err_fd, ex.to_fd):
            self.sel.unregister(fd)
            try:
                os.close(fd)
            except OSError:
                pass
        if ex.life_fd >= 0:  # its lifeline: the process is killed here anyway
            os.close(ex.life_fd)
            ex.life_fd = -1
        kill_group(ex.pid)  # whatever the task left behind in its process group
        for relay in [r for r, (e, _) in self.requests.items() if e is ex]:
            del self.requests[relay]
        if ex.stored:  # the collections release what it held (its locks); no answer
            gone = pickle.dumps(("process", "", "gone", ex.pid))
            self.client.send([HEADER.pack(Kind.STORE, 0, len(gone)), gone])
            ex.stored = False
        if ex.slot.executor is ex:
            ex.slot.executor = None


def die_with_agent(fd: int) -> None:
    """In a new executor: have the kernel SIGKILL it once the agent is gone, however the
    agent ends (a SIGKILL too), even while a user function holds the GIL in C code.

    ``fd`` is the read end of the executor's lifeline, a pipe whose write end only the
    agent holds (every other process it forks closes it) and never writes to: when that
    end is closed (the agent died, or closed it in ``_close``) the read end's owner is sent
    its I/O signal, set to SIGKILL (``F_SETOWN``, ``F_SETSIG``, ``O_ASYNC``). It is kept
    across an exec (as ``PR_SET_PDEATHSIG`` is, which this replaces: its only way from
    Python is ``ctypes``, ~3-4 ms of CPU to import in every remote executor). Exits 1 when
    the agent is gone already; where ``F_SETSIG`` is missing, ``die_with_parent``."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGKILL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    except (AttributeError, OSError):
        die_with_parent()
        return
    os.set_inheritable(fd, True)
    if select.select([fd], [], [], 0)[0]:  # closed before the signal was armed
        os._exit(1)


def reap(pid: int, wait: bool = False) -> int | None:
    """Wait for ``pid``; give it up to 2 s to exit by itself unless ``wait``."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            done, status = os.waitpid(pid, 0 if wait else os.WNOHANG)
        except ChildProcessError:
            return None
        if done:
            return status
        if time.monotonic() > deadline:
            kill_group(pid)
            wait = True
        else:
            time.sleep(0.005)


def kill_group(pgid: int) -> None:
    """SIGKILL a process group, if it is still there."""
    signal_group(pgid, signal.SIGKILL)


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group, if it is still there."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
