"""The executors' processes: forked with their pipes, their output forwarded, ended and
closed (standard library only).

:class:`ExecutorProcesses` is the part of the :class:`~flotilla._node.supervisor.Supervisor`
that deals with processes: it forks each executor (:mod:`flotilla._node.executor`) with
four pipes (tasks in, results out, its stdout and stderr), or one process for every thread
slot, in a process group of its own that dies with the agent (:func:`die_with_agent`: a
fifth pipe, its lifeline); forwards what they write to
the client as OUTPUT frames (stderr's last lines kept to explain a death); kills a slot's
process group and closes its pipes; and reaps the processes that ended or were killed
without waiting in the agent's loop (:class:`Grave`: a pidfd watched with the pipes), so
that a process slow to die (a large one on a busy machine, one stuck in the kernel) never
stops the agent from beating and serving its other slots; the slot's next process starts
once the last one is gone (its ports and memory free). What the executors are given and
what their ends mean is the supervisor's (see its module docstring).
"""

from __future__ import annotations

import _pickle as pickle  # pickle.py adds re, struct and its Python twin: ~1 ms of a start
import contextlib
import fcntl
import os
import select
import sys
import time
from collections import deque
from collections.abc import Callable
from functools import partial

from .._system import fastjson as json
from .._system.procs import die_with_parent
from .._wire.bodies import Config, Ready, dump
from .._wire.frames import HEADER, Buffer, FrameReader, Kind, Status, frame
from .batching import Policy
from .eventloop import Outbox, Poller
from .lanes import (
    CLAIMED,
    CLOSED,
    LANE_POLL,
    RUNNING,
    SEEN,
    SEQ,
    Board,
    Lane,
    LaneSocket,
    claimed,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # (typeshed has no _signal: signal's names, its types)
else:
    import _signal  # signal.py's C module: the same calls and SIG* ints, without its enums

STDERR_TAIL_LINES = 40
"""Lines of an executor's (or the build's) stderr kept to explain its death."""
EXIT_GRACE = 2.0
"""Seconds an executor whose result channel ended gets to exit by itself (its own exit
status explains its death) before it is killed."""
REAP_POLL = 0.05
"""Seconds between two looks at an ended process the agent cannot reap yet (see Grave)."""
STUCK_AFTER = 30.0
"""Seconds a killed process may take to end before the agent tells the client that its
slot is left without a process (``FLOTILLA_STUCK_WARNING`` in the agent's environment:
another number of seconds)."""
STUCK_VAR = "FLOTILLA_STUCK_WARNING"
START_GRACE = 10.0
"""Seconds past the pool's start timeout a replacement executor may take to say READY
before it is killed (:func:`end_unstarted`): a plugin that waits up to the
start timeout itself (the torch plugin's rendezvous) fails first, in its own words."""


class ExecState:
    """Lifecycle of an executor process (transitions in the module docstring): an
    executor's ``state`` is one of these strings (not an ``Enum``'s: its module and class
    would cost every node's start ~2 ms)."""

    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Task:
    """A call sent to a slot: its TASK frame, kept to send again to a new executor.

    (This module's records are plain classes: making a dataclass compiles its methods,
    ~0.5 ms each, and every agent's start imports this module.)"""

    def __init__(self, ident: int, timeout: float, frame: list[Buffer]) -> None:
        self.ident = ident
        self.timeout = timeout
        self.frame = frame
        self.deadline = 0.0
        self.announced = False  # STARTED was sent to the client
        self.cancelled = False  # cancelled once given to the executor (the client was told)

    def arm(self, now: float) -> None:
        """It runs from ``now``: its deadline (0: none)."""
        self.deadline = now + self.timeout if self.timeout > 0 else 0.0


class Executor:
    """One executor process and the pipes the agent holds to it."""

    def __init__(
        self,
        slot: Slot,
        pid: int,
        to_fd: int,
        from_fd: int,
        out_fd: int,
        err_fd: int,
        outbox: Outbox,
        life_fd: int = -1,
    ) -> None:
        self.slot, self.pid, self.outbox = slot, pid, outbox
        # the agent's ends of its pipes: its tasks, its results, its stdout, its stderr
        self.to_fd, self.from_fd, self.out_fd, self.err_fd = to_fd, from_fd, out_fd, err_fd
        self.life_fd = life_fd  # the write end of its lifeline (see die_with_agent); -1: another's
        self.reader = FrameReader()
        self.state = ExecState.STARTING
        self.stderr_tail: deque[bytes] = deque(maxlen=STDERR_TAIL_LINES)
        self.partial_err = b""
        self.stored = False  # it used the distributed collections
        self.closed = False  # its pipes are closed (it was killed, or its end was handled)
        self.board: Board | None = None  # its lane's shared words, if it has a lane (lanes.py)
        self.start_deadline = 0.0  # a replacement's: READY by then (monotonic), see end_unstarted


class Slot:
    """One local rank of the node: its executor (replaced when it dies) and its tasks.

    ``tasks`` are run in order; the first ``fed`` of them were sent to the current executor
    (``tasks[0]`` is the one running once ``fed``); the others stay here until their turn.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tasks: deque[Task] = deque()
        self.executor: Executor | None = None
        self.fed = 0
        self.restarts = 0
        self.ready = False
        self.quick = False  # its last task took less than QUICK: give it a WINDOW ahead
        self.began = 0.0  # when tasks[0] began (monotonic), once fed
        self.dying = 0  # its last process (ended or killed) until it is reaped: no new one before
        self.start_due = False  # a new process starts once ``dying`` is reaped


class Grave:
    """A process that ended or was killed, waited for in the agent's loop (its pidfd).

    ``then`` gets its exit status once it is reaped; past ``deadline`` (monotonic, 0: none)
    it is killed. A process that ended but is not the agent's to reap yet (a tracer holds
    it) is looked at again every :data:`REAP_POLL` seconds (``poll_at``), not in a spin.
    One killed (at ``killed``, monotonic) that has not ended :func:`stuck_after` seconds
    later (stuck in the kernel for good: its slot runs nothing meanwhile) is named to the
    client once (``warned``)."""

    def __init__(
        self,
        pid: int,
        slot: Slot,
        fd: int,
        then: Callable[[int | None], None] | None,
        deadline: float = 0.0,
        killed: float = 0.0,
    ) -> None:
        self.pid, self.slot, self.fd, self.then = pid, slot, fd, then
        self.deadline, self.killed = deadline, killed
        self.poll_at = 0.0
        self.warned = False


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
    graves: dict[int, Grave]  # by pidfd
    lanes: LaneSocket | None
    unsent: set[Executor]  # executors whose output read last is still in the client outbox
    held: dict[Slot, tuple[float, float]]  # slots held for a lane call: (look at, pause)
    generation: int  # of the pool's process group (see the supervisor)

    def _began(self, slot: Slot, ex: Executor) -> None:
        raise NotImplementedError

    def _ended(self, ex: Executor, reason: str, status: int | None) -> None:
        raise NotImplementedError

    def _feed(self, slot: Slot, before: list[Buffer] | None = None) -> None:
        raise NotImplementedError

    def _replace(self, slot: Slot, reason: str) -> None:
        raise NotImplementedError

    def start_all(self) -> None:
        warm(shared=len(self.slots) > 1 and not self.threads)
        config = self.config
        if config is not None and config.get("preload") and _preload != "done":
            if _preload != "running":  # (here again once it is done)
                preload_beside(self.sel, config, then=self.start_all)
            return
        for slot in self.slots:
            self._start(slot)

    def kill_all(self) -> None:
        """Kill every executor and wait for each (the agent ends)."""
        for slot in self.slots:
            self._kill(slot, wait=True)
        self._bury_all()

    @property
    def idle(self) -> bool:
        """Whether no executor is left."""
        return all(s.executor is None for s in self.slots)

    def outboxes(self) -> list[Outbox]:
        return [s.executor.outbox for s in self.slots if s.executor is not None]

    def _exited(self, ex: Executor, wait: bool = False, reason: str = "") -> None:
        """``ex``'s result channel ended (``reason``: why, when the agent ended it; else
        its exit status says, once it is reaped: :meth:`_ended`). It gets
        :data:`EXIT_GRACE` seconds to exit by itself, unless it was killed (``wait``);
        the agent's loop goes on meanwhile."""
        self.sel.unregister(ex.from_fd)  # (read to its end)
        self._bury(ex.slot, ex.pid, partial(self._ended, ex, reason), 0.0 if wait else EXIT_GRACE)

    def _start(self, slot: Slot) -> None:
        assert self.config is not None
        if self.stopping:
            return
        if slot.dying:  # its last process is not gone yet: started once it is (_reaped)
            slot.start_due = True
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
        lanes = self.lanes
        lane = None
        if lanes is not None and not lanes.broken and not self.config.get("group"):
            try:
                lane = Lane()
            except (OSError, AttributeError):  # (out of descriptors; no memfd: not Linux)
                lane = None
        mine = [*lane.client, lane.board.fd] if lane is not None else []
        pid, r_out, r_err, life = self._fork([w_task, r_res, *theirs, *mine])
        if pid == 0:  # the executor
            try:
                from .executor import main

                config: Config = {
                    **self.config,
                    "local_rank": slot.rank,
                    "generation": self.generation,
                }
                if lane is not None:
                    main(config, self.blob, r_task, w_res, lane=(*lane.theirs, lane.board))
                main(config, self.blob, r_task, w_res)
            finally:
                os._exit(70)
        for fd in (r_task, w_res):
            os.close(fd)
        ex = Executor(slot, pid, w_task, r_res, r_out, r_err, Outbox(w_task), life)
        ex.board = lane.board if lane is not None else None
        start_timeout = float(self.config.get("start_timeout", 0.0))
        if slot.restarts and start_timeout > 0:  # a replacement: no client waits for it
            ex.start_deadline = time.monotonic() + start_timeout + START_GRACE
        self._began(slot, ex)  # (the functions are in its task pipe before the lane is given)
        if lane is not None and lanes is not None:
            lanes.give(lane, slot.rank, pid)

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
        if any(s.executor is not None or s.dying for s in self.slots):
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
                config: Config = {
                    **self.config,
                    "local_rank": self.slots[0].rank,
                    "generation": self.generation,
                }
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
        board = ex.board
        if board is not None:  # odd while output is on its way (see lanes.py)
            board.set(SEQ, board.get(SEQ) | 1)
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            data = None
        if data:
            if stream == 2:
                lines = (ex.partial_err + data).split(b"\n")
                ex.partial_err = lines.pop()[-4096:]
                ex.stderr_tail.extend(line[-1000:] for line in lines)
            self.client.send(frame(Kind.OUTPUT, stream | ex.slot.rank << 8, data))
        elif data is not None:
            self.sel.unregister(fd)
        if board is not None:
            if self.client.queue:  # not out yet: even once the client's outbox is empty
                self.unsent.add(ex)
            else:
                _output_out(board)
        return bool(data)

    def output_out(self) -> None:
        """The client's outbox is empty: the output read before has left (see lanes.py)."""
        unsent, self.unsent = self.unsent, set()
        for ex in unsent:
            if ex.board is not None:
                _output_out(ex.board)

    def _death(self, ex: Executor, reason: str, status: int | None) -> Ready:
        """A DIED result's body: how ``ex`` ended (``reason``: why, when the agent ended
        it), its stderr's last lines."""
        tail = list(ex.stderr_tail) + ([ex.partial_err] if ex.partial_err else [])
        death: Ready = {
            "exitcode": os.waitstatus_to_exitcode(status) if status is not None else None,
            "stderr_tail": b"\n".join(tail).decode(errors="replace"),
            "pid": ex.pid,
            "local_rank": ex.slot.rank,
        }
        if reason:
            death["reason"] = reason
        return death

    def _cancel_lane(self, ident: int) -> None:
        """CANCEL of a lane call (see lanes.py): CANCELLED, and its executor replaced if
        it runs it; one waiting in the lane is skipped there (what it says is dropped),
        unless it began meanwhile: the executor says it runs before it looks for a
        CANCEL, so one of the two sees the other's word."""
        for slot in self.slots:
            ex = slot.executor
            board = ex.board if ex is not None else None
            if ex is None or board is None or board.get(CLAIMED) != ident:
                continue
            self.client.send(frame(Kind.RESULT, ident, bytes((Status.CANCELLED,))))
            if board.get(RUNNING) != ident:
                ex.outbox.send(frame(Kind.CANCEL, ident))
                if board.get(RUNNING) != ident:
                    return
            slot.fed = 0  # a task given behind it did not start: the next process's
            self._kill(slot)
            self._replace(slot, "a running call was cancelled")
            return

    def _look_at_lanes(self, now: float) -> None:
        """Feed the slots held for a lane call that ended (time a task given behind it
        from now, see the supervisor's ``_feed``); look again later at the others."""
        for slot, (at, pause) in list(self.held.items()):
            if now < at:
                continue
            ex = slot.executor
            if ex is not None and ex.board is not None and claimed(ex.board):
                self.held[slot] = (now + pause, min(pause * 2, LANE_POLL[1]))
                continue
            del self.held[slot]
            if slot.fed:
                slot.tasks[0].arm(now)
            else:
                self._feed(slot)

    def _lane_holds(self, slot: Slot) -> bool:
        """Whether ``slot``'s next task waits: a lane call is claimed on its executor,
        which runs nothing of the agent's (the slot is held, looked at again)."""
        ex = slot.executor
        if ex is None or ex.board is None or slot.fed or not claimed(ex.board):
            return False
        self._hold(slot)
        return True

    def _behind_lane(self, slot: Slot) -> None:
        """``slot``'s first task was just given: if a lane call was claimed meanwhile,
        the task may wait behind it, so it is timed only once that ended."""
        ex = slot.executor
        if ex is not None and ex.board is not None and claimed(ex.board):
            slot.tasks[0].deadline = 0.0
            self._hold(slot)

    def _hold(self, slot: Slot) -> None:
        """Give ``slot`` no task while a lane call is claimed on it (looked at again)."""
        if slot not in self.held:
            self.held[slot] = (time.monotonic() + LANE_POLL[0], LANE_POLL[0] * 2)

    def _lane_closed(self, ex: Executor, death: Ready | None = None) -> bool:
        """``ex`` ended or is stopped: the lane call claimed on it, if any, ends (DIED,
        with ``death``: see lanes.py); whether that call was running (else it had not
        started, and a task the agent gave ``ex`` was the one running)."""
        board = ex.board
        if board is None:
            return False
        ex.board = None
        self.unsent.discard(ex)
        board.set(CLOSED, 1)
        kill_group(ex.pid)  # (a system call between the write and the read: see lanes.py)
        ident = board.get(CLAIMED)
        board.set(SEEN, ident or -1)
        ran = board.get(RUNNING)
        if not ident or ran == -ident:  # none, or answered (the client reads it)
            return False
        running = ran == ident
        if death is None:
            death = {"exitcode": None, "pid": ex.pid, "local_rank": ex.slot.rank}
            death["reason"] = "was stopped by its agent" if running else "was replaced"
        body = json.dumps(death).encode()
        self.client.send(frame(Kind.RESULT, ident, bytes((Status.DIED,)), body))
        return running

    def _drain_output(self, ex: Executor) -> None:
        """Forward what the executor wrote before it exited."""
        for fd, stream in ((ex.out_fd, 1), (ex.err_fd, 2)):
            while fd in self.sel and self._forward_output(ex, fd, stream):
                pass

    def _kill(self, slot: Slot, wait: bool = False) -> None:
        """Kill the slot's process (its process group) and close its pipes; it is reaped
        in the loop (:meth:`_bury`), or here with ``wait`` (the agent's exit)."""
        ex = slot.executor
        if ex is None:
            return
        if self.threads and not self.shared_death:
            self.shared_death = (
                "was replaced with the node's other thread slots: they share one process, "
                f"and the call of slot {slot.rank} had to be stopped"
            )
        self._close(ex)  # (its process group killed there)
        if wait:
            reap(ex.pid, wait=True)
        else:
            self._bury(slot, ex.pid, None)

    def _bury(
        self,
        slot: Slot,
        pid: int,
        then: Callable[[int | None], None] | None,
        grace: float = 0.0,
    ) -> None:
        """Reap ``pid`` (``slot``'s process, which ended or was killed) without waiting
        in the agent's loop: at once if it is gone, else when its pidfd says so; ``then``
        gets its exit status. Killed after ``grace`` seconds (0: it was killed already).
        The slot starts no new process meanwhile (see :meth:`_start`). Where there is no
        pidfd (not Linux 5.3+), it is waited for here, as much as ``grace`` allows."""
        done, status = _poll(pid)
        fd = -1
        if not done:
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):  # (a process reaped meanwhile: ESRCH)
                status = reap(pid, wait=not grace)
        if fd < 0:
            kill_group(pid)  # whatever the process left behind in its group
            if then is not None:
                then(status)
            return
        now = time.monotonic()
        deadline, killed = (now + grace, 0.0) if grace else (0.0, now)
        self.graves[fd] = Grave(pid, slot, fd, then, deadline, killed=killed)
        slot.dying = pid
        self.sel.register(fd, False, partial(self._reaped, fd))

    def _reaped(self, fd: int) -> None:
        """A buried process ended (its pidfd is readable): reap it, tell its ``then``,
        and start its slot's next process if one is due."""
        grave = self.graves[fd]
        done, status = _poll(grave.pid)
        self.sel.unregister(fd)  # (its pidfd stays readable: looked at in time from now)
        if not done:
            grave.poll_at = time.monotonic() + REAP_POLL
            return
        del self.graves[fd]
        os.close(fd)
        slot = grave.slot
        if slot.dying == grave.pid and not any(g.slot is slot for g in self.graves.values()):
            slot.dying = 0
        kill_group(grave.pid)  # whatever the process left behind in its group
        if grave.then is not None:
            grave.then(status)
        if slot.start_due and not slot.dying:
            slot.start_due = False
            self._start(slot)

    def _bury_overdue(self, now: float) -> None:
        """Kill the buried processes past their grace; look again at those not reaped;
        name those killed long ago that still have not ended."""
        for fd, grave in list(self.graves.items()):
            if grave.deadline and now >= grave.deadline:
                grave.deadline, grave.killed = 0.0, now
                kill_group(grave.pid)
                with contextlib.suppress(OSError):  # (one that left its group)
                    os.kill(grave.pid, _signal.SIGKILL)
            if grave.killed and not grave.warned and now >= grave.killed + stuck_after():
                grave.warned = True
                slot, waited = grave.slot.rank, now - grave.killed
                said = (
                    f"flotilla agent: slot {slot} has no process: its last one (pid "
                    f"{grave.pid}{_state(grave.pid)}) was killed {waited:.0f} s ago and is "
                    "not gone (stuck in the kernel?); the slot starts a new one once it is\n"
                )
                self.client.send(frame(Kind.OUTPUT, 2 | slot << 8, said.encode()))
            if grave.poll_at and now >= grave.poll_at:
                self._reaped(fd)

    def _graves_due(self, wake: float) -> float:
        """The earliest moment (monotonic) a buried process needs a look (its grace ends,
        its next poll, its warning), or ``wake``."""
        for grave in self.graves.values():
            stuck = grave.killed + stuck_after() if grave.killed and not grave.warned else 0.0
            for due in (grave.deadline, grave.poll_at, stuck):
                if due:
                    wake = min(wake, due)
        return wake

    def _bury_all(self) -> None:
        """Wait here for every buried process (the agent ends)."""
        for fd, grave in list(self.graves.items()):
            kill_group(grave.pid)
            reap(grave.pid, wait=True)
            self.sel.unregister(fd)
            os.close(fd)
            grave.slot.dying = 0
        self.graves.clear()

    def _close(self, ex: Executor) -> None:
        if ex.closed:
            return
        ex.closed = True
        self._lane_closed(ex)
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


