"""Lost nodes and group restarts: what a pool's :class:`Dispatcher` does when a node's agent
is gone or a group of processes must start again (see ``dispatch.py`` for the policy).

:class:`Recovery` works on the dispatcher's rank bookkeeping (``waiting``, ``replacing``,
``gone``, ``unplaced``), under its ``lock``; it runs on the loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from .._errors import WorkerDiedError
from .._redaction import redact
from .._wire.frames import Kind
from .node import Node, NodeState, Submission
from .outcome import stopped_by_restart
from .placement import Placement
from .ranks import Ranks

logger = logging.getLogger("flotilla")


class Recovery:
    """A pool's lost nodes, their replacements and its group restarts (loop thread).

    Attributes:
        d: the pool's nodes and bookkeeping (the dispatcher, see ``ranks.py``).
    """

    def __init__(self, d: Ranks, placement: Placement) -> None:
        self.d = d
        self.placement = placement

    def restart_if_stuck(self, sub: Submission, cause: str) -> None:
        """Restart the group if calls of ``sub``'s broadcast still run, in the group
        generation they were sent in. While the broadcast is still being sent (a sibling
        not sent yet, nor waiting for a replacement), the check comes again shortly: a
        RESTART must not overtake a sibling's call, which would run alone after it."""
        if not others_run(sub):
            return
        if any(
            s.node is None
            and not s.finished
            and not s.future.done()
            and not self.placement.parked(s)
            for s in sub.siblings or ()
        ):
            asyncio.get_running_loop().call_later(0.01, self.restart_if_stuck, sub, cause)
            return
        self.restart_group(cause, sub.generation)

    def restart_group(self, cause: str, generation: int) -> None:
        """Restart every process of a group pool (see ``plugins._base``), once per ``generation``
        of the group: later reports of the same break are ignored."""
        if generation != self.d.generation or not self.d.running():
            return
        self.d.generation += 1
        cause = redact(cause, self.d.secrets)  # logged, and sent to every node
        self.d.restarts[self.d.generation] = cause
        logger.warning("restarting every process of the pool: %s", cause)
        for node in self.d.nodes:
            if node.state is NodeState.READY:  # (before any call of the new group)
                node.send_first(Kind.RESTART, ident=self.d.generation, body=cause.encode())

    def on_lost(self, node: Node, subs: list[Submission]) -> None:
        """``node``'s agent is gone (``subs`` ran on it): replace it, retry or fail them."""
        err = node.lost_error(f"was lost while running a call: {node.loss}")
        why = _why(node)
        rank = node.rank
        with self.d.lock:
            current = rank < len(self.d.nodes) and self.d.nodes[rank] is node
            fresh = current and rank not in self.d.replacing and rank not in self.d.gone
        if fresh and self.d.replacer is not None and self.d.running():
            down = self.d.replacer(rank, why)
            with self.d.lock:
                self.d.replacing.update(down)
                for r in down:
                    self.d.waiting.setdefault(r, [])
        elif fresh:
            hint = "; Options(replace_lost_nodes=True) replaces lost nodes"
            self.give_up([rank], why + (hint if self.d.replacer is None else ""))
        started, queued = _started(node, subs)
        for sub in queued:  # they never ran: sent again, retries or not
            if not self.d.retry(sub, err, free=True):
                self.d.settle(sub, exc=err)
        for sub in started:
            if not self.d.retry(sub, err):
                self.d.settle(sub, exc=err)

    def retire(self, node: Node, cause: str) -> None:
        """Take a live node of a group pool out of service (its group is restarted): its
        calls end as ABORTED ones do, or are retried."""
        node.state = NodeState.CLOSED
        with node.lock:
            subs = list(node.inflight.values())
            node.inflight.clear()
        for sub in subs:
            err = stopped_by_restart(node, sub.call.function.name, cause)
            if not self.d.retry(sub, err):
                self.d.settle(sub, exc=err)

    def back(self, nodes: Sequence[Node]) -> None:
        """Replacement ``nodes`` are ready: put them in service and send what waited."""
        with self.d.lock:
            for node in nodes:
                self.d.nodes[node.rank] = node
                self.d.replacing.discard(node.rank)
                self.d.gone.pop(node.rank, None)  # (down() while it was tried again)
            waiting = [(n.rank, self.d.waiting.pop(n.rank, [])) for n in nodes]
            unplaced, self.d.unplaced = self.d.unplaced, []
        for rank, subs in waiting:
            for sub in subs:
                self.resend(sub, rank)
        for sub in unplaced:
            self.resend(sub, None)

    def resend(self, sub: Submission, rank: int | None) -> None:
        if sub.future.done():
            return
        if self.d.group and sub.siblings:
            err = next((e for s in sub.siblings if (e := _failure(s)) is not None), None)
            if err is not None:  # it would wait in a collective for a sibling that ended
                self.d.settle(sub, exc=WorkerDiedError(f"not run: {err}", node=rank or 0))
                return
            sub.generation = self.d.generation
        try:
            self.placement.place(sub, rank)
        except Exception as e:
            self.d.settle(sub, exc=e)

    def failed(self, ranks: Sequence[int], reason: str) -> None:
        """The nodes at ``ranks`` cannot be replaced: they are gone for good."""
        self.give_up(ranks, f"lost, and no replacement could be started: {reason}")

    def down(self, ranks: Sequence[int], reason: str) -> None:
        """The nodes at ``ranks`` could not be replaced within the pool's start timeout
        (the last attempt failed for ``reason``): the calls waiting for them fail, and so do
        new ones pinned to them, naming them, until a replacement is back (:meth:`back`:
        the pool keeps trying, see ``renew.py``)."""
        with self.d.lock:
            if all(self.d.gone.get(r) is not None for r in ranks):
                for rank in ranks:  # the latest failure, for the next errors
                    self.d.gone[rank] = _not_back(reason)
                return
        self.give_up(ranks, _not_back(reason), replacing=True)

    def give_up(self, ranks: Sequence[int], reason: str, replacing: bool = False) -> None:
        """Fail the calls waiting for ``ranks`` and the later ones pinned to them; with
        ``replacing``, the ranks are still being replaced (they serve again once back)."""
        with self.d.lock:
            waiting: list[tuple[int, Submission]] = []
            for rank in ranks:
                self.d.gone[rank] = reason
                if not replacing:
                    self.d.replacing.discard(rank)
                waiting += [(rank, sub) for sub in self.d.waiting.pop(rank, [])]
            unplaced: list[Submission] = []
            if not self.d.waiting:
                unplaced, self.d.unplaced = self.d.unplaced, []
        for rank, sub in waiting:
            self.d.settle(sub, exc=self.placement.gone_error([rank], "cannot run the call"))
        for sub in unplaced:
            self.resend(sub, None)


