"""Where calls go and what happens when they fail: the pool's dispatch and retry policy.

:class:`Dispatcher` turns calls into :class:`Submission` objects (the function pickled once
per pool, arguments once per call), sends each to a node, and settles its future when the
node answers. The policy, in one place:

- **Least busy first.** A single call goes to the ready (node, local rank) with the fewest
  calls in flight, the lowest rank among equals (one agent stays warm for a stream of
  single calls); a batch is spread by counting each assignment.
- **Retries.** A call made with ``retries=`` whose process or node dies under it, or that
  raised one of its ``retry_on`` exception types, runs again: a broadcast's call on the same
  rank, a single call on another node when there is one.
- **Group restarts.** In a pool whose processes form one group (``forms_group`` plugins),
  one rank failing while its siblings still run restarts every process (see ``plugins._base``),
  and a broadcast's call is never retried alone (it would wait for the others forever).
  The failure is *held* until every sibling has ended (finished, or aborted by the
  restart): a failed broadcast returns only then, so the next call is sent after the
  RESTART on every node and cannot pair with a stale collective.
- **Lost nodes.** When a node's agent is gone, its rank is *down* while the pool replaces it
  (``_client/renew.py``): calls pinned to that rank (broadcasts, their retries) wait for the
  new node; single calls go to other nodes, or wait when none is ready. A rank whose
  replacement keeps failing past the pool's start timeout (``Recovery.down``; it is still tried
  again, and serves once back), or lost with ``Options(replace_lost_nodes=False)``, is
  *gone*: broadcasts then fail at once naming the node and why.

Calls are sent from any thread; results and losses arrive on the loop thread. ``lock``
guards the rank bookkeeping and is never held while writing to a node.

The dispatcher settles calls' futures and retries them; :class:`Encoder` (``encoding.py``)
prepares the calls, and three collaborators share the dispatcher's bookkeeping
(``ranks.py``): :class:`Placement` (``placement.py``: where calls go), :class:`Recovery`
(``recovery.py``: lost nodes and group restarts) and :class:`Membership`
(``membership.py``: an elastic pool's size, and the gate of a group pool's resize).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from functools import partial
from typing import Any

from .._errors import (
    WorkerDiedError,
)
from .._redaction import redact_exception
from .._wire.frames import Kind, Status
from .encoding import Encoder
from .membership import Membership
from .node import Node, Submission
from .outcome import outcome
from .placement import Placement
from .ranks import Ranks, Replacer
from .recovery import Recovery, note_sibling_death, others_run, restart_consequence
from .stream import collected, yields

logger = logging.getLogger("flotilla")
STRAGGLER_GRACE = 1.0
"""Seconds the other calls of a broadcast get to finish after one raised, in a group pool,
before the group is restarted (see ``plugins._base``)."""


class Dispatcher(Ranks):
    """Sends a pool's calls to its nodes and settles their futures: it settles, retries and
    cancels them; its collaborators share its bookkeeping
    (:class:`Ranks`).

    Attributes:
        encoder: turns calls into submissions (``encoding.py``).
        shm_files: large arguments' files, kept for reuse (``shm.py``): the encoder's.
        placement: where calls go (``placement.py``).
        recovery: lost nodes and group restarts (``recovery.py``).
        membership: nodes joining and leaving (``membership.py``).
    """

    def __init__(
        self,
        group: bool,
        procs: int,
        shm_prefix: str,
        running: Callable[[], bool],
        replacer: Replacer | None = None,
    ) -> None:
        super().__init__(group, procs, running, replacer)
        self.encoder = Encoder(self, shm_prefix)
        self.shm_files = self.encoder.shm_files
        self.placement = Placement(self, self.encoder)
        self.recovery = Recovery(self, self.placement)
        self.membership = Membership(self, self.placement, self.recovery)

    def cancel(self, futures: Iterable[Future[Any]]) -> None:
        """Stop calls: a running one has its process replaced, a queued one is skipped."""
        for fut in futures:
            sub = self.by_future.get(id(fut))
            if sub is None or fut.done():
                continue
            if sub.node is not None:
                sub.node.send_control(Kind.CANCEL, ident=sub.tid)
            elif self._unpark(sub):
                self.settle(sub, exc=_cancelled())

    def close_stream(self, sub: Submission, wait: bool) -> bool:
        """Ask the node running ``sub`` (a yielding call whose iterator was closed) to
        close its generator (CLOSE, see ``stream.py``); False when it is on no node yet
        (nothing of it ran: the caller cancels it). Without ``wait`` (a dropped iterator,
        maybe on the loop thread) a worker thread sends it if the channel is busy."""
        node = sub.node
        if node is None:
            return False
        send = partial(node.send_control, Kind.CLOSE, ident=sub.tid)
        if wait:
            return send()
        if not send(wait=False):
            from .loop import get_loop

            get_loop().run_in_executor(None, send)
        return True

    def _unpark(self, sub: Submission) -> bool:
        with self.lock:
            for subs in (*self.waiting.values(), self.unplaced, self.backlog):
                if sub in subs:
                    subs.remove(sub)
                    return True
            if any(sub in subs for subs, _ in self.gated_calls):
                return True  # skipped when the gate opens: its future is settled
        return False

    # -- results (loop thread) -------------------------------------------------------
    def on_result(self, node: Node, sub: Submission, status: int, body: bytes | bytearray) -> None:
        try:
            value, exc = outcome(node, sub.call.function, sub.timeout, status, body)
            if exc is None and sub.stream is None and yields(sub.call.function.fn):
                value = collected(sub)  # a yielding call without an iterator: its values
        except BaseException as e:  # e.g. a result whose type cannot be unpickled here
            value, exc = None, e
        if self.group and exc is not None and sub.siblings and sub.generation < self.generation:
            exc = restart_consequence(node, sub, exc, self.restarts)
        if self.group and status == Status.ERROR and exc is not None and others_run(sub):
            # the others may wait for this one in a collective, and would wait forever
            what = f"{type(exc).__name__}: {exc}".splitlines()[0]
            cause = f"{node.name}: {sub.call.function.name}(...) raised {what}"
            asyncio.get_running_loop().call_later(
                STRAGGLER_GRACE, self.recovery.restart_if_stuck, sub, cause
            )
        sub.finished = True
        if self.group and exc is not None and others_run(sub):
            with self.lock:
                sub.held = (value, exc)  # settled once every sibling has ended
                self.held.add(sub)
            return
        retried = isinstance(exc, (WorkerDiedError, *sub.call.function.retry_on))
        if retried and exc is not None and self.retry(sub, exc):
            return
        self.settle(sub, value=value, exc=exc)

    def retry(self, sub: Submission, err: BaseException, free: bool = False) -> bool:
        """Send ``sub`` again after ``err`` if it has retries left (``free``: it never
        ran, no retry is used); whether it was."""
        if (sub.retries_left <= 0 and not free) or not self.running():
            return False
        if self.group and sub.siblings:  # alone, it would wait for the others forever
            return False
        if sub.stream is not None and sub.stream.closed:  # its caller wants no more
            return False
        if not free:
            sub.retries_left -= 1
        previous = sub.node
        sub.node = None
        try:
            if sub.pinned and previous is not None:
                self.placement.place(sub, previous.rank)
            else:
                self.placement.place(sub, exclude=previous)
        except Exception:
            return False
        return True

    def settle(
        self, sub: Submission, *, value: Any = None, exc: BaseException | None = None
    ) -> None:
        self.by_future.pop(id(sub.future), None)
        if exc is not None and self.group and sub.siblings:
            note_sibling_death(sub, exc)
        try:  # (a future settled already, e.g. by close, stays as it is)
            if exc is not None:
                # the one point errors reach the caller through: no secrets
                sub.future.set_exception(redact_exception(exc, self.secrets))
            else:
                sub.future.set_result(value)
        except InvalidStateError:
            pass
        sub.payload.release()  # after: removing a large shared-memory file takes a while
        if sub.wake_by is not None:  # a lane call's thread waits for it (lanes.py)
            sub.wake_by.wake()
        if self.held and sub.siblings:
            self.release_held(sub.siblings)
        if self.backlog:
            self.pump()

    def pump(self) -> None:
        """Send backlogged calls to the processes that are free (in a worker thread: a
        send may wait for its node, the loop never does)."""
        from .loop import get_loop

        get_loop().run_in_executor(None, self._pump)

    def _pump(self) -> None:
        while True:
            with self.lock:
                choice = self.placement.least_busy()
                if not self.backlog or choice is None or self.gated:
                    return
                if self.hold and choice[0].busy[choice[1]] > 0:
                    return
                sub = self.backlog.pop(0)
            if sub.future.done():
                continue
            try:
                self.placement.place(sub)
            except Exception as e:
                self.settle(sub, exc=e)

    def release_held(self, siblings: list[Submission]) -> None:
        """Settle the held failures of a broadcast whose calls have all ended."""
        with self.lock:
            if any(s.held is None and not s.future.done() for s in siblings):
                return
            held = [s for s in siblings if s in self.held]
            self.held.difference_update(held)
        for s in held:
            assert s.held is not None
            value, exc = s.held
            s.held = None
            self.settle(s, value=value, exc=exc)

    def close(self, exc: Callable[[str], BaseException]) -> None:
        """The pool closes: every call still waiting or in flight ends with ``exc(where)``."""
        with self.lock:
            self.closed = True
            self.opened.notify_all()
            parked = [s for subs in self.waiting.values() for s in subs] + self.unplaced
            parked += self.backlog
            parked += [sub for subs, _ in self.gated_calls for sub in subs]
            self.gated_calls = []
            self.waiting.clear()
            self.unplaced = []
            self.backlog = []
        for sub in parked:
            self.settle(sub, exc=exc("a lost node was replaced"))
        with self.lock:
            held, self.held = list(self.held), set()
        for sub in held:
            assert sub.held is not None
            self.settle(sub, exc=sub.held[1])
        for node in self.nodes:
            with node.lock:
                subs = list(node.inflight.values())
                node.inflight.clear()
            for sub in subs:
                self.settle(sub, exc=exc(f"{node.name} finished the call"))
        self.shm_files.close()  # the kept files go (those still in use: when released)


def _cancelled() -> BaseException:
    from concurrent.futures import CancelledError

    return CancelledError()