def starts_due(procs: ExecutorProcesses, wake: float) -> float:
    """``wake``, or the start deadline of a replacement executor not READY yet if earlier
    (see :func:`end_unstarted`)."""
    for slot in procs.slots:
        ex = slot.executor
        if ex is not None and ex.start_deadline and ex.state is ExecState.STARTING:
            wake = min(wake, ex.start_deadline)
    return wake


def end_unstarted(procs: ExecutorProcesses, now: float) -> None:
    """Kill the replacement executors (a group's restart, a dead one's) not READY past
    their start deadline (the pool's start timeout and :data:`START_GRACE`: their
    plugins' set-up waits, e.g. a group's rendezvous whose peer never comes), and tell
    their start as failed (READY with the error and their stderr's last lines): the
    client waits for no READY from a replacement, so it would wait for its calls for
    good; it fails them saying why."""
    for slot in procs.slots:
        ex = slot.executor
        if ex is None or ex.state is not ExecState.STARTING or not ex.start_deadline:
            continue
        if now < ex.start_deadline:
            continue
        procs._drain_output(ex)
        timeout = float((procs.config or {}).get("start_timeout", 0.0))
        error = (
            f"the process did not start within {timeout:g} s (Options(start_timeout=...)): "
            "its plugins' set-up (a process group's rendezvous, for one) did not end; it "
            "was killed"
        )
        body = dump({"error": error, **procs._death(ex, "", None)})
        ex.state = ExecState.FAILED
        procs._kill(slot)
        procs.client.send(frame(Kind.READY, 0, body))


