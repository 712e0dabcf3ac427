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
  replacement keeps failing past the pool's start timeout (:meth:`down`; it is still tried
  again, and serves once back), or lost with ``Options(replace_lost_nodes=False)``, is
  *gone*: broadcasts then fail at once naming the node and why.

Calls are sent from any thread; results and losses arrive on the loop thread. ``lock``
guards the rank bookkeeping and is never held while writing to a node.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from functools import partial
from typing import Any

from .._errors import (
    NodeLostError,
    PoolClosedError,
    SerializationError,
    WorkerDiedError,
)
from .._redaction import redact, redact_exception
from .._wire.frames import Buffer, Kind, Status
from .._wire.serialize import describe_unpicklable, encode, pickle_obj
from . import fanout, shm
from .function import Function, PendingCall
from .futures import Batch, CallFuture
from .node import Node, NodeState, Payload, Submission
from .outcome import outcome
from .stream import collected, yields

logger = logging.getLogger("flotilla")
STRAGGLER_GRACE = 1.0
"""Seconds the other calls of a broadcast get to finish after one raised, in a group pool,
before the group is restarted (see ``plugins._base``)."""

Telling = Callable[[list[Node], list[Node]], list[Node]]
"""Tells nodes (the second list) the pool's new nodes (the first) without waiting; the
nodes it could not tell so."""

Encoded = tuple[int, list[Buffer], Payload]
"""A call ready to be submitted: its function's key, the function's wire form, and its
arguments."""

Replacer = Callable[[int, str], list[int]]
"""Starts replacing the lost node at a rank (with a reason); returns every rank it takes
down meanwhile (the lost one, or all of them in a group pool)."""


