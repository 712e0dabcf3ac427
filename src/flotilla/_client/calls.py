"""Sending calls to a pool: the operators' methods (``>>``, ``@``, ``>``, ``gather``) and
``map``, the methods :class:`~flotilla.Compute` takes from :class:`PoolCalls`. Where each
call goes and what happens when it fails is the :class:`Dispatcher`'s (``dispatch.py``)."""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, as_completed
from functools import partial
from typing import Any, TypeVar

from .._errors import ConfigurationError
from .._providers.base import Options
from . import feeds, lanes
from . import loop as _loop
from .dispatch import Dispatcher
from .elastic import Elastic, Nodes
from .function import Function, PendingCall, Pool, as_call, function
from .futures import Batch
from .node import Node, Submission
from .outcome import results
from .stream import Stream, Values, yields

SEND_CHUNK = 256
"""Calls of a batch (``gather``) sent at a time: the nodes start on the first ones while
the next are prepared, and a node slow to read does not keep the others waiting."""
R = TypeVar("R")


class PoolCalls(Pool):
    """The call-sending methods of a pool whose ``_dispatcher`` sends its calls."""

    options: Options
    size: Nodes
    _dispatcher: Dispatcher
    _elastic: Elastic | None

    @property
    def _nodes(self) -> list[Node]:
        """The current node at each rank."""
        return self._dispatcher.nodes

    @abstractmethod
    def _check_running(self) -> None:
        """Raise PoolClosedError unless the pool takes calls."""

    def submit(self, call: PendingCall[R]) -> Future[R]:
        """Run ``call`` on the least busy node; returns a Future (``call > pool``)."""
        self._check_running()
        return self._send([as_call(call, ">")])[0].future

    def _send(
        self, calls: list[PendingCall[Any]], stream: bool = False, direct: bool = False
    ) -> list[Submission]:
        """Send calls to the least busy slots; their streamed arguments follow
        (``feeds.py``); with ``stream``, ``>>``'s iterator over the values of the one call
        (``stream.py``); with ``direct``, the one call's answer is for this thread to read
        (``Node.wait_direct``: a call without streamed arguments)."""
        split = [feeds.split(c) for c in calls]
        d = self._dispatcher
        bound = [c for c, _ in split]
        encoded = d.encoder.encode(bound)  # a call that cannot be sent fails before any is sent
        batch = Batch(len(calls)) if len(calls) > 1 else None
        subs: list[Submission] = []
        for start in range(0, len(calls), SEND_CHUNK):  # the first calls run meanwhile
            end = start + SEND_CHUNK
            chunk = d.encoder.prepare(bound[start:end], encoded[start:end], batch)
            if stream:  # (one call)
                first = chunk[0]
                first.stream = Values(first.future)  # (the iterator: see _stream)
            elif direct and not split[0][1]:  # (one call)
                chunk[0].direct = threading.get_ident()
            for sub, (_, sources) in zip(chunk, split[start:end], strict=True):
                if sources:
                    feeds.prepare(sub)
            d.placement.dispatch(chunk)
            for sub, (_, sources) in zip(chunk, split[start:end], strict=True):
                if sources:
                    feeds.start(sub, sources, partial(self.cancel, [sub.future]))
            subs += chunk
        return subs

    def run(self, call: PendingCall[R]) -> R:
        """Run ``call`` on the least busy node and return its value (``call >> pool``);
        for a function that yields, an iterator over its values as they come
        (``stream.py``)."""
        call = as_call(call, ">>")
        dispatcher = self._dispatcher
        fn = call.function
        laned = dispatcher.encoder.laned.get(id(fn))  # (a generator's never is: lanes.py)
        if (laned is None or laned[2] is not fn) and yields(fn.fn):
            return self._stream(call)  # type: ignore[return-value]
        self._check_running()
        direct = (
            not dispatcher.group  # a group's results may restart it: the loop's work
            and not dispatcher.most  # an elastic pool's may send backlogged calls: the same
            and not _loop.in_loop_thread()
        )
        if direct:
            taken: list[Submission] = []
            try:
                sent = lanes.send(dispatcher, call, taken)
                if sent is not None:
                    lanes.wait(dispatcher, *sent)
            except BaseException:  # (Ctrl-C): stopped as a running call is
                lanes.stop(dispatcher, taken)
                raise
            if sent is not None:
                lane_value: R = sent[2].future.result()
                return lane_value
        sub = None
        try:
            sub = self._send([call], direct=direct)[0]
            node, fut = sub.node, sub.future
            if direct and node is not None:
                node.wait_direct(fut)  # (also when done: it gives the loop its reading back)
        finally:
            if direct:  # what this thread held and did not read (see Node.wait_direct)
                if sub is None:  # an exception in the sending: on whichever node
                    for held in self._nodes:
                        held.proc.release_direct()
                elif sub.holder is not None:
                    sub.holder.release_direct()
        value: R = fut.result()
        return value

    def _stream(self, call: PendingCall[Any]) -> Stream:
        self._check_running()
        sub = self._send([call], stream=True)[0]
        cancel = partial(self.cancel, [sub.future])
        return Stream(sub.stream, cancel, partial(self._dispatcher.close_stream, sub))

    def dask_client(self, **kwargs: Any) -> Any:
        """A ``distributed.Client`` on this machine connected to the pool's Dask scheduler
        (a pool with ``plugins.dask()``), through the pool's own channel to node 0 (the
        shell its agent was started with: ``ssh``, ``srun``, ``kubectl exec``...), or
        directly for nodes on this machine; no port is opened to others. ``kwargs`` go to
        ``Client``. Closed (with its forward) when the pool closes."""
        self._check_running()
        from ..plugins._dask import dask_client

        return dask_client(self, **kwargs)

    def ray_dashboard(self) -> str:
        """The URL on this machine of the pool's Ray dashboard (``plugins.ray(dashboard=True)``),
        forwarded to the head's through the pool's own channel as :meth:`dask_client`;
        the forward closes with the pool."""
        self._check_running()
        from ..plugins._ray import dashboard_url

        return dashboard_url(self)

    def broadcast(self, call: PendingCall[R]) -> list[R]:
        """Run ``call`` on every node; results in node-rank order (``call @ pool``)."""
        return results(self.submit_broadcast(call))

    def submit_broadcast(
        self, call: PendingCall[R], nodes: Sequence[int] | None = None, any_slot: bool = False
    ) -> list[Future[R]]:
        """Run ``call`` on every node (or the ranks in ``nodes``); a Future per process, in
        global rank order (one per node unless a plugin runs several processes per node).
        ``any_slot``: on a node with several task slots (``Worker(concurrency=...)``), the
        call runs in the least busy one, beside what the others run (the command line's
        job queue runs several jobs at once so); otherwise always in the first.

        A node being replaced (its agent was lost) gets its call once it is back."""
        self._check_running()
        call = as_call(call, "@")
        elastic = self._elastic
        while nodes is None and elastic is not None and not self._nodes:  # scaled to zero
            _loop.run(elastic.wake(self.options.start_timeout))
        present = len(self._nodes)
        missing = [r for r in nodes or () if not 0 <= r < present]
        if missing:
            raise ConfigurationError(
                f"nodes={list(nodes or ())}: the pool has {present} node(s) now "
                f"(ranks 0..{present - 1}), no node {missing[0]}"
                + (
                    "; an elastic pool that scaled to zero starts nodes on its next call "
                    "or broadcast to every node"
                    if elastic is not None
                    else ""
                )
            )
        ranks = None if nodes is None else [self._nodes[r].rank for r in nodes]
        return [s.future for s in self._dispatcher.placement.broadcast(call, ranks, any_slot)]

    def resize(self, *spec: int | Nodes) -> None:
        """``resize(n)``: head for ``n`` nodes now, within the pool's ``min`` and ``max``
        (an elastic pool): nodes are started or released (idle ones only, the last first)
        in the background; :meth:`current_nodes` says how far it got. The autoscaler goes
        on from there (an idle pool shrinks to ``min`` again after
        ``Options(autoscale_idle_timeout=...)``).

        ``resize(desired, max)`` or ``resize(Nodes(desired, max=..., min=...))``, as in
        Skyward: the pool's bounds change to those (a pool opened elastic only) and it
        heads for ``desired``; ``resize(Nodes(n))`` keeps it at ``n`` (no autoscaling).
        The new ``max`` is at most the one the pool opened with.
        """
        self._check_running()
        elastic = self._elastic
        match spec:
            case (int() as n,) if not isinstance(n, bool):
                bounds = None
            case (Nodes() as bounds,):
                pass
            case (int() as lo, int() as hi) if not {type(lo), type(hi)} & {bool}:
                bounds = Nodes(lo, max=hi)
            case _:
                raise ConfigurationError(
                    f"resize{spec!r}: give resize(n), resize(desired, max) or "
                    "resize(Nodes(desired, max=..., min=...))"
                )
        if bounds is not None:
            if elastic is None:
                raise ConfigurationError(
                    f"resize({bounds!r}): this pool has a fixed size ({self.size}); open it "
                    "with a range (nodes=(desired, max) or Nodes(...)) to change its bounds"
                )
            if bounds.most > elastic.limit:
                raise ConfigurationError(
                    f"resize({bounds!r}): at most {elastic.limit} node(s), the max the pool "
                    "opened with (its provider was checked, and placed it, for that many); "
                    "open it with a larger max"
                )
            self.size = bounds
            _loop.get_loop().call_soon_threadsafe(elastic.bound, bounds)
            return
        if elastic is None or not self.size.auto_scaling:
            raise ConfigurationError(
                f"resize({n!r}): this pool has a fixed size ({self.size}); "
                "an elastic pool has a max: nodes=(desired, max) or Nodes(desired, max=...)"
            )
        if not elastic.floor <= n <= elastic.cap:
            capped = (
                f" (max_hourly_cost buys {elastic.cap})" if elastic.cap < self.size.most else ""
            )
            raise ConfigurationError(
                f"resize({n!r}): the pool's size stays within its min ({elastic.floor}) and "
                f"max ({elastic.cap}){capped}: {self.size}"
            )
        _loop.get_loop().call_soon_threadsafe(elastic.resize, n)

    def cancel(self, futures: Iterable[Future[Any]]) -> None:
        """Stop calls sent to this pool: a running one has its process replaced, a queued
        one is skipped. Their futures raise ``concurrent.futures.CancelledError``."""
        self._dispatcher.cancel(futures)

    def run_many(self, calls: Sequence[PendingCall[Any]]) -> list[Any]:
        """Run different calls in parallel; results in call order."""
        return results(self._submit_many(calls))

    def _submit_many(self, calls: Sequence[PendingCall[Any]]) -> list[Future[Any]]:
        self._check_running()
        return [s.future for s in self._send([as_call(c, "gather") for c in calls])]

    def submit_group(self, calls: Sequence[PendingCall[Any]]) -> Future[tuple[Any, ...]]:
        """Run calls in parallel in the background; a Future of their results' tuple."""
        futures = self._submit_many(calls)
        out: Future[tuple[Any, ...]] = Future()
        out.set_running_or_notify_cancel()
        remaining = [len(futures)]

        def done(_: Future[Any]) -> None:
            remaining[0] -= 1
            if out.done():
                return
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                out.set_exception(failed.exception())
            elif remaining[0] == 0:
                out.set_result(tuple(f.result() for f in futures))

        for f in futures:
            f.add_done_callback(done)
        if not futures:
            out.set_result(())
        return out

    def stream(self, calls: Sequence[PendingCall[Any]], ordered: bool = True) -> Iterator[Any]:
        """Yield results as calls finish: in call order, or completion order if not ``ordered``."""
        futures = self._submit_many(calls)

        def iterate() -> Iterator[Any]:
            if ordered:
                for f in futures:
                    yield f.result()
            else:
                for f in as_completed(futures):
                    yield f.result()

        return iterate()

    def map(self, fn: Callable[..., R] | Function[..., R], *iterables: Iterable[Any]) -> list[R]:
        """``list(map(fn, *iterables))``, spread over the nodes; results in input order (with
        several iterables, ``fn`` takes one item of each and the shortest one ends it)."""
        if not iterables:
            raise TypeError("pool.map(fn, items, ...) needs at least one iterable")
        f = fn if isinstance(fn, Function) else function(fn)
        return self.run_many([PendingCall(f, args, {}) for args in zip(*iterables, strict=False)])

    # -- operators with something else on the left ---------------------------------------
    def __rrshift__(self, other: object) -> Any:
        raise _left_operand_error(">>", other)

    def __rmatmul__(self, other: object) -> Any:
        raise _left_operand_error("@", other)

    def __lt__(self, other: object) -> Any:  # `other > pool` when other has no __gt__
        raise _left_operand_error(">", other)


def _left_operand_error(op: str, other: object) -> ConfigurationError:
    if callable(other):
        name = getattr(other, "__name__", type(other).__name__)
        return ConfigurationError(
            f"`{name}` is a plain function: decorate it with @flotilla.function and call it, "
            f"as in `{name}(...) {op} pool`"
        )
    return ConfigurationError(
        f"the left side of `{op} pool` must be a call of a @flotilla.function, "
        f"not {type(other).__name__}"
    )