_warm = False


def warm(shared: bool = False) -> None:
    """Import, in the agent, once, before it forks its first executor, what every executor
    imports as it starts (its own modules, with the paused collector, then frozen as the
    agent's start-up is, see ``agent.main``): each executor is a fork that has them, and a
    node pays them once, not once per executor. Not cloudpickle, nor ``dataclasses`` (with
    ``inspect``, ~8 ms), which it and ``instance_info()`` import: a node of one executor
    process imports them with the first call that needs them, if one does
    (``tests/test_layers.py``). ``shared``: the node runs several executor processes, which
    would each import ``dataclasses`` for ``instance_info()``: it is imported here, once."""
    global _warm
    if _warm:
        return
    _warm = True
    from . import hooks

    with hooks.collector_paused():
        if shared:
            import dataclasses  # noqa: F401
        from .._wire import serialize  # noqa: F401
        from . import executor, feeds  # noqa: F401


def log(message: str) -> None:
    """A line of the agent's on its stderr (the client keeps its last ones to explain a
    lost node)."""
    print(f"flotilla agent {os.getpid()}: {message}", file=sys.stderr, flush=True)


_preload = ""
"""Where this agent's :func:`preload_beside` is: "", "running", "done"."""


def preload(config: Config) -> list[str]:
    """Import, in the agent, once, before it forks its first executor, the modules the
    plugins name (``config["preload"]``, a plugin's ``preload``: torch's ~2 CPU-s, with
    ``torch._dynamo`` ~4): every executor, and every process a group restart starts again,
    is a fork that has them, instead of importing them itself. They are imported as an
    executor would import them (its import path and environment, :func:`.executor.import_setting`,
    the agent's own restored afterwards) with the collector paused, then frozen. One that
    fails to import is left to the executors, whose plugin reports why: what its import
    added to ``sys.modules`` under its package is dropped (:func:`forget`), for a fork
    that has a package's submodules without the package imports it in another order
    (torch's circular imports then fail). Returns ``name: error`` for each that failed."""
    from . import hooks
    from .executor import import_setting

    paths, env = import_setting(config)
    agent_path, agent_env = sys.path[:], dict(os.environ)
    sys.path[:0] = paths
    os.environ.update(env)
    failed = []
    try:
        with hooks.collector_paused():
            for name in config.get("preload", ()):
                before = set(sys.modules)
                try:
                    __import__(name)
                except Exception as e:  # (the executor's own import says why)
                    failed.append(f"{name}: {type(e).__name__}: {e}")
                    forget(name.partition(".")[0], set(sys.modules) - before)
    finally:
        sys.path[:] = agent_path
        for name in set(os.environ) - set(agent_env):
            del os.environ[name]
        os.environ.update(agent_env)
    return failed


