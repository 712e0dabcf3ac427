"""``Compute``: a pool of nodes, and how calls are dispatched to it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, as_completed
from enum import Enum
from typing import Any, TypeVar

from .._accelerators import Accelerator, parse_accelerator
from .._errors import (
    ConfigurationError,
    PoolClosedError,
    ProvisionError,
    SerializationError,
    WorkerDiedError,
)
from .._image import Image, plain_env, redact, secret_values, ship_user_modules
from .._info import InstanceInfo, Peer
from .._providers.base import AgentProcess, Allocation, Options, PoolSpec, Provider
from .._wire.frames import Buffer, Kind, Status, frame
from .._wire.serialize import (
    SHM_DIR,
    describe_unpicklable,
    encode,
    pickle_obj,
    unlink_shm,
    write_shm,
)
from . import loop as _loop
from .console import Console
from .function import Function, PendingCall, as_call, function
from .node import Node, NodeEvents, NodeState, Payload, Submission
from .outcome import outcome, results

logger = logging.getLogger("flotilla")
STRAGGLER_GRACE = 1.0
"""Seconds the other calls of a broadcast get to finish after one raised, in a group pool,
before the group is restarted (see ``_plugins``)."""
R = TypeVar("R")


class PoolState(Enum):
    """Lifecycle of a pool::

    NEW --enter--> STARTING --all nodes ready--> RUNNING --exit--> CLOSING --> CLOSED
    STARTING --failure / Ctrl-C--> CLOSING --> CLOSED
    """

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class Compute:
    """A pool of nodes. Use it as a context manager; leaving the block stops everything.

    Args:
        provider: where the nodes run; None means ``flotilla.Local()`` (local processes).
        nodes: number of nodes (>= 1).
        accelerator: accelerators per node: "A100", "A100:8" or ``accelerators.A100(8)``.
        image: the node environment (an ``Image``); None for the provider's default.
        plugins: framework plugins (``plugins.torch()``...), applied in order.
        options: :class:`Options` (cluster/standalone mode, timeouts, env).

    Send calls with the operators ``call >> pool`` (one node), ``call @ pool`` (every node),
    ``call > pool`` (a Future), ``(a & b) >> pool`` / ``gather(...) >> pool`` (in parallel),
    or with :meth:`map`.
    """

    def __init__(
        self,
        provider: Provider | None = None,
        nodes: int = 1,
        accelerator: str | Accelerator | None = None,
        image: Any = None,
        plugins: Sequence[Any] = (),
        options: Options | None = None,
    ) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(
                f"nodes must be a positive integer, got {nodes!r}: a pool needs at least one node"
            )
        if provider is None:
            from .._providers.local import Local

            provider = Local()
        if not isinstance(provider, Provider):
            raise TypeError(
                "provider must be a flotilla provider such as flotilla.Local(), "
                f"got {type(provider).__name__}"
            )
        if options is None:
            options = Options()
        elif not isinstance(options, Options):
            raise TypeError(f"options must be a flotilla.Options, got {type(options).__name__}")
        self.provider = provider
        self.nodes = nodes
        self.accelerator = parse_accelerator(accelerator)
        self.image = image
        self.plugins = tuple(plugins)
        self.options = options
        self.pool_id = secrets.token_hex(4)
        self._check_plugins()
        self.procs_per_node = max(
            [int(getattr(p, "procs_per_node", 1)) for p in self.plugins] + [1]
        )
        """Processes per node (a plugin such as ``plugins.torch(procs_per_node=2)`` sets it)."""
        self._group = (
            options.cluster
            and nodes * self.procs_per_node > 1
            and any(getattr(p, "forms_group", False) for p in self.plugins)
        )
        """The pool's processes form one group: they are restarted together (see _plugins)."""
        self._generation = 0  # group restarts so far
        self._state = PoolState.NEW
        self._nodes: list[Node] = []
        self._procs: list[AgentProcess] = []
        self._allocation: Allocation | None = None
        self._functions: dict[int, tuple[int, list[Buffer], Function[..., Any]]] = {}
        self._shm_prefix = f"flotilla-{self.pool_id}-"
        self._heartbeat: asyncio.Task[None] | None = None
        self._by_future: dict[int, Submission] = {}  # cancellable calls, by id(future)
        self._includes = b""
        self._build_spec: dict[str, Any] | None = None
        self._env: dict[str, str] = {}
        self._secrets: list[str] = []
        self._console = Console()
        self.output_sink: Callable[[int, int, list[str]], None] | None = None
        """Receives (node rank, stream, lines) instead of printing them, when set."""
        self.state_sink: Callable[[int, int, str], None] | None = None
        """With ``output_sink``: receives (node rank, stream, what a line redrawn with
        ``\\r`` shows now: a progress bar), instead of drawing it."""

    def _check_plugins(self) -> None:
        for p in self.plugins:
            if not (hasattr(p, "around_process") or hasattr(p, "transform")):
                raise TypeError(
                    f"{p!r} is not a flotilla plugin (it has neither transform nor around_process)"
                )
            if not self.options.cluster and getattr(p, "requires_cluster", False):
                name = getattr(p, "name", type(p).__name__)
                raise ConfigurationError(
                    f"plugin {name!r} needs cluster mode (nodes that know each other), "
                    "but the pool "
                    f"has Options(cluster=False): remove the plugin or use cluster=True"
                )

    def __repr__(self) -> str:
        return f"<flotilla.Compute {self.provider!r} nodes={self.nodes} {self._state.value}>"

    @property
    def state(self) -> PoolState:
        return self._state

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> Compute:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spec(self, image: Image) -> PoolSpec:
        return PoolSpec(
            self.pool_id, self.nodes, self.accelerator, image, self.plugins, self.options
        )

    def open(self) -> Compute:
        """Start the pool (what entering the ``with`` block does)."""
        if self._state is not PoolState.NEW:
            raise PoolClosedError("a Compute pool can be started once; create a new Compute")
        image = self.image if self.image is not None else Image()
        if not isinstance(image, Image):
            raise TypeError(f"image must be a flotilla.Image, got {type(image).__name__}")
        spec = self._spec(image)
        self.provider.validate(spec)
        for p in self.plugins:
            hook = getattr(p, "transform", None)
            if hook is not None:
                image = hook(image, spec)
                if not isinstance(image, Image):
                    raise TypeError(f"plugin {p!r}: transform() must return an Image")
        spec = self._spec(image)
        try:
            blob = pickle_obj(list(self.plugins)).main if self.plugins else b""
        except Exception as e:
            raise SerializationError(f"the pool's plugins cannot be pickled: {e}") from e
        if not self.provider.shares_filesystem:
            ship_user_modules()
        self._includes = image.includes_archive()
        self._build_spec = image.build_spec(self._includes) if image.needs_build else None
        self._env = {**plain_env(image.env), **plain_env(self.options.env)}
        self._secrets = secret_values(image.env) + secret_values(self.options.env)
        self._state = PoolState.STARTING
        loop = _loop.get_loop()
        fut = asyncio.run_coroutine_threadsafe(self._start(spec, blob), loop)
        try:
            fut.result()
        except BaseException:
            fut.cancel()
            self.close()
            raise
        self._state = PoolState.RUNNING
        return self

    async def _start(self, spec: PoolSpec, blob: bytes) -> None:
        loop = asyncio.get_running_loop()
        probe = {"name": f"{self._shm_prefix}probe", "token": secrets.token_hex(16)}
        try:
            fd = os.open(os.path.join(SHM_DIR, probe["name"]), os.O_CREAT | os.O_WRONLY, 0o600)
            os.write(fd, probe["token"].encode())
            os.close(fd)
        except OSError:
            probe = {}
        self._allocation, procs = await self.provider.start(spec, self.provider.agent_command())
        self._procs = procs
        self._console = Console(self._secrets)
        self._console.begin(range(len(procs)))
        started = time.monotonic()
        events = _PoolEvents(self)
        self._nodes = [
            Node(rank, p, self._on_result, self._on_lost, events) for rank, p in enumerate(procs)
        ]
        for node in self._nodes:
            node.start(loop)
        self._heartbeat = loop.create_task(self._heartbeats())  # builds may take a while
        timeout = self.options.start_timeout
        hellos = await self._wait_all([n.hello for n in self._nodes], timeout, "start")
        peers = tuple(Peer(n.rank, n.proc.address, n.proc.host) for n in self._nodes)
        head = peers[0]
        head_port = int(hellos[0]["port"])
        cluster = self.options.cluster
        for node in self._nodes:
            info = InstanceInfo(
                node=node.rank,
                total_nodes=len(self._nodes),
                is_head=cluster and node.rank == 0,
                head_addr=head.addr if cluster else "",
                head_port=head_port if cluster else 0,
                accelerators=self.accelerator.count if self.accelerator else 0,
                peers=peers if cluster else (),
                pool_id=self.pool_id,
                addr=node.proc.address,
                cluster=cluster,
                accelerator=self.accelerator.name if self.accelerator else None,
                procs_per_node=self.procs_per_node,
            )
            config = {
                "pool_id": self.pool_id,
                "procs": self.procs_per_node,
                "compute_pool": info.to_json(),
                "env": self._env,
                "image": self._build_spec,
                "home": self.provider.home,
                "heartbeat_timeout": self.options.heartbeat_timeout,
                "shutdown_grace": self.options.shutdown_grace,
                "shm_probe": probe or None,
                "group": self._group,
            }
            node.configure(config, blob)
        await self._wait_all([n.ready for n in self._nodes], timeout, "initialise")
        self._console.end(f"{len(self._nodes)} node(s) ready in {time.monotonic() - started:.1f} s")
        if probe:
            unlink_shm(probe["name"])

    async def _wait_all(
        self, futures: list[asyncio.Future[dict[str, Any]] | None], timeout: float, what: str
    ) -> list[dict[str, Any]]:
        waiting = [f for f in futures if f is not None]
        for f in waiting:  # failures after the first are reported through the first
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        _done, pending = await asyncio.wait(
            waiting, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION
        )
        for fut in waiting:  # root cause first: the first node that failed
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        if pending:
            late = [n.name for n, f in zip(self._nodes, futures, strict=True) if f in pending]
            raise ProvisionError(
                f"{', '.join(late)} did not {what} within {timeout:.0f} s "
                f"(Options(start_timeout=...) sets the limit)"
            )
        return [f.result() for f in waiting]

    async def _heartbeats(self) -> None:
        interval = self.options.heartbeat_timeout / 4
        while True:
            await asyncio.sleep(interval)
            for node in self._nodes:
                if node.state in (NodeState.READY, NodeState.CONFIGURING):
                    node.send_control(Kind.PING, wait=False)

    def close(self) -> None:
        """Stop every node and release everything the pool started. Idempotent."""
        self._console.close()
        if self._state in (PoolState.CLOSED, PoolState.NEW):
            self._state = PoolState.CLOSED
            return
        self._state = PoolState.CLOSING
        try:
            _loop.run(self._close())
        finally:
            self._state = PoolState.CLOSED

    async def _close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for node in self._nodes:
            if node.state is NodeState.READY or node.state is NodeState.CONFIGURING:
                node.send_control(Kind.SHUTDOWN)
            node.state = NodeState.CLOSED
        grace = self.options.shutdown_grace + 0.5
        await asyncio.gather(*(p.wait(grace) for p in self._procs))
        await asyncio.gather(*(p.terminate() for p in self._procs), return_exceptions=True)
        if self._allocation is not None:
            await self._allocation.release()
        for node in self._nodes:
            node.flush_output()
        self._console.close()  # the lines just flushed ended their bars
        for node in self._nodes:
            with node.lock:
                subs = list(node.inflight.values())
                node.inflight.clear()
            for sub in subs:
                self._settle(
                    sub,
                    exc=PoolClosedError(f"the pool closed before {node.name} finished the call"),
                )
        with contextlib.suppress(OSError):
            for name in os.listdir(SHM_DIR):
                if name.startswith(self._shm_prefix):
                    unlink_shm(name)

    # -- operators with something else on the left ---------------------------------------
    def __rrshift__(self, other: object) -> Any:
        raise _left_operand_error(">>", other)

    def __rmatmul__(self, other: object) -> Any:
        raise _left_operand_error("@", other)

    def __lt__(self, other: object) -> Any:  # `other > pool` when other has no __gt__
        raise _left_operand_error(">", other)

    # -- dispatch ------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._state is not PoolState.RUNNING:
            if self._state is PoolState.NEW:
                raise PoolClosedError(
                    "this pool is not started: use `with flotilla.Compute(...) as pool:`"
                )
            raise PoolClosedError(
                f"this pool is {self._state.value}: "
                "send calls inside the `with flotilla.Compute(...)` block"
            )

    def _function(self, fn: Function[..., Any]) -> tuple[int, list[Buffer]]:
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

    def _payload(self, call: PendingCall[Any], fn_key: int, shared: bool) -> Payload:
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
        shm = ""
        if shared and pickled.shm_bytes and any(n.shm for n in self._nodes):
            shm = write_shm(pickled, self._shm_prefix)
        return Payload(pickled, shm)

    def _submission(
        self,
        call: PendingCall[Any],
        payload: Payload,
        fn_key: int,
        define: list[Buffer],
        pinned: bool,
    ) -> Submission:
        fut: Future[Any] = Future()
        fut.set_running_or_notify_cancel()
        payload.acquire()
        fn = call.function
        sub = Submission(call, fut, fn_key, define, payload, fn.retries, fn.timeout or 0.0, pinned)
        self._by_future[id(fut)] = sub
        return sub

    def _least_busy(self, exclude: Node | None = None) -> tuple[Node, int]:
        """The ready (node, local rank) with the fewest calls in flight, lowest rank first
        among equals; on a node other than ``exclude`` when there is one."""
        nodes = [n for n in self._nodes if n.state is NodeState.READY]
        if exclude is not None:
            nodes = [n for n in nodes if n is not exclude] or nodes
        best: tuple[Node, int] | None = None
        least = 0
        for node in nodes:
            for worker, busy in enumerate(node.busy):
                if best is None or busy < least:
                    best, least = (node, worker), busy
        if best is None:
            raise self._all_lost()
        return best

    def _all_lost(self) -> PoolClosedError:
        return PoolClosedError("no node of this pool can take calls: every node was lost")

    def _prepare(self, calls: Sequence[PendingCall[Any]]) -> list[Submission]:
        subs = []
        for call in calls:
            key, define = self._function(call.function)
            payload = self._payload(call, key, shared=False)
            subs.append(self._submission(call, payload, key, define, pinned=False))
        return subs

    def _dispatch(self, subs: list[Submission]) -> None:
        """Send each call to the least busy node; ties go to the lowest rank.

        Counting each assignment spreads a batch evenly; preferring low ranks among idle
        nodes keeps one agent warm for a stream of single calls.
        """
        if len(subs) == 1:  # the common case (`>>`): no bookkeeping beyond the choice
            node, subs[0].worker = self._least_busy()
            node.send(subs)
            return
        load = {
            (n, w): busy
            for n in self._nodes
            if n.state is NodeState.READY
            for w, busy in enumerate(n.busy)
        }
        if not load:
            raise self._all_lost()
        by_node: dict[Node, list[Submission]] = {}
        for sub in subs:
            node, sub.worker = best = min(load, key=load.__getitem__)
            load[best] += 1
            by_node.setdefault(node, []).append(sub)
        for node, batch in by_node.items():
            node.send(batch)

    def submit(self, call: PendingCall[R]) -> Future[R]:
        """Run ``call`` on the least busy node; returns a Future (``call > pool``)."""
        self._check_running()
        call = as_call(call, ">")
        subs = self._prepare([call])
        self._dispatch(subs)
        return subs[0].future

    def run(self, call: PendingCall[R]) -> R:
        """Run ``call`` on the least busy node and return its value (``call >> pool``)."""
        return self.submit(call).result()

    def broadcast(self, call: PendingCall[R]) -> list[R]:
        """Run ``call`` on every node; results in node-rank order (``call @ pool``)."""
        return results(self.submit_broadcast(call))

    def submit_broadcast(
        self, call: PendingCall[R], nodes: Sequence[int] | None = None
    ) -> list[Future[R]]:
        """Run ``call`` on every node (or the ranks in ``nodes``); a Future per process, in
        global rank order (one per node unless a plugin runs several processes per node)."""
        self._check_running()
        call = as_call(call, "@")
        targets = self._nodes if nodes is None else [self._nodes[r] for r in nodes]
        lost = [n.name for n in targets if n.state is not NodeState.READY]
        if lost:
            raise PoolClosedError(f"cannot broadcast: {', '.join(lost)} can no longer take calls")
        key, define = self._function(call.function)
        payload = self._payload(call, key, shared=True)
        ranks = [(node, w) for node in targets for w in range(len(node.busy))]
        subs = [self._submission(call, payload, key, define, pinned=True) for _ in ranks]
        for sub in subs:
            sub.siblings, sub.generation = subs, self._generation
        try:
            for (node, worker), sub in zip(ranks, subs, strict=True):
                sub.worker = worker
                node.send([sub])
        except BaseException:
            for sub in subs:
                if sub.node is None:
                    payload.release()
            raise
        return [s.future for s in subs]

    def cancel(self, futures: Iterable[Future[Any]]) -> None:
        """Stop calls sent to this pool: a running one has its process replaced, a queued
        one is skipped. Their futures raise ``concurrent.futures.CancelledError``."""
        for fut in futures:
            sub = self._by_future.get(id(fut))
            if sub is not None and sub.node is not None and not fut.done():
                sub.node.send_control(Kind.CANCEL, ident=sub.tid)

    def run_many(self, calls: Sequence[PendingCall[Any]]) -> list[Any]:
        """Run different calls in parallel; results in call order."""
        return results(self._submit_many(calls))

    def _submit_many(self, calls: Sequence[PendingCall[Any]]) -> list[Future[Any]]:
        self._check_running()
        subs = self._prepare([as_call(c, "gather") for c in calls])
        self._dispatch(subs)
        return [s.future for s in subs]

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

    def map(self, fn: Callable[..., R] | Function[..., R], iterable: Iterable[Any]) -> list[R]:
        """``[fn(x) for x in iterable]``, spread over the nodes; results in input order."""
        f = fn if isinstance(fn, Function) else function(fn)
        return self.run_many([f(x) for x in iterable])

    # -- results (loop thread) ---------------------------------------------------------
    def _on_result(self, node: Node, sub: Submission, status: int, body: bytes | bytearray) -> None:
        try:
            value, exc = outcome(node, sub.call.function.name, sub.timeout, status, body)
        except BaseException as e:  # e.g. a result whose type cannot be unpickled here
            value, exc = None, e
        if self._group and status == Status.ERROR and exc is not None and _others_run(sub):
            # the others may wait for this one in a collective, and would wait forever
            what = f"{type(exc).__name__}: {exc}".splitlines()[0]
            cause = f"{node.name}: {sub.call.function.name}(...) raised {what}"
            asyncio.get_running_loop().call_later(
                STRAGGLER_GRACE, self._restart_if_stuck, sub, cause
            )
        if isinstance(exc, WorkerDiedError) and self._retry(sub, exc):
            return
        self._settle(sub, value=value, exc=exc)

    def _restart_if_stuck(self, sub: Submission, cause: str) -> None:
        """Restart the group if calls of ``sub``'s broadcast still run, in the group
        generation they were sent in (loop thread)."""
        if _others_run(sub):
            self._restart_group(cause, sub.generation)

    def _restart_group(self, cause: str, generation: int) -> None:
        """Restart every process of a group pool (see ``_plugins``), once per ``generation``
        of the group: later reports of the same break are ignored (loop thread)."""
        if generation != self._generation or self._state is not PoolState.RUNNING:
            return
        self._generation += 1
        logger.warning("restarting every process of the pool: %s", cause)
        for node in self._nodes:
            if node.state is NodeState.READY:
                node.send_control(Kind.RESTART, ident=self._generation, body=cause.encode())

    def _on_lost(self, node: Node, subs: list[Submission]) -> None:
        err = node.lost_error("was lost while running a call: its agent exited")
        for sub in subs:
            if not self._retry(sub, err):
                self._settle(sub, exc=err)

    def _retry(self, sub: Submission, err: BaseException) -> bool:
        if sub.retries_left <= 0 or self._state is not PoolState.RUNNING:
            return False
        if self._group and sub.siblings:  # alone, it would wait for the others forever
            return False
        sub.retries_left -= 1
        previous = sub.node
        try:
            if sub.pinned and previous is not None:
                target = previous
            else:
                target, sub.worker = self._least_busy(exclude=previous)
            target.send([sub])
        except Exception:
            return False
        return True

    def _settle(
        self, sub: Submission, *, value: Any = None, exc: BaseException | None = None
    ) -> None:
        sub.payload.release()
        self._by_future.pop(id(sub.future), None)
        if sub.future.done():
            return
        if exc is not None:
            sub.future.set_exception(exc)
        else:
            sub.future.set_result(value)