class Dispatcher:
    """Sends a pool's calls to its nodes and settles their futures.

    Attributes:
        nodes: the current node at each rank (a replacement takes its rank's place).
        group: the pool's processes form one group (restarted together).
        procs: processes per node.
        generation: group restarts so far; a break is acted on once per generation.
        replacer: starts the replacement of a lost node; None when lost nodes are not
            replaced (``Options(replace_lost_nodes=False)``).
        running: whether the pool takes calls (RUNNING).
        most: an elastic pool's ``max`` (0: a pool of fixed size); see :attr:`hold`.
        backlog: single calls waiting for a free process (see :attr:`hold`).
    """

    def __init__(
        self,
        group: bool,
        procs: int,
        shm_prefix: str,
        running: Callable[[], bool],
        replacer: Replacer | None = None,
    ) -> None:
        self.nodes: list[Node] = []
        self.group = group
        self.procs = procs
        self.generation = 0
        self.replacer = replacer
        self.running = running
        self.secrets: list[str] = []  # the pool's: redacted from every error it settles
        self.lock = threading.Lock()
        self.shm_files = shm.Files(shm_prefix)  # large arguments' files, kept for reuse
        self._functions: dict[int, tuple[int, list[Buffer], Function[..., Any]]] = {}
        self._by_future: dict[int, Submission] = {}  # cancellable calls, by id(future)
        self._waiting: dict[int, list[Submission]] = {}  # down ranks: calls waiting for them
        self._replacing: set[int] = set()  # ranks whose replacement runs
        self._unplaced: list[Submission] = []  # single calls waiting for any ready node
        self._gone: dict[int, str] = {}  # ranks that fail their calls (see down()): why
        self._held: set[Submission] = set()  # group failures waiting for their siblings
        self.most = 0
        self._gated = False  # a group pool changes size: new calls wait (see gate())
        self._gated_calls: list[tuple[list[Submission], list[int] | None]] = []
        self._placing = 0  # broadcasts and batches being sent
        self._opened = threading.Condition(self.lock)  # notified when the gate opens
        self._closed = False
        self.backlog: list[Submission] = []

    @property
    def hold(self) -> bool:
        """An elastic pool below its ``max``: a single call that finds every process busy
        waits in :attr:`backlog` (which grows the pool, see ``elastic.py``) instead of
        queueing behind another call on a node; the next process free takes it. At
        ``max``, calls queue on the nodes again (no round trip between two calls of a
        process)."""
        return len(self.nodes) < self.most

    # -- preparing calls -------------------------------------------------------------
    def function(self, fn: Function[..., Any]) -> tuple[int, list[Buffer]]:
        """The pool's key of ``fn`` and its wire form (pickled once per pool)."""
        cached = self._functions.get(id(fn))
        if cached is None or cached[2] is not fn:
            try:
                pickled = pickle_obj(fn.fn)
            except Exception as e:
                found = describe_unpicklable(fn.fn, fn.name)
                where = f": {found[0]} (type {found[1]}) cannot be pickled" if found else ""
                raise SerializationError(
                    f"function {fn.name} cannot be sent to the pool{where} ({e}); "
                    f"create such objects inside the function instead of capturing them",
                    path=found[0] if found else fn.name,
                    type_name=found[1] if found else "",
                ) from None
            cached = (len(self._functions) + 1, encode(pickled), fn)
            self._functions[id(fn)] = cached
        return cached[0], cached[1]

    def payload(self, call: PendingCall[Any], fn_key: int, shared: bool) -> Payload:
        """The call's arguments, pickled; in shared memory if ``shared`` and worth it."""
        try:
            pickled = pickle_obj((fn_key, call.args, call.kwargs))
        except Exception as e:
            found = describe_unpicklable(call.args, "args") or describe_unpicklable(
                call.kwargs, "kwargs"
            )
            path, type_name = (found[0], found[1]) if found else ("arguments", "")
            raise SerializationError(
                f"cannot send {call.function.name}(...) to the pool: {path} of type {type_name} "
                f"cannot be pickled ({e}); pass something picklable, "
                "or create it inside the function",
                path=path,
                type_name=type_name,
            ) from None
        file = None
        if shared and pickled.shm_bytes and any(n.shm for n in self.nodes):
            file = self.shm_files.write(pickled)
        return Payload(pickled, file, self.shm_files)

    def submission(
        self,
        call: PendingCall[Any],
        payload: Payload,
        fn_key: int,
        define: list[Buffer],
        pinned: bool,
        batch: Batch | None = None,
    ) -> Submission:
        """A call's submission; its future one of ``batch``'s."""
        fut: Future[Any] = CallFuture(batch)
        payload.acquire()
        fn = call.function
        sub = Submission(call, fut, fn_key, define, payload, fn.retries, fn.timeout or 0.0, pinned)
        self._by_future[id(fut)] = sub
        return sub

    def encode(self, calls: Sequence[PendingCall[Any]]) -> list[Encoded]:
        """Each call's function key and wire form, and its arguments pickled: what can
        fail (SerializationError) fails here, before any call of a batch is sent."""
        out = []
        for call in calls:
            key, define = self.function(call.function)
            out.append((key, define, self.payload(call, key, shared=False)))
        return out

    def prepare(
        self,
        calls: Sequence[PendingCall[Any]],
        encoded: Sequence[Encoded],
        batch: Batch | None = None,
    ) -> list[Submission]:
        """Submissions of ``calls`` (``encoded`` by :meth:`encode`), their futures of
        ``batch``."""
        return [
            self.submission(call, payload, key, define, pinned=False, batch=batch)
            for call, (key, define, payload) in zip(calls, encoded, strict=True)
        ]

    # -- sending ---------------------------------------------------------------------
    def least_busy(
        self, exclude: Node | None = None, dead: Collection[Node] = ()
    ) -> tuple[Node, int] | None:
        """The ready (node, local rank) with the fewest calls in flight, lowest rank first
        among equals; on a node other than ``exclude`` when there is one, never on one of
        ``dead`` (they refused a call). None if no node is ready."""
        nodes = [n for n in self.nodes if n.state is NodeState.READY]
        if dead:
            nodes = [n for n in nodes if n not in dead]
        if exclude is not None:
            nodes = [n for n in nodes if n is not exclude] or nodes
        best: tuple[Node, int] | None = None
        least = 0
        for node in nodes:
            for worker, busy in enumerate(node.busy):
                if best is None or busy < least:
                    best, least = (node, worker), busy
        return best

    def dispatch(self, subs: list[Submission]) -> None:
        """Send each call to the least busy node; ties go to the lowest rank.

        Counting each assignment spreads a batch evenly; preferring low ranks among idle
        nodes keeps one agent warm for a stream of single calls.
        """
        with self.lock:
            if self._gated:
                self._gated_calls.append((subs, None))
                return
            self._placing += 1
        try:
            self._dispatch(subs)
        finally:
            with self.lock:
                self._placing -= 1

    def _send(self, subs: list[Submission], ranks: list[int] | None) -> None:
        """Send calls that waited at the gate: a batch (``ranks`` None) or a broadcast."""
        if ranks is not None:
            kept = [(sub, r) for sub, r in zip(subs, ranks, strict=True) if not sub.future.done()]
            subs, ranks = [sub for sub, _ in kept], [r for _, r in kept]
        else:
            subs = [sub for sub in subs if not sub.future.done()]
        if not subs:
            return
        try:
            if ranks is None:
                self.dispatch(subs)
            elif max(ranks) >= len(self.nodes):
                raise PoolClosedError(f"node {max(ranks)} left the pool")
            else:
                self._place_all(subs, ranks)
        except Exception as e:
            for sub in subs:
                if sub.node is None and not sub.future.done():
                    self.settle(sub, exc=e)

    def _dispatch(self, subs: list[Submission]) -> None:
        if len(subs) == 1 or self.hold:  # `>>`: no bookkeeping beyond the choice
            for sub in subs:
                self.place(sub)
            return
        load = {
            (n, w): busy
            for n in self.nodes
            if n.state is NodeState.READY
            for w, busy in enumerate(n.busy)
        }
        if not load:
            for sub in subs:
                self.place(sub)
            return
        by_node: dict[Node, list[Submission]] = {}
        for sub in subs:
            node, sub.worker = best = min(load, key=load.__getitem__)
            load[best] += 1
            by_node.setdefault(node, []).append(sub)
        for node, batch in by_node.items():
            try:
                node.send(batch)
            except NodeLostError:
                if self.replacer is None and node in self.nodes:  # (not: released by a shrink)
                    raise
                for sub in batch:
                    self.place(sub, dead={node})

    def place(
        self,
        sub: Submission,
        rank: int | None = None,
        exclude: Node | None = None,
        dead: set[Node] | None = None,
    ) -> None:
        """Send ``sub`` to the node at ``rank`` (a pinned call) or to the least busy one
        (other than ``exclude`` if possible, never one of ``dead``); or park it until a
        lost node is back.

        A node that refuses the call (its agent is gone, the loss not reported yet) is
        treated as down from then on. Raises PoolClosedError when the call can run
        nowhere, NodeLostError when its node is lost and lost nodes are not replaced."""
        while True:
            with self.lock:
                if rank is not None:
                    if rank in self._gone:
                        raise self._gone_error([rank], "cannot run the call")
                    node = self.nodes[rank]
                    if rank in self._waiting or (
                        node.state is not NodeState.READY and self.replacer is not None
                    ):
                        self._waiting.setdefault(rank, []).append(sub)
                        return
                else:
                    choice = self.least_busy(exclude, dead or ())
                    if choice is None:
                        if self.most and not self.nodes:  # an elastic pool at zero: it wakes
                            self.backlog.append(sub)
                            return
                        if self._waiting:
                            self._unplaced.append(sub)
                            return
                        raise self.all_lost()
                    node, sub.worker = choice
                    if self.hold and node.busy[sub.worker] > 0:
                        self.backlog.append(sub)
                        return
            try:
                node.send([sub])
                return
            except NodeLostError:
                with self.lock:  # not current: an elastic pool released it (choose again)
                    current = node.rank < len(self.nodes) and self.nodes[node.rank] is node
                if current and (self.replacer is None or not self.running()):
                    raise
                with self.lock:  # its loss is on its way: wait for the replacement
                    if current and node.rank not in self._gone:
                        self._waiting.setdefault(node.rank, [])
                dead = {node} | (dead or set())

    def broadcast(
        self, call: PendingCall[Any], ranks: Sequence[int] | None = None, any_slot: bool = False
    ) -> list[Submission]:
        """Send ``call`` to every process of the nodes at ``ranks`` (None: of every node,
        as many as there are when it is sent: a broadcast made while a group pool changes
        size waits for the new size); a submission each. ``any_slot`` (one process per
        node): each runs in its node's least busy task slot, not always the first."""
        with self.lock:
            while ranks is None and self._gated and not self._closed:
                self._opened.wait()
            if self._closed:
                raise PoolClosedError("the pool closed before the call could be sent")
            targets = list(range(len(self.nodes)) if ranks is None else ranks)
            gone = [r for r in targets if r in self._gone]
            if self.replacer is None:
                gone += [
                    r
                    for r in targets
                    if self.nodes[r].state is not NodeState.READY and r not in gone
                ]
            gated = self._gated  # (explicit ranks only) sent whole when the gate opens
            if not gone and not gated:
                self._placing += 1  # the gate waits for this broadcast to be sent
        if gone:
            raise self._gone_error(sorted(gone), "cannot broadcast")
        try:
            key, define = self.function(call.function)
            payload = self.payload(call, key, shared=True)
            root = self._fan_out(payload, targets)
            places = [(r, w) for r in targets for w in range(self.procs)]
            batch = Batch(len(places))
            subs = [
                self.submission(call, payload, key, define, pinned=True, batch=batch)
                for _ in places
            ]
            for (_, worker), sub in zip(places, subs, strict=True):
                sub.siblings, sub.generation, sub.worker = subs, self.generation, worker
                sub.any_slot = any_slot and self.procs == 1
            pinned = [rank for rank, _ in places]
            if gated:
                with self.lock:
                    self._gated_calls.append((subs, pinned))
                return subs
            if root is not None:  # the tree's root last: see _fan_out
                order = sorted(range(len(subs)), key=lambda i: pinned[i] == root)
                self._place_all([subs[i] for i in order], [pinned[i] for i in order])
            else:
                self._place_all(subs, pinned)
        finally:
            if not gated:
                with self.lock:
                    self._placing -= 1
        return subs

    def _fan_out(self, payload: Payload, targets: list[int]) -> int | None:
        """Relay ``payload`` from node to node when it is large and goes to many remote
        nodes (``fanout.py``); the rank of the tree's root, to send to last (the others'
        small frames go first, so that they are ready when the bytes flow), or None."""
        nodes = [self.nodes[r] for r in dict.fromkeys(targets)]
        nodes = [n for n in nodes if n.state is NodeState.READY and fanout.eligible(n)]
        if not nodes or not fanout.worth_it(payload.size(), len(nodes)):
            return None
        payload.fanout = fanout.Fanout(payload.parts(False), nodes)
        return nodes[0].rank

    def _place_all(self, subs: list[Submission], ranks: list[int]) -> None:
        """Send the calls of a broadcast, each to the node at its rank."""
        try:
            for sub, rank in zip(subs, ranks, strict=True):
                self.place(sub, rank)
        except BaseException:
            for sub in subs:
                if sub.node is None and not self._parked(sub):
                    sub.payload.release()
                    self._by_future.pop(id(sub.future), None)
            raise

    def _parked(self, sub: Submission) -> bool:
        with self.lock:
            return any(sub in subs for subs in self._waiting.values())

    def cancel(self, futures: Iterable[Future[Any]]) -> None:
        """Stop calls: a running one has its process replaced, a queued one is skipped."""
        for fut in futures:
            sub = self._by_future.get(id(fut))
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
            for subs in (*self._waiting.values(), self._unplaced, self.backlog):
                if sub in subs:
                    subs.remove(sub)
                    return True
            if any(sub in subs for subs, _ in self._gated_calls):
                return True  # skipped when the gate opens: its future is settled
        return False

    def all_lost(self) -> PoolClosedError:
        return PoolClosedError("no node of this pool can take calls: every node was lost")

    def _gone_error(self, ranks: list[int], what: str) -> PoolClosedError:
        reasons = "; ".join(f"node {r}: {self._gone.get(r) or 'lost'}" for r in ranks)
        names = ", ".join(self.nodes[r].name for r in ranks)
        if all(r in self._replacing for r in ranks):  # (see down())
            back = "cannot take calls until it is back"
            return PoolClosedError(f"{what}: {names} {back} ({reasons})")
        return PoolClosedError(f"{what}: {names} can no longer take calls ({reasons})")

    # -- results (loop thread) -------------------------------------------------------
    def on_result(self, node: Node, sub: Submission, status: int, body: bytes | bytearray) -> None:
        try:
            value, exc = outcome(node, sub.call.function, sub.timeout, status, body)
            if exc is None and sub.stream is None and yields(sub.call.function.fn):
                value = collected(sub)  # a yielding call without an iterator: its values
        except BaseException as e:  # e.g. a result whose type cannot be unpickled here
            value, exc = None, e
        if self.group and status == Status.ERROR and exc is not None and _others_run(sub):
            # the others may wait for this one in a collective, and would wait forever
            what = f"{type(exc).__name__}: {exc}".splitlines()[0]
            cause = f"{node.name}: {sub.call.function.name}(...) raised {what}"
            asyncio.get_running_loop().call_later(
                STRAGGLER_GRACE, self._restart_if_stuck, sub, cause
            )
        sub.finished = True
        if self.group and exc is not None and _others_run(sub):
            with self.lock:
                sub.held = (value, exc)  # settled once every sibling has ended
                self._held.add(sub)
            return
        retried = isinstance(exc, (WorkerDiedError, *sub.call.function.retry_on))
        if retried and exc is not None and self.retry(sub, exc):
            return
        self.settle(sub, value=value, exc=exc)

    def _restart_if_stuck(self, sub: Submission, cause: str) -> None:
        """Restart the group if calls of ``sub``'s broadcast still run, in the group
        generation they were sent in. While the broadcast is still being sent (a sibling
        not sent yet, nor waiting for a replacement), the check comes again shortly: a
        RESTART must not overtake a sibling's call, which would run alone after it."""
        if not _others_run(sub):
            return
        if any(
            s.node is None and not s.finished and not s.future.done() and not self._parked(s)
            for s in sub.siblings or ()
        ):
            asyncio.get_running_loop().call_later(0.01, self._restart_if_stuck, sub, cause)
            return
        self.restart_group(cause, sub.generation)

    def restart_group(self, cause: str, generation: int) -> None:
        """Restart every process of a group pool (see ``plugins._base``), once per ``generation``
        of the group: later reports of the same break are ignored."""
        if generation != self.generation or not self.running():
            return
        self.generation += 1
        cause = redact(cause, self.secrets)  # logged, and sent to every node
        logger.warning("restarting every process of the pool: %s", cause)
        loop = asyncio.get_running_loop()
        for node in self.nodes:
            if node.state is NodeState.READY:
                send = partial(node.send_control, Kind.RESTART, ident=self.generation)
                if not send(wait=False, body=cause.encode()):  # busy: not on the loop
                    loop.run_in_executor(None, partial(send, wait=True, body=cause.encode()))

    def on_lost(self, node: Node, subs: list[Submission]) -> None:
        """``node``'s agent is gone (``subs`` ran on it): replace it, retry or fail them."""
        err = node.lost_error(f"was lost while running a call: {node.loss}")
        why = _why(node)
        rank = node.rank
        with self.lock:
            current = rank < len(self.nodes) and self.nodes[rank] is node
            fresh = current and rank not in self._replacing and rank not in self._gone
        if fresh and self.replacer is not None and self.running():
            down = self.replacer(rank, why)
            with self.lock:
                self._replacing.update(down)
                for r in down:
                    self._waiting.setdefault(r, [])
        elif fresh:
            hint = "; Options(replace_lost_nodes=True) replaces lost nodes"
            self._give_up([rank], why + (hint if self.replacer is None else ""))
        started, queued = _started(node, subs)
        for sub in queued:  # they never ran: sent again, retries or not
            if not self.retry(sub, err, free=True):
                self.settle(sub, exc=err)
        for sub in started:
            if not self.retry(sub, err):
                self.settle(sub, exc=err)

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
                self.place(sub, previous.rank)
            else:
                self.place(sub, exclude=previous)
        except Exception:
            return False
        return True

    def settle(
        self, sub: Submission, *, value: Any = None, exc: BaseException | None = None
    ) -> None:
        self._by_future.pop(id(sub.future), None)
        try:  # (a future settled already, e.g. by close, stays as it is)
            if exc is not None:
                # the one point errors reach the caller through: no secrets
                sub.future.set_exception(redact_exception(exc, self.secrets))
            else:
                sub.future.set_result(value)
        except InvalidStateError:
            pass
        sub.payload.release()  # after: removing a large shared-memory file takes a while
        if self._held and sub.siblings:
            self._release_held(sub.siblings)
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
                choice = self.least_busy()
                if not self.backlog or choice is None or self._gated:
                    return
                if self.hold and choice[0].busy[choice[1]] > 0:
                    return
                sub = self.backlog.pop(0)
            if sub.future.done():
                continue
            try:
                self.place(sub)
            except Exception as e:
                self.settle(sub, exc=e)

    # -- an elastic pool's size (loop thread) -------------------------------------------
    def add(self, nodes: Sequence[Node], tell: Telling) -> list[Node]:
        """New ``nodes`` (at the next ranks) serve: backlogged calls go to them. The nodes
        there before are told first (``tell(every node, the old ones)`` returns those it
        could not tell without waiting: the caller tells them at once)."""
        with self.lock:
            old = list(self.nodes)
            for node in nodes:
                assert node.rank == len(self.nodes)
                self.nodes.append(node)
            left = tell(list(self.nodes), old)
        self.pump()
        return left

    def gate(self) -> None:
        """Stop sending new calls (a group pool is to change size between calls): the
        broadcasts and single calls made from now on wait for :meth:`resume`; those
        being sent and running go on (see :meth:`drained`)."""
        with self.lock:
            self._gated = True

    def drained(self) -> bool:
        """With the gate closed: whether no call runs or is being sent any more; if so
        every node is taken out of service until :meth:`resume`."""
        with self.lock:
            if self._placing or self._waiting:
                return False
            for node in self.nodes:
                with node.lock:
                    if node.inflight or any(node.busy):
                        return False
            for node in self.nodes:  # a retry on its way to one is refused, and waits
                with node.lock:
                    node.state = NodeState.CLOSED
            for rank in range(len(self.nodes)):
                self._replacing.add(rank)
                self._waiting[rank] = []
            return True

    def resume(self, nodes: Sequence[Node], failure: str = "") -> None:
        """The pool's ``nodes`` after a change of size (:meth:`pause_if_idle`): they
        serve, and the calls that waited are sent (to a rank no more: they fail). With
        ``failure`` (no nodes: the new group did not start) every rank is gone."""
        if failure:
            with self.lock:
                self._gated = False
                self._opened.notify_all()
                gated, self._gated_calls = self._gated_calls, []
            self._give_up(range(len(self.nodes)), f"could not restart: {failure}")
            for subs, _ in gated:
                for sub in subs:
                    self.settle(sub, exc=PoolClosedError(f"the pool could not restart: {failure}"))
            return
        with self.lock:
            self.nodes[:] = nodes
            self._replacing.clear()
            self._gated = False
            self._opened.notify_all()
            waiting, self._waiting = self._waiting, {}
            unplaced, self._unplaced = self._unplaced, []
            gated, self._gated_calls = self._gated_calls, []
        for rank, subs in waiting.items():
            for sub in subs:
                if rank < len(nodes):
                    self._resend(sub, rank)
                else:
                    self.settle(sub, exc=PoolClosedError(f"node {rank} left the pool"))
        for sub in unplaced:
            self._resend(sub, None)
        for subs, ranks in gated:  # whole broadcasts and batches, as they were made
            self._send(subs, ranks)
        self.pump()

    def remove_idle(self, node: Node, tell: Telling) -> list[Node] | None:
        """Take the last node out of service if it runs nothing (None if it does); the
        others are told first (see :meth:`add`: those left to tell are returned)."""
        with self.lock:
            if self.nodes[-1] is not node or node.rank in self._waiting:
                return None
            with node.lock:
                if node.inflight or any(node.busy):
                    return None
                node.state = NodeState.CLOSED
            self.nodes.pop()
            return tell(list(self.nodes), list(self.nodes))

    def _release_held(self, siblings: list[Submission]) -> None:
        """Settle the held failures of a broadcast whose calls have all ended."""
        with self.lock:
            if any(s.held is None and not s.future.done() for s in siblings):
                return
            held = [s for s in siblings if s in self._held]
            self._held.difference_update(held)
        for s in held:
            assert s.held is not None
            value, exc = s.held
            s.held = None
            self.settle(s, value=value, exc=exc)

    # -- lost nodes and their replacements (loop thread) ------------------------------
    def retire(self, node: Node, cause: str) -> None:
        """Take a live node of a group pool out of service (its group is restarted): its
        calls end as ABORTED ones do, or are retried."""
        node.state = NodeState.CLOSED
        with node.lock:
            subs = list(node.inflight.values())
            node.inflight.clear()
        for sub in subs:
            err = WorkerDiedError(
                f"{node.name}: {sub.call.function.name}(...) was stopped because {cause}; "
                "the pool's processes form one group, so all of them were restarted",
                node=node.rank,
                restarted=True,
            )
            if not self.retry(sub, err):
                self.settle(sub, exc=err)

    def back(self, nodes: Sequence[Node]) -> None:
        """Replacement ``nodes`` are ready: put them in service and send what waited."""
        with self.lock:
            for node in nodes:
                self.nodes[node.rank] = node
                self._replacing.discard(node.rank)
                self._gone.pop(node.rank, None)  # (down() while it was tried again)
            waiting = [(n.rank, self._waiting.pop(n.rank, [])) for n in nodes]
            unplaced, self._unplaced = self._unplaced, []
        for rank, subs in waiting:
            for sub in subs:
                self._resend(sub, rank)
        for sub in unplaced:
            self._resend(sub, None)

    def _resend(self, sub: Submission, rank: int | None) -> None:
        if sub.future.done():
            return
        if self.group and sub.siblings:
            failed = next((s for s in sub.siblings if _failed(s)), None)
            if failed is not None:  # it would wait in a collective for a sibling that ended
                err = failed.held[1] if failed.held else failed.future.exception()
                self.settle(sub, exc=WorkerDiedError(f"not run: {err}", node=rank or 0))
                return
            sub.generation = self.generation
        try:
            self.place(sub, rank)
        except Exception as e:
            self.settle(sub, exc=e)

    def failed(self, ranks: Sequence[int], reason: str) -> None:
        """The nodes at ``ranks`` cannot be replaced: they are gone for good."""
        self._give_up(ranks, f"lost, and no replacement could be started: {reason}")

    def down(self, ranks: Sequence[int], reason: str) -> None:
        """The nodes at ``ranks`` could not be replaced within the pool's start timeout
        (the last attempt failed for ``reason``): the calls waiting for them fail, and so do
        new ones pinned to them, naming them, until a replacement is back (:meth:`back`:
        the pool keeps trying, see ``renew.py``)."""
        with self.lock:
            if all(self._gone.get(r) is not None for r in ranks):
                for rank in ranks:  # the latest failure, for the next errors
                    self._gone[rank] = _not_back(reason)
                return
        self._give_up(ranks, _not_back(reason), replacing=True)

    def _give_up(self, ranks: Sequence[int], reason: str, replacing: bool = False) -> None:
        """Fail the calls waiting for ``ranks`` and the later ones pinned to them; with
        ``replacing``, the ranks are still being replaced (they serve again once back)."""
        with self.lock:
            waiting: list[tuple[int, Submission]] = []
            for rank in ranks:
                self._gone[rank] = reason
                if not replacing:
                    self._replacing.discard(rank)
                waiting += [(rank, sub) for sub in self._waiting.pop(rank, [])]
            unplaced: list[Submission] = []
            if not self._waiting:
                unplaced, self._unplaced = self._unplaced, []
        for rank, sub in waiting:
            self.settle(sub, exc=self._gone_error([rank], "cannot run the call"))
        for sub in unplaced:
            self._resend(sub, None)

    def close(self, exc: Callable[[str], BaseException]) -> None:
        """The pool closes: every call still waiting or in flight ends with ``exc(where)``."""
        with self.lock:
            self._closed = True
            self._opened.notify_all()
            parked = [s for subs in self._waiting.values() for s in subs] + self._unplaced
            parked += self.backlog
            parked += [sub for subs, _ in self._gated_calls for sub in subs]
            self._gated_calls = []
            self._waiting.clear()
            self._unplaced = []
            self.backlog = []
        for sub in parked:
            self.settle(sub, exc=exc("a lost node was replaced"))
        with self.lock:
            held, self._held = list(self._held), set()
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


def _not_back(reason: str) -> str:
    return f"lost, and not replaced yet: {reason}; the pool keeps trying to bring it back"


def _why(node: Node) -> str:
    """Why ``node`` was lost, in a few words for the console."""
    if node.silence:
        return f"it stopped answering for {node.silence:.1f} s"
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
    agent that starts its calls: then every call counts as started."""
    dropped: str = getattr(node.proc, "lost_reason", "")  # e.g. the SSH connection's
    if not node.ended or node.silence or dropped:
        return subs, []
    started = [s for s in subs if s.started]
    return started, [s for s in subs if not s.started]


def _others_run(sub: Submission) -> bool:
    """True when another call of ``sub``'s broadcast has not finished."""
    return any(s is not sub and not s.finished and not s.future.done() for s in sub.siblings or ())


def _failed(sub: Submission) -> bool:
    if sub.held is not None:
        return True
    return sub.future.done() and not sub.future.cancelled() and sub.future.exception() is not None


def _cancelled() -> BaseException:
    from concurrent.futures import CancelledError

    return CancelledError()