def forget(package: str, added: set[str]) -> None:
    """Drop the modules of ``added`` that are ``package`` or in it from ``sys.modules``,
    and from their parent's attributes (``from package import sub`` looks there first)."""
    for name in sorted(added, reverse=True):  # (a submodule before its package)
        if name != package and not name.startswith(package + "."):
            continue
        module = sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        owner = sys.modules.get(parent) if parent else None
        if owner is not None and module is not None and getattr(owner, child, None) is module:
            delattr(owner, child)


def preload_beside(sel: Poller, config: Config, then: Callable[[], object]) -> None:
    """:func:`preload` in a thread, then ``then`` (the executors' forks) in the agent's
    loop, once the thread has ended (a fork keeps the calling thread alone): the loop goes
    on meanwhile, for an import of torch can take longer than the client waits for a
    beat. The thread sets the executors' import path and environment for the agent as a
    whole while it imports (:func:`preload`)."""
    import threading

    global _preload
    _preload = "running"
    done_r, done_w = os.pipe()

    failed: list[str] = []

    def run() -> None:  # (the thread)
        try:
            failed.extend(preload(config))
        finally:
            os.write(done_w, b".")
            os.close(done_w)

    def preloaded() -> None:
        global _preload
        sel.unregister(done_r)
        os.close(done_r)
        thread.join()
        _preload = "done"
        for failure in failed:
            log(f"could not preload {failure}; each process imports it itself")
        then()

    thread = threading.Thread(target=run, name="preload", daemon=True)
    sel.register(done_r, False, preloaded)
    thread.start()


def _output_out(board: Board) -> None:
    seq = board.get(SEQ)
    if seq & 1:
        board.set(SEQ, seq + 1)


def stuck_after() -> float:
    """:data:`STUCK_AFTER`, or the seconds ``FLOTILLA_STUCK_WARNING`` gives (a positive
    number; anything else is ignored)."""
    try:
        seconds = float(os.environ.get(STUCK_VAR) or STUCK_AFTER)
    except ValueError:
        return STUCK_AFTER
    return seconds if seconds > 0 else STUCK_AFTER


def _state(pid: int) -> str:
    """``pid``'s state as /proc names it (", state D": in an uninterruptible wait), or ""."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return f", state {chr(stat[stat.rindex(b')') + 2])}"
    except (OSError, ValueError, IndexError):
        return ""


def _poll(pid: int) -> tuple[bool, int | None]:
    """Whether ``pid`` is gone (reaped now, or not a child any more), and its status."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True, None
    return bool(done), status if done else None


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
        fcntl.fcntl(fd, fcntl.F_SETSIG, _signal.SIGKILL)
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
    signal_group(pgid, _signal.SIGKILL)


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group, if it is still there."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