class _PoolEvents(NodeEvents):
    """What a pool's nodes report: start-up progress, includes on request, output."""

    def __init__(self, pool: Compute) -> None:
        self.pool = pool

    def phase(self, node: Node, phase: str) -> None:
        self.pool._console.set_phase(node.rank, phase)

    def building(self, node: Node, info: dict[str, Any]) -> None:
        self.pool._console.set_phase(node.rank, "environment")
        if info.get("need_includes"):
            with node.write_lock:
                node.proc.write(frame(Kind.INCLUDES, 0, self.pool._includes))

    def build_output(self, node: Node, data: bytes) -> None:
        self.pool._console.build_output(node.rank, data)

    def broken(self, node: Node, generation: int, reason: str) -> None:
        self.pool._restart_group(f"{node.name}: {reason}", generation)

    def redact(self, text: str) -> str:
        return redact(text, self.pool._secrets)

    def output(self, node: Node, stream: int, lines: list[str], local_rank: int = 0) -> None:
        sink = self.pool.output_sink
        if sink is None:
            self.pool._console.lines(node.rank, node.global_rank(local_rank), stream, lines)
        else:
            sink(node.rank, stream, lines)

    def state(self, node: Node, stream: int, text: str, local_rank: int = 0) -> None:
        if self.pool.output_sink is None:
            self.pool._console.state(node.rank, node.global_rank(local_rank), stream, text)
        elif self.pool.state_sink is not None:
            self.pool.state_sink(node.rank, stream, text)


def _others_run(sub: Submission) -> bool:
    """True when another call of ``sub``'s broadcast has not finished."""
    return any(s is not sub and not s.future.done() for s in sub.siblings or ())


def _left_operand_error(op: str, other: object) -> TypeError:
    if callable(other):
        name = getattr(other, "__name__", type(other).__name__)
        return TypeError(
            f"`{name}` is a plain function: decorate it with @flotilla.function and call it, "
            f"as in `{name}(...) {op} pool`"
        )
    return TypeError(
        f"the left side of `{op} pool` must be a call of a @flotilla.function, "
        f"not {type(other).__name__}"
    )
