"""The agent's executors: one process per local rank, forked, fed, watched and replaced
(standard library only).

The :class:`Supervisor` forks each executor (:mod:`flotilla._node.executor`; the
processes' side is :mod:`flotilla._node.processes`) with four pipes: tasks in, results out,
and its stdout and stderr, which are forwarded to the client as OUTPUT frames (drained
before results, so a task's output arrives before its result).
It enforces per-task timeouts and, when an executor dies, times out or has its running
task cancelled, starts a new one: the task it was running ends DIED/TIMEOUT/CANCELLED and
the queued ones go to the new process. In a pool whose processes form one
group (``config["group"]``: a plugin's collective, e.g. a torch process group) a lone new
process could not rejoin the group, so it tells the client instead (BROKEN), which restarts
every executor of the pool (RESTART: queued and running tasks end ABORTED). The client
awaits no READY from a replacement: one whose set-up does not end (a group's rendezvous
whose peer never comes) is killed past the pool's start timeout and its start told as
failed (``processes.end_unstarted``), so that its node's calls fail saying why.

An executor is given a task only once the client was told (STARTED, in the same write as
the result of the task before) and that has left the agent (its outbox to the client is
empty). So a task the client got no STARTED for has certainly not started, even when the
agent is killed: the client sends those again elsewhere when the node is lost
(``_client/dispatch.py``). An executor is given one task at a time, and a few
(:data:`WINDOW`) while its tasks are quick (the last one took less than :data:`QUICK`
seconds, and more were queued behind it: an idle executor starts again with one): those are
announced together and wait in its pipe, so that it goes from one to the next without
waiting for the agent, and no more calls than that count as started when the agent is
lost. A long task never has others given behind it until it ends.

Executor states (one executor per slot at a time)::

    STARTING --READY--> RUNNING --died / timeout / cancelled--> STARTING (a new process)
    RUNNING --died / timeout / cancelled, group pool--> (none) --RESTART--> STARTING
    RUNNING | STARTING --RESTART--> STARTING (a new process)
    STARTING --failed start--> FAILED
    STARTING (a replacement) --not READY past the start timeout (killed)--> FAILED
    RUNNING | STARTING --shutdown--> STOPPING --exited--> STOPPED

Lanes (:mod:`.lanes`): on a Local node, each executor of a pool of process slots that
forms no group also serves the client's lone calls straight (its lane), which the agent
never sees. The agent owns the slot still: it feeds it no task while a lane call is
claimed on the executor's board (it looks again on a timer), answers a CANCEL of a lane
call, and sends the DIED result of a lane call whose executor ended.

Thread slots (``Worker(executor="thread")``, ``config["threads"]``): one process serves
every slot, a thread each (shared memory and GIL, as Skyward's thread executor), with a
pair of pipes per slot, so each slot is fed and answers as above; output goes through the
first slot's pipes. A thread cannot be stopped: a call cancelled or timed out while
running, or a slot's death, replaces the process, and the calls the other slots were running
end DIED saying so; the new process is started once every slot's pipes are closed.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from functools import partial

from .._system import fastjson as json
from .._wire.bodies import Config, Ready, dump, load_ready
from .._wire.exits import describe_exit
from .._wire.frames import (
    HEADER,
    TASK_HEAD,
    Body,
    Buffer,
    FrameError,
    Kind,
    Status,
    frame,
)
from .batching import Policy
from .eventloop import Outbox, Poller
from .lanes import LaneSocket
from .processes import (
    ExecState,
    Executor,
    ExecutorProcesses,
    Grave,
    Slot,
    Task,
    kill_group,
)

WINDOW = 4
"""Tasks an executor is given at once while its tasks are quick (see the module docstring)."""
REFILL = 2
"""While quick tasks queue, the window is refilled this many tasks at a time (fewer writes
to the executor and fewer STARTED frames of their own), never below one task ahead."""
QUICK = 0.01
"""Seconds under which a task counts as quick: the next ones are given a window ahead."""
CANCEL_GRACE = 0.5
"""Seconds a cancelled task that was given ahead gets to be skipped by its executor once
its turn comes; past that it runs (it had started when the cancel came), and its process is
replaced."""


class Supervisor(ExecutorProcesses):
    """The node's executors (see the module docstring).

    Args:
        sel: the agent's poller; executor pipes are registered there.
        client: the agent's outbox to the client.
        agent_fds: the agent's own descriptors (the protocol), closed in each executor.
    """

    def __init__(self, sel: Poller, client: Outbox, agent_fds: tuple[int, ...]) -> None:
        self.sel = sel
        self.client = client
        self.agent_fds = agent_fds
        self.config: Config | None = None
        self.blob = b""  # the pickled plugins, for each executor
        self.defines: list[list[Buffer]] = []  # every DEFINE, for each new executor
        self.slots: list[Slot] = []
        self.stopping = False
        self.generation = 0  # of the pool's process group: RESTART frames count them
        self.waiting: set[Slot] = set()  # slots whose next task waits for the client outbox
        self.policy = Policy()  # SCHED_BATCH while tasks queue (see batching.py)
        self.deep = False  # a slot got more tasks than WINDOW since pace() last looked
        self._on_frame: dict[int, Callable[[Executor, int, Body], None]] = {
            Kind.RESULT: self._result,
            Kind.READY: self._ready,
            Kind.STORE: self._store,
            Kind.YIELD: self._yield,
            # leave for more of a streamed argument: to the client as well
            Kind.CREDIT: lambda ex, ident, body: self._yield(ex, ident, body, Kind.CREDIT),
        }
        # the collections' requests relayed to the client: agent id -> (executor, its id)
        self.requests: dict[int, tuple[Executor, int]] = {}
        self.request_ids = itertools.count(1)
        self.ready_extra: Ready = {}  # more for the node's READY (the relay port)
        self.inherited: Callable[[], list[int]] = list  # the agent's other descriptors
        # told each executor's RESULT (call id, status byte): the relay's kept files
        self.answered: Callable[[int, int], None] = lambda ident, status: None
        self.threads = False  # one process, a thread per slot (see the module docstring)
        self.shared_death = ""  # thread slots: why their process ended, for the others
        self.graves: dict[int, Grave] = {}  # processes ended or killed, not reaped yet
        self.lanes: LaneSocket | None = None  # a Local client's lane socket (see lanes.py)
        self.unsent: set[Executor] = set()  # (see ExecutorProcesses._forward_output)
        self.held: dict[Slot, tuple[float, float]] = {}  # (see ExecutorProcesses._hold)

    def configure(self, config: Config, blob: bytes) -> None:
        """Take the pool's configuration; one slot per local rank (``procs``)."""
        self.config = config
        self.blob = blob
        self.slots = [Slot(rank) for rank in range(int(config.get("procs", 1)))]
        self.threads = bool(config.get("threads")) and len(self.slots) > 1

    # -- what the client asks -----------------------------------------------------------
    def submit(self, ident: int, body: Body) -> None:
        """A TASK frame: queue it on its local rank's executor."""
        timeout, local_rank = TASK_HEAD.unpack_from(body)
        slot = self.slots[local_rank]
        task = Task(ident, timeout, [HEADER.pack(Kind.TASK, ident, len(body)), body])
        slot.tasks.append(task)
        queued = len(slot.tasks)
        if queued <= (WINDOW if slot.quick else 1):
            self.waiting.add(slot)  # fed once the frames read with it are taken: resume()
        elif queued > WINDOW:
            self.deep = True  # see pace()

    def submit_task(self, ident: int, head: bytes, parts: list[Buffer]) -> None:
        """A call whose arguments came apart from its TASK frame (a relayed payload, see
        :mod:`.relay`): queue its frame for the executor (``parts``) as :meth:`submit`
        does; ``head`` is its TASK_HEAD."""
        timeout, local_rank = TASK_HEAD.unpack_from(head)
        slot = self.slots[local_rank]
        slot.tasks.append(Task(ident, timeout, parts))
        queued = len(slot.tasks)
        if queued <= (WINDOW if slot.quick else 1):
            self._feed(slot)
        elif queued > WINDOW:
            self.deep = True  # see pace()

    def define(self, ident: int, body: Body) -> None:
        """A DEFINE frame: every executor, and every later one, gets it."""
        parts: list[Buffer] = [HEADER.pack(Kind.DEFINE, ident, len(body)), body]
        self.defines.append(parts)
        for slot in self.slots:
            self._to_executor(slot, parts)

    def members(self, info: bytes) -> None:
        """A MEMBERS frame (the pool grew or shrank): ``info`` is the node's new
        COMPUTE_POOL, for every executor (the calls sent after it see it) and every later
        one."""
        if self.config is not None:
            self.config["compute_pool"] = info.decode()
        for slot in self.slots:
            self._to_executor(slot, frame(Kind.MEMBERS, 0, info))

    def cancel(self, ident: int) -> None:
        """Stop a task (the client is told CANCELLED at once): replace the executor if it
        runs it; one given ahead to the executor is skipped there (what it answers for it
        is dropped; see :meth:`check_timeouts` for one it started); one not given yet is
        dropped."""
        for slot in self.slots:
            for i, task in enumerate(slot.tasks):
                if task.ident != ident:
                    continue
                if 0 < i < slot.fed:  # in the executor's pipe, behind the running one
                    ex = slot.executor
                    if not task.cancelled and ex is not None:
                        task.cancelled = True
                        ex.outbox.send(frame(Kind.CANCEL, ident))  # before the client knows
                        self.client.send(frame(Kind.RESULT, ident, bytes((Status.CANCELLED,))))
                    return
                del slot.tasks[i]
                self.client.send(frame(Kind.RESULT, ident, bytes((Status.CANCELLED,))))
                if i == 0 and slot.fed:
                    slot.fed = 0
                    self._kill(slot)
                    self._replace(slot, "a running call was cancelled")
                elif i == 0:
                    self._feed(slot)
                return
        self._cancel_lane(ident)

    def restart(self, generation: int, cause: bytes) -> None:
        """Replace every executor; the tasks they held end ABORTED (with ``cause``)."""
        self.generation = generation
        for slot in self.slots:
            self._kill(slot)
            slot.fed = 0
            while slot.tasks:
                task = slot.tasks.popleft()
                if not task.cancelled:  # (a cancelled one's client has its answer)
                    aborted = frame(Kind.RESULT, task.ident, bytes((Status.ABORTED,)), cause)
                    self.client.send(aborted)
            slot.restarts += 1
            self._start(slot)

    def stop(self) -> None:
        """Ask every executor to end (SHUTDOWN) and start no new one."""
        self.stopping = True
        for slot in self.slots:
            ex = slot.executor
            if ex is not None and ex.state is not ExecState.FAILED:
                ex.outbox.send(frame(Kind.SHUTDOWN, 0))

    # -- time -----------------------------------------------------------------------------
    def next_deadline(self, default: float) -> float:
        """The earliest running task's deadline, or ended process's grace (monotonic
        time), or ``default``."""
        wake = self._graves_due(default) if self.graves else default
        for slot in self.slots:
            if slot.fed and slot.tasks[0].deadline:
                wake = min(wake, slot.tasks[0].deadline)
        for at, _ in self.held.values():
            wake = min(wake, at)
        return wake

    def check_timeouts(self, now: float) -> None:
        """End the running tasks past their deadline (TIMEOUT; CANCELLED for a cancelled
        one its executor did not skip: it runs) and replace their process; kill the
        processes past their grace to exit."""
        if self.graves:
            self._bury_overdue(now)
        if self.held:
            self._look_at_lanes(now)
        for slot in self.slots:
            if slot.fed and slot.tasks[0].deadline and now >= slot.tasks[0].deadline:
                task = slot.tasks.popleft()
                slot.fed = 0
                self._kill(slot)
                if task.cancelled:  # the client was told CANCELLED already
                    self._replace(slot, "a running call was cancelled")
                    continue
                body = json.dumps({"timeout": task.timeout}).encode()
                self.client.send(frame(Kind.RESULT, task.ident, bytes((Status.TIMEOUT,)), body))
                self._replace(slot, f"a call ran longer than its timeout of {task.timeout:g} s")

    def pace(self) -> None:
        """The agent runs as SCHED_BATCH while more tasks wait on a slot than its
        executor is given ahead (a queue: see batching.py), normally otherwise. The
        agent's loop calls this only while the policy is SCHED_BATCH or a slot got more
        than WINDOW tasks since the last look (``deep``): else nothing changed."""
        self.deep = False
        self.policy.set(any(len(slot.tasks) > WINDOW for slot in self.slots))

    # -- executors ------------------------------------------------------------------------
    def _replace(self, slot: Slot, reason: str) -> None:
        """Start a new executor in place of one that was stopped or died; in a group pool,
        ask the client to restart the whole group instead (see the module docstring)."""
        assert self.config is not None
        if not self.config.get("group"):
            self._start(slot)
        elif not self.stopping:
            where = f"local rank {slot.rank}: " if len(self.slots) > 1 else ""
            self.client.send(frame(Kind.BROKEN, self.generation, (where + reason).encode()))

    def _began(self, slot: Slot, ex: Executor) -> None:
        """``ex`` (just forked) serves ``slot``: its pipes are watched, and it is given the
        functions and the slot's next tasks."""
        slot.executor = ex
        self.sel.register(ex.from_fd, False, partial(self._on_executor, ex))
        if ex.out_fd >= 0:
            os.set_blocking(ex.out_fd, False)
            os.set_blocking(ex.err_fd, False)
            self.sel.register(ex.out_fd, False, partial(self._on_output, ex, 1), first=True)
            self.sel.register(ex.err_fd, False, partial(self._on_output, ex, 2), first=True)
        slot.fed = 0
        slot.quick = False
        for task in [t for t in slot.tasks if t.cancelled]:  # given to the last process only
            slot.tasks.remove(task)
        for parts in self.defines:
            ex.outbox.send(parts)
        self._feed(slot)

    def _feed(self, slot: Slot, before: list[Buffer] | None = None) -> None:
        """Send ``before`` (frames for the client) and the slot's next tasks (one, or up to
        :data:`WINDOW` while they are quick) to its executor: the client is told first
        (STARTED, in the same write), and the tasks are given only once that has left the
        agent, so a task the client has no word of never starts (see the module
        docstring)."""
        ex = slot.executor
        tasks = slot.tasks
        upto = min(len(tasks), WINDOW if slot.quick else 1)
        if (
            slot.fed >= upto
            or self._lane_holds(slot)  # a lane call runs there: fed once it ends
            or (slot.fed > 0 and upto == WINDOW and upto - slot.fed < REFILL)  # see REFILL
            or ex is None
            or self.stopping
            or self.client.broken
            or ex.state not in (ExecState.STARTING, ExecState.RUNNING)
        ):
            if before:
                self.client.send(before)
            return
        parts = list(before) if before else []
        for i in range(slot.fed, upto):
            task = tasks[i]
            if not task.announced:
                task.announced = True
                parts += frame(Kind.STARTED, task.ident)
        if parts:
            self.client.send(parts)
        if self.client.queue:
            self.waiting.add(slot)  # see resume()
            return
        given: list[Buffer] = []
        for i in range(slot.fed, upto):
            given += tasks[i].frame
        first = not slot.fed
        if first:  # the first one starts now
            slot.began = time.monotonic()
            tasks[0].arm(slot.began)
        slot.fed = upto
        ex.outbox.send(given)
        if first:
            self._behind_lane(slot)

    def resume(self) -> None:
        """The client's outbox is empty: feed the slots that waited for it (or for the
        TASK frames read with their task)."""
        if self.unsent:
            self.output_out()
        slots, self.waiting = self.waiting, set()
        for slot in slots:
            self._feed(slot)

    def _to_executor(self, slot: Slot, parts: list[Buffer]) -> None:
        ex = slot.executor
        if ex is not None and ex.state in (ExecState.STARTING, ExecState.RUNNING):
            ex.outbox.send(parts)

    def _on_executor(self, ex: Executor) -> None:
        corrupt = ""
        try:
            frames = ex.reader.read(ex.from_fd)
        except FrameError as e:  # e.g. a task wrote on the executor's result channel
            frames, corrupt = None, str(e)
        if corrupt:  # handled out of the except block: a new executor is forked next
            ex.stderr_tail.append(
                f"flotilla: the executor's result channel broke: {corrupt}".encode()
            )
            kill_group(ex.pid)
            reason = (
                "was stopped by its agent: it wrote a corrupt frame on its result channel "
                "(the task wrote on a descriptor that is not its own?)"
            )
            self._exited(ex, wait=True, reason=reason)
            return
        if frames is None:
            self._exited(ex)
            return
        for kind, ident, body in frames:
            handler = self._on_frame.get(kind)
            if handler is not None:
                handler(ex, ident, body)

    def _result(self, ex: Executor, ident: int, body: Body) -> None:
        """A task's result: its output was forwarded first (see Poller). The next task
        given begins now; the window ahead is refilled while tasks are quick."""
        result: list[Buffer] = [HEADER.pack(Kind.RESULT, ident, len(body)), body]
        self.answered(ident, body[0] if len(body) else 0)
        slot = ex.slot
        tasks = slot.tasks
        if slot.fed and tasks and tasks[0].ident == ident:
            done = tasks.popleft()
            slot.fed -= 1
            now = time.monotonic()
            # a window while the queue lasts: once idle, the next calls start one at a time
            slot.quick = bool(tasks) and now - slot.began < QUICK
            slot.began = now
            if slot.fed:  # the next one was given ahead: it runs from now on
                head = tasks[0]
                head.arm(now)
                if head.cancelled:  # its executor skips it at once, or it runs
                    head.deadline = now + CANCEL_GRACE
            if not tasks:  # nothing more to give (a lone call's answer)
                if not done.cancelled:  # (told CANCELLED already)
                    self.client.send(result)
                return
            self._feed(slot, None if done.cancelled else result)  # (told CANCELLED already)
            return
        for i in range(1, slot.fed):  # a task given ahead, answered out of turn
            if tasks[i].ident == ident:
                cancelled = tasks[i].cancelled
                del tasks[i]
                slot.fed -= 1
                if cancelled:
                    return
                break
        self.client.send(result)

    def _store(self, ex: Executor, ident: int, body: Body) -> None:
        """A task's request to the distributed collections: to the client, renumbered
        (executors number their own requests), so that the answer finds its executor."""
        relay = next(self.request_ids)
        self.requests[relay] = (ex, ident)
        ex.stored = True
        self.client.send([HEADER.pack(Kind.STORE, relay, len(body)), body])

    def _yield(self, ex: Executor, ident: int, body: Body, kind: int = Kind.YIELD) -> None:
        """A value of a yielding task (or leave for more of a streamed argument): to the
        client."""
        self.client.send([HEADER.pack(kind, ident, len(body)), body])

    def credit(self, ident: int, body: Body, kind: int = Kind.CREDIT) -> None:
        """The client's leave for a yielding task to send more (or a value of a streamed
        argument: ``kind`` FEED; or its caller closed the iterator: ``kind`` CLOSE): to
        the executor of the task, or after its TASK frame while it waits for its turn."""
        parts: list[Buffer] = [HEADER.pack(kind, ident, len(body)), body]
        for slot in self.slots:
            for i, task in enumerate(slot.tasks):
                if task.ident != ident:
                    continue
                ex = slot.executor
                if i == 0 and slot.fed and ex is not None:
                    ex.outbox.send(parts)
                    return
                # not running yet: sent with the task (and to a new process again)
                task.frame = [*task.frame, *parts]
                if i < slot.fed and ex is not None:  # given ahead: after its TASK frame
                    ex.outbox.send(parts)
                return

    def stored(self, relay: int, body: Body) -> None:
        """The client's answer to a STORE: to the executor that asked, if it still runs
        (an executor replaced meanwhile asked nothing of its successor)."""
        asked = self.requests.pop(relay, None)
        if asked is None:
            return
        ex, ident = asked
        if ex.slot.executor is ex and ex.state is ExecState.RUNNING:
            ex.outbox.send([HEADER.pack(Kind.STORED, ident, len(body)), body])

    def _ready(self, ex: Executor, ident: int, body: Body) -> None:
        """The executor is set up (or failed to be); READY goes to the client once the
        whole node is up."""
        slot = ex.slot
        info = load_ready(body)
        if "error" in info:
            ex.state = ExecState.FAILED
            info["local_rank"] = slot.rank
            self.client.send(frame(Kind.READY, 0, dump(info)))
            return
        ex.state = ExecState.RUNNING
        first = not all(s.ready for s in self.slots)
        slot.ready = True
        if first and all(s.ready for s in self.slots):  # the whole node is up
            ready = self.ready_info()
            assert ready is not None
            self.client.send(frame(Kind.READY, 0, dump(ready)))

    def ready_info(self) -> Ready | None:
        """The node's READY, once every executor is up (None before)."""
        if not self.slots or not all(s.ready for s in self.slots):
            return None
        return {
            "pids": [s.executor.pid for s in self.slots if s.executor],
            "restarts": sum(s.restarts for s in self.slots),
            "shm": bool(self.config and self.config["shm_prefix"]),
            **self.ready_extra,
        }

    def adopted(self) -> dict[str, int]:
        """The calls a client that went away left here (queued or running), by id: their
        local rank, for the client that re-attaches (its HELLO's ``adopted``)."""
        return {str(t.ident): slot.rank for slot in self.slots for t in slot.tasks}

    def _ended(self, ex: Executor, reason: str, status: int | None) -> None:
        """``ex`` is gone (reaped, with ``status``): its death is told, and its slot gets a
        new process (or, in a group pool, the client is asked to restart the group).
        Nothing more when the agent killed it meanwhile (a RESTART, a cancel: they saw to
        its slot)."""
        if ex.closed:
            return
        slot = ex.slot
        self._drain_output(ex)
        lane_ran = self._lane_closed(ex, self._death(ex, reason, status))
        self._close(ex)
        if self.stopping:
            return
        if self.threads:  # one process for every slot: the first to see its end says why
            if not self.shared_death:
                code = os.waitstatus_to_exitcode(status) if status is not None else None
                what = reason or describe_exit(code)[0]
                self.shared_death = (
                    f"ended with the node's other thread slots (they share one process, "
                    f"which {what})"
                )
            reason = reason or self.shared_death
        death = self._death(ex, reason, status)
        exitcode = death["exitcode"]
        if ex.state is ExecState.STARTING or ex.state is ExecState.FAILED:
            if ex.state is ExecState.STARTING:
                error = "the executor process exited during start-up"
                self.client.send(frame(Kind.READY, 0, dump({"error": error, **death})))
            return
        task = slot.tasks.popleft() if slot.tasks and slot.fed and not lane_ran else None
        self.held.pop(slot, None)
        slot.fed = 0  # the tasks given after it did not start: the next process gets them
        if task is not None and task.cancelled:  # its client was told CANCELLED
            task = None
        slot.restarts += 1
        how = reason or describe_exit(exitcode)[0]
        cause = f"the process {'running a call ' if task else ''}{how}"
        group = bool(self.config and self.config.get("group"))
        if group:  # the restart is asked for first: a retry of the task comes after it
            self._replace(slot, cause)
        if task is not None:
            body = json.dumps(death).encode()
            self.client.send(frame(Kind.RESULT, task.ident, bytes((Status.DIED,)), body))
        if not group:  # the next task is fed once the client has the result
            self._replace(slot, cause)