def _not_back(reason: str) -> str:
    return f"lost, and not replaced yet: {reason}; the pool keeps trying to bring it back"


def _why(node: Node) -> str:
    """Why ``node`` was lost, in a few words for the console."""
    if node.silence:
        return f"it stopped answering for {node.silence:.1f} s"
    if node.start_failed:
        return f"its executor failed to start: {node.start_failed}"
    lost = getattr(node.proc, "lost_reason", "")  # e.g. the SSH connection's last words
    if lost:
        return f"the connection was lost: {lost}"
    err = node.lost_error("")
    if err.signal:
        return f"its agent was killed by {err.signal}"
    if err.exitcode is not None:
        return f"its agent exited with status {err.exitcode}"
    return "its agent's stream ended"


def _started(node: Node, subs: list[Submission]) -> tuple[list[Submission], list[Submission]]:
    """``subs``, the calls in flight on the lost ``node``, split into those that may have
    started and those that certainly did not.

    An agent gives a call to a process only once its STARTED frame has left the agent
    (``_node/supervisor.py``): when the agent is known to be gone (its stream ended), a
    call without STARTED never ran. A node lost otherwise (silence, a broken connection,
    a write that made no progress, an executor that failed to start) may still have an
    agent that starts its calls: then every call counts as started. A lane call (its agent
    never saw it) started unless its executor is gone without having begun it (its lane's
    board says so: ``lanes.Lane.started``)."""
    dropped: str = getattr(node.proc, "lost_reason", "")  # e.g. the SSH connection's
    if not node.ended or node.silence or dropped:
        return subs, []
    started = [s for s in subs if s.started and (s.lane is None or s.lane.started(s.tid))]
    return started, [s for s in subs if s not in started]


def others_run(sub: Submission) -> bool:
    """True when another call of ``sub``'s broadcast has not finished."""
    return any(s is not sub and not s.finished and not s.future.done() for s in sub.siblings or ())


def note_sibling_death(sub: Submission, exc: BaseException) -> None:
    """In a group pool, a call that raised (gloo's "connection closed by peer", NCCL's
    abort...) while a sibling's process or node ended under the same broadcast most likely
    failed because of it: its exception gets a note naming that end, the root cause (which
    ``results`` raises first)."""
    if isinstance(exc, WorkerDiedError):
        return
    for s in sub.siblings or ():
        death = _failure(s) if s is not sub else None
        if isinstance(death, WorkerDiedError) and not death.restarted:
            said = str(death)
            first = said.splitlines()[0] if said else type(death).__name__
            exc.add_note(f"(meanwhile {first}: a collective with that rank fails so)")
            return


def restart_consequence(
    node: Node, sub: Submission, exc: BaseException, restarts: dict[int, str]
) -> BaseException:
    """In a group pool, the failure ``exc`` of ``sub`` that arrived after the group was
    restarted since ``sub`` was sent (``restarts``: the causes, by generation) is the
    restart's doing, whichever came first on its node: the restart killing a peer's
    process ended ``sub``'s collective (gloo's "connection closed by peer"), or stopped
    ``sub`` itself (ABORTED). Either way it says so: a :class:`WorkerDiedError`
    (``restarted``) naming the restart's cause, ``exc``'s first line as a note."""
    cause = restarts.get(sub.generation + 1)
    if cause is None or isinstance(exc, WorkerDiedError):
        return exc
    err = stopped_by_restart(node, sub.call.function.name, cause)
    said = str(exc).splitlines()
    err.add_note(f"(its own error as it ended: {type(exc).__name__}: {said[0] if said else ''})")
    return err


def _failure(sub: Submission) -> BaseException | None:
    """``sub``'s failure: held until its siblings end (see dispatch.py), or settled."""
    if sub.held is not None:
        return sub.held[1]
    fut = sub.future
    return fut.exception() if fut.done() and not fut.cancelled() else None
