"""``Compute``: a pool of nodes and its lifecycle. What its nodes start with is built by
``startup.py`` (one frozen ``Startup``), its periodic work is ``heartbeat.py``'s, the call
operators are ``calls.py``'s; the calls' dispatch and retry policy is in ``dispatch.py``,
the replacement of lost nodes in ``renew.py``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from enum import Enum
from types import TracebackType
from typing import Any, TypeVar

from .._accelerators import Accelerator, parse_accelerator
from .._collections import activate, deactivate
from .._errors import ConfigurationError, PoolClosedError
from .._image import Image, check_env
from .._providers.base import AgentProcess, Allocation, Options, PoolSpec, Provider
from .._providers.fallback import Fallback, Spec
from .._providers.ledger import sigterm_exits
from .._providers.limits import out_of_files
from .._redaction import redact, redact_exception
from .._volume import Volume, check_volumes
from .._wire.frames import Kind, frame
from .._worker import Worker
from ..events import (
    NodeLost,
    NodeReady,
    NodeReplaced,
    PoolPhase,
)
from ..metrics import DEFAULT, resolve
from . import loop as _loop
from . import shm
from .bringup import Bringup
from .calls import PoolCalls
from .collections import PoolCollections
from .console import Console
from .dispatch import Dispatcher
from .elastic import Elastic, Nodes
from .function import count_open_pools
from .health import HealthLoop
from .heartbeat import Heartbeat
from .interpreter import check_image
from .node import Node, NodeEvents, NodeState, Submission
from .observe import Observed, Observer
from .renew import Renewals
from .skyward_settings import named_pool, pool_provider, worker_of
from .startup import (
    VOLUME_FLUSH_TIMEOUT,
    Startup,
    check_plugins,
    for_chosen,
    prepare,
    procs_per_node,
    resource,
)
from .store import Store, encode_answer

logger = logging.getLogger("flotilla")
R = TypeVar("R")


class PoolState(Enum):
    """Lifecycle of a pool::

    NEW --enter--> STARTING --all nodes ready--> RUNNING --exit--> CLOSING --> CLOSED
    STARTING --failure / Ctrl-C--> CLOSING --> CLOSED

    A pool stays RUNNING while a lost node is replaced (see ``renew.py``).
    """

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class Compute(PoolCollections, PoolCalls, Observed):
    """A pool of nodes. Use it as a context manager; leaving the block stops everything.

    Args:
        provider: where the nodes run; None means ``flotilla.Local()`` (local processes);
            a list of providers: fallback, see ``allocation``; or :class:`Spec` s, each a
            candidate with its own resources (``Compute(Spec(...), Spec(...))``).
        specs: the further :class:`Spec` s, after the first.
        nodes: number of nodes (>= 1; default: the specs' ``nodes``, else 1), or an
            elastic pool, as in Skyward: ``(desired, max)`` or :class:`flotilla.Nodes`
            ``(desired, max=..., min=...)`` (``min=0``: scale to zero; ``desired=0``:
            lazy start; see ``elastic.py``; every built-in provider).
        accelerator: accelerators per node: "A100", "A100:8" or ``accelerators.A100(8)``.
        image: the node environment (an ``Image``); None for the provider's default.
        plugins: framework plugins (``plugins.torch()``...), applied in order.
        options: :class:`Options` (cluster/standalone mode, timeouts, env).
        vcpus: CPUs wanted per node (None: the provider's default). Providers act on it:
            the local one checks this machine has them, SLURM asks for
            ``--cpus-per-task``, AWS picks an instance type that has them.
        memory_gb: memory wanted per node in GiB (None: the provider's default), acted on
            as ``vcpus`` is (SLURM: ``--mem``).
        volumes: :class:`Volume` s: buckets whose objects appear at a path on every node
            before the functions run (checked before anything is provisioned).
        ttl: Skyward's: the pool's budget in seconds, after which its machines end
            themselves (None or 0: the provider's own). Given to the provider's setting of
            that meaning: AWS ``ttl`` (an instance powers off ``ttl`` s after the client's
            last word), SLURM ``time`` (the job's time limit). Local and SSH nodes already
            end with their client.
        allocation: Skyward's ``"spot"``, ``"on-demand"`` or ``"spot-if-available"``: the
            provider's ``allocation`` setting (AWS; every candidate's with a list of
            providers); providers that rent nothing (local, SSH, SLURM) accept any of them.
            With a list of providers (``provider=[VastAI(), AWS(...)]``, tried in turn until
            one starts the pool) also ``"ordered"`` (the default: in the order given) or
            ``"cheapest"`` (cheapest first, by their offers).
        worker: :class:`Worker`: task slots per node (default: ``Options.worker``, else
            one).
        max_hourly_cost: the most the POOL may cost per hour, in USD (all its nodes): a
            provider that knows its prices (Vast, AWS when priced) refuses offers above it
            before renting.
        max_node_hourly_cost: the most ONE NODE may cost per hour, in USD (Skyward's
            ``Spec(max_hourly_cost=)``). selection, region, disk_gb, architecture:
            Skyward's, see ``docs/providers.md`` ("Skyward's spelling") and :class:`Spec`.
        metrics: Skyward's: the metrics every node samples (``flotilla.metrics``: a list
            of ``Metric``); not given: the Image's, else ``metrics.Default()``; None:
            none. Read them with :meth:`metrics`, :meth:`view`, :meth:`subscribe`.
        name: Skyward's named pool: a pool of the configuration files (``pools:`` in
            ``~/.flotilla/config.yaml`` or the project's ``.flotilla.yaml``, see
            docs/providers.md) gives the provider and the arguments above not given here
            (``nodes`` not given takes the pool's).

    Send calls with the operators ``call >> pool`` (one node), ``call @ pool`` (every node),
    ``call > pool`` (a Future), ``(a & b) >> pool`` / ``gather(...) >> pool`` (in parallel),
    or with :meth:`map`.
    """

    def __init__(
        self,
        provider: Provider | Sequence[Provider] | Spec | None = None,
        *specs: Spec,
        nodes: int | tuple[int, int] | Nodes | None = None,
        accelerator: str | Accelerator | None = None,
        image: Any = None,
        plugins: Sequence[Any] = (),
        options: Options | None = None,
        vcpus: float | None = None,
        memory_gb: float | None = None,
        volumes: Sequence[Volume] = (),
        ttl: float | None = None,
        allocation: str | None = None,
        worker: Worker | None = None,
        max_hourly_cost: float | None = None,
        max_node_hourly_cost: float | None = None,
        selection: str | None = None,
        region: str | None = None,
        disk_gb: float | None = None,
        architecture: str | None = None,
        metrics: Any = DEFAULT,
        name: str | None = None,
    ) -> None:
        if name is not None:  # Skyward's named pool, from the configuration files
            given = named_pool(name, dict(locals()))
            provider, nodes, accelerator, image, vcpus, memory_gb, ttl = given[:7]
            allocation, max_hourly_cost = given[7:]
        placement = (region, disk_gb, architecture)
        provider, spec_nodes = pool_provider(provider, specs, ttl, allocation, selection, placement)
        size = Nodes.of(nodes if nodes is not None else spec_nodes or 1)
        self.ttl = ttl
        self.allocation = allocation
        if options is None:
            options = Options()
        elif not isinstance(options, Options):
            raise ConfigurationError(
                f"options must be a flotilla.Options, got {type(options).__name__}"
            )
        self.provider = provider
        self.size = size
        """The pool's size: :class:`Nodes` (``desired``, ``min``, ``max``)."""
        self.accelerator = parse_accelerator(accelerator)
        if isinstance(image, Image):
            check_image(image)  # before anything is provisioned
        self.image = image
        self.plugins = tuple(plugins)
        self.options = options
        check_env(options.env, "Options.env")
        self.vcpus = resource("vcpus", vcpus, "CPUs per node, e.g. vcpus=4")
        self.memory_gb = resource("memory_gb", memory_gb, "GiB per node, e.g. memory_gb=16")
        from .._providers.local import Local

        self.volumes = check_volumes(volumes, this_machine=isinstance(provider, Local))
        self.max_hourly_cost = resource(
            "max_hourly_cost", max_hourly_cost, "USD per hour for the pool, e.g. 10"
        )
        self.max_node_hourly_cost = resource(
            "max_node_hourly_cost", max_node_hourly_cost, "USD per hour for one node, e.g. 2"
        )
        self.pool_id = secrets.token_hex(4)
        self.metrics_config = resolve(
            metrics, image.metrics if isinstance(image, Image) else DEFAULT
        )
        """The metrics the nodes sample (``flotilla.metrics``)."""
        self._observer = Observer(self.pool_id)
        check_plugins(self.plugins, options)
        self.procs_per_node = procs_per_node(self.plugins, self.accelerator)
        """Processes per node (:func:`procs_per_node`)."""
        self.worker = worker_of(worker, options, self.procs_per_node)
        """Task slots per node: a broadcast runs on ``procs_per_node`` of them."""
        self._group = (
            options.cluster
            and size.most * self.procs_per_node > 1
            and any(getattr(p, "forms_group", False) for p in self.plugins)
        )
        """The pool's processes form one group: they are restarted together (see _plugins)."""
        self._state = PoolState.NEW
        self._allocation: Allocation | None = None
        self._shm_prefix = shm.pool_prefix(self.pool_id)
        self._bringup = Bringup(options, self._group, self._new_node)
        self._dispatcher = Dispatcher(
            self._group,
            self.procs_per_node,
            self._shm_prefix,
            running=lambda: self._state is PoolState.RUNNING,
            replacer=self._replace if options.replace_lost_nodes else None,
        )
        self._renewals = Renewals(self._dispatcher, self._bringup, self._replaced)
        self._elastic = (
            Elastic(
                size,
                self._dispatcher,
                self._bringup,
                options.autoscale_idle_timeout,
                options.autoscale_cooldown,
                self.workers_per_node,
                self._observer,
            )
            if size.elastic
            else None
        )
        self._heartbeat: asyncio.Task[None] | None = None
        self._health: HealthLoop | None = None  # Options.health_checker's checks
        self._lost_at: dict[int, float] = {}  # rank -> when its node was lost (monotonic)
        self.listed = True
        """Whether ``flotilla top`` lists this pool (a CLI cluster's is listed as the
        cluster)."""
        self._beat = Heartbeat(self)  # pings, live stats, `flotilla top` (heartbeat.py)
        self._store = Store()  # the distributed collections (_collections.py)
        self._pool_hooks = contextlib.ExitStack()  # the plugins' around_pool contexts
        self._includes = b""
        self._built = False  # a node built an environment (see _close)
        self._secrets: list[str] = []
        self.output_sink: Callable[[int, int, list[str]], None] | None = None
        """Receives (node rank, stream, lines) instead of printing them, when set."""
        self.state_sink: Callable[[int, int, str], None] | None = None
        """With ``output_sink``: receives (node rank, stream, what a line redrawn with
        ``\\r`` shows now: a progress bar), instead of drawing it."""
        self.on_replaced: Callable[[list[int]], None] | None = None
        """Called with the ranks whose nodes were replaced, once the new ones serve (on the
        pool's event loop: it must not block)."""

    def keep_agents(self, grace: float, key: str) -> None:
        """A named cluster's pool (its daemon's): when this client dies, its agents wait
        ``grace`` seconds for a new client proving it holds ``key`` (hex) before they end
        (``_node/reattach.py``). Before :meth:`open`; a pool without it ends its agents
        with its client."""
        self._bringup.reattach = (grace, key)

    @property
    def reattach_grace(self) -> float:
        """Seconds the agents wait for a new client once this one is gone (0: none, see
        :meth:`keep_agents`)."""
        return self._bringup.reattach[0] if self._bringup.reattach is not None else 0.0

    def __repr__(self) -> str:
        return f"<flotilla.Compute {self.provider!r} nodes={self.nodes} {self._state.value}>"

    @property
    def nodes(self) -> int:
        """How many nodes the pool has (an elastic one's changes; before it starts: the
        nodes it asks for)."""
        if self._state is PoolState.NEW:
            return self.size.desired
        return len(self._dispatcher.nodes)

    @property
    def state(self) -> PoolState:
        return self._state

    @property
    def _console(self) -> Console:
        return self._bringup.console

    @property
    def _procs(self) -> list[AgentProcess]:
        """Every agent the pool started."""
        return self._bringup.procs

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> Compute:
        self.open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.close()
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            _quiet_interrupt()

    def open(self) -> Compute:
        """Start the pool (what entering the ``with`` block does)."""
        if self._state is not PoolState.NEW:
            raise PoolClosedError("a Compute pool can be started once; create a new Compute")
        image = self.image if self.image is not None else Image()
        if not isinstance(image, Image):
            raise ConfigurationError(f"image must be a flotilla.Image, got {type(image).__name__}")
        self._phase("starting")
        spec, startup = prepare(self, image)  # every check: before anything is provisioned
        self._includes = startup.includes
        self._secrets = list(startup.secrets)
        self._dispatcher.secrets = self._secrets  # redacted from errors and restart causes
        self._state = PoolState.STARTING
        loop = _loop.get_loop()
        fut = asyncio.run_coroutine_threadsafe(self._start(spec, startup), loop)
        try:
            with sigterm_exits():  # what is being created is given back first (ledger)
                _loop.wait(fut)  # (a Ctrl-C another thread received is raised here too)
        except BaseException as e:
            fut.cancel()
            self.close()
            translated = out_of_files(e)  # EMFILE anywhere in the start: with the advice
            if translated is not None:
                raise translated from e
            clean = redact_exception(e, self._secrets)  # agents' stderr tails and such
            if clean is e:
                raise
            raise clean from None
        self._state = PoolState.RUNNING
        count_open_pools(+1)
        checker = self.options.health_checker
        if checker is not None:  # every node passes its check before the first call
            self._health = HealthLoop(self, checker)
            self._renewals.gate = self._health.gate  # and every replacement's nodes
            self._health.start()
            try:
                self._health.wait_healthy(self.options.start_timeout)
            except BaseException:
                self.close()
                raise
        self._phase("running")
        activate(self._store if self.options.cluster else None, self.pool_id)
        try:
            for p in self.plugins:
                hook = getattr(p, "around_pool", None)
                cm = hook(self) if hook is not None else None
                if cm is not None:
                    self._pool_hooks.enter_context(cm)
        except BaseException:
            self.close()
            raise
        return self

    async def _start(self, spec: PoolSpec, startup: Startup) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, shm.sweep)  # what killed clients left
        self._bringup.console = Console(self._secrets)
        if self._elastic is not None:
            await self._start_elastic(spec, startup, self._elastic)
            return
        allocation, procs = await self.provider.start(spec)
        self._use(allocation)
        startup = for_chosen(startup, getattr(self.provider, "chosen", None))
        self._bringup.begin(dataclasses.replace(startup, delivered=allocation.delivered_env))
        self._console.begin(range(len(procs)))
        started = time.monotonic()
        nodes = self._bringup.nodes(range(len(procs)), procs)
        self._dispatcher.nodes[:] = nodes
        self._heartbeat = loop.create_task(self._beat.run())  # builds may take a while
        await self._bringup.bring_up(nodes, nodes)
        self._console.end(f"{len(nodes)} node(s) ready in {time.monotonic() - started:.1f} s")
        self._ready(nodes)

    async def _start_elastic(self, spec: PoolSpec, startup: Startup, elastic: Elastic) -> None:
        """An elastic pool: its machines are added one by one (``elastic.py``)."""
        allocation = await self.provider.acquire(dataclasses.replace(spec, nodes=0))
        self._use(allocation)
        self._bringup.begin(for_chosen(startup, getattr(self.provider, "chosen", None)))
        if isinstance(self.provider, Fallback):  # grows on one candidate of the list
            elastic.move = lambda old: _move(self, old, dataclasses.replace(spec, nodes=0), startup)
        await _price_cap(self, elastic, spec)
        started = time.monotonic()
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat.run())
        if not self.size.least:  # lazy start (desired=0), or scale to zero: nothing to wait for
            await elastic.open(allocation, self.options.start_timeout)
            if not self.size.start:
                self._console.say(
                    f"the pool is empty: its first call starts nodes (up to {elastic.cap})"
                )
            return
        self._console.begin(range(self.size.least))
        await elastic.open(allocation, self.options.start_timeout)
        self._console.end(f"{self.nodes} node(s) ready in {time.monotonic() - started:.1f} s")
        self._ready(self._nodes)

    def _use(self, allocation: Allocation) -> None:
        self._allocation = allocation
        allocation.watch(self._renewals.provider_lost)
        self._renewals.allocation = allocation

    def _new_node(self, rank: int, proc: AgentProcess) -> Node:
        d = self._dispatcher
        node = Node(rank, proc, d.on_result, d.recovery.on_lost, _PoolEvents(self))
        node.write_limit = self.options.heartbeat_timeout
        return node

    def _replace(self, rank: int, why: str) -> list[int]:
        """The node at ``rank`` is lost: replace it (see ``renew.py``); the ranks down."""
        return self._renewals.begin(rank, why)

    def _ready(self, nodes: Sequence[Node]) -> None:
        for node in nodes:
            self._observer.emit(
                NodeReady(
                    pool=self.pool_id,
                    node=node.rank,
                    address=node.proc.address,
                    host=node.proc.host,
                )
            )

    def _phase(self, phase: str) -> None:
        self._observer.emit(PoolPhase(pool=self.pool_id, phase=phase))

    def _replaced(self, ranks: list[int]) -> None:
        nodes = self._nodes
        self._ready([nodes[r] for r in ranks if r < len(nodes)])
        for r in ranks:
            lost = self._lost_at.pop(r, None)
            if lost is not None:
                self._observer.emit(
                    NodeReplaced(pool=self.pool_id, node=r, seconds=time.monotonic() - lost)
                )
        if self.on_replaced is not None:
            self.on_replaced(ranks)

    def close(self) -> None:
        """Stop every node and release everything the pool started. Idempotent."""
        self._console.close()
        if self._health is not None:
            self._health.stop()
        if self._state in (PoolState.CLOSED, PoolState.NEW):
            self._state = PoolState.CLOSED
            return
        if self._state is PoolState.RUNNING:
            count_open_pools(-1)
            deactivate(self.pool_id)
            try:
                self._pool_hooks.close()  # plugins' client side (around_pool) first
            except Exception as e:  # the pool closes all the same
                logger.warning("a plugin's around_pool failed to exit: %s", e)
        self._state = PoolState.CLOSING
        self._phase("closing")
        try:
            _loop.run(self._close())
        finally:
            self._state = PoolState.CLOSED
            self._phase("closed")

    async def _close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        self._beat.close()  # (after the heartbeat, which writes its listing, stopped)
        if self._elastic is not None:  # it stops growing (agents being started stop)
            await self._elastic.close()
        await self._renewals.cancel()  # a replacement under way stops (its agent with it)
        loop = asyncio.get_running_loop()
        for node in self._nodes:
            live = node.state is NodeState.READY or node.state is NodeState.CONFIGURING
            if live and not node.send_control(Kind.SHUTDOWN, wait=False):
                # not on the loop: another thread's send to a frozen agent may hold the lock
                loop.run_in_executor(None, node.send_control, Kind.SHUTDOWN)
            node.state = NodeState.CLOSED
        grace = self.options.shutdown_grace + 0.5
        if self._built:  # an agent stopping a build waits for it to remove its folder
            from .._wire.protocol import BUILD_STOP_GRACE

            grace += BUILD_STOP_GRACE
        if any(not v.read_only for v in self.volumes):  # the agents write back, then exit
            grace += VOLUME_FLUSH_TIMEOUT
        await asyncio.gather(*(p.wait(grace) for p in self._procs))
        for node in self._nodes:
            node.abandoned = True  # a send still waiting for its agent ends
        await asyncio.gather(*(p.terminate() for p in self._procs), return_exceptions=True)
        if self._allocation is not None:
            await self._allocation.release()
        for node in self._nodes:
            node.flush_output()
        self._console.close()  # the lines just flushed ended their bars
        self._dispatcher.close(lambda where: PoolClosedError(f"the pool closed before {where}"))
        shm.remove_pool_files(self._shm_prefix)
        self._store.close()

    # -- dispatch (see dispatch.py) ------------------------------------------------------
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

    def current_nodes(self) -> int:
        """The nodes serving now (Skyward's ``current_nodes()``): an elastic pool's
        changes as it grows and shrinks (0 when it scaled to zero, or before it starts)."""
        if self._state is not PoolState.RUNNING:
            return 0
        return len(self._dispatcher.nodes)

    @property
    def workers_per_node(self) -> int:
        """Task slots per node (``Worker(concurrency=...)``, or a plugin's processes)."""
        return max(self.procs_per_node, self.worker.concurrency)


def _quiet_interrupt() -> None:
    """Ctrl-C left a pool's block (the pool is closed): if nothing catches it, say so in a
    line instead of a traceback through flotilla's and the standard library's waits. The
    program still ends as an interrupted one (killed by SIGINT: status 130 in a shell)."""
    previous = sys.excepthook
    if getattr(previous, "flotilla", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.stderr.write("flotilla: interrupted (Ctrl-C); the pool was closed\n")
            return
        previous(kind, value, tb)

    hook.flotilla = True  # type: ignore[attr-defined]
    sys.excepthook = hook


async def _move(
    pool: Compute, old: Allocation, spec: PoolSpec, start: Startup
) -> Allocation | None:
    """An empty elastic pool over a provider list whose candidate has no node: the next
    candidate's allocation (``Fallback.acquire_next``), the old one released."""
    assert isinstance(pool.provider, Fallback)
    new = await pool.provider.acquire_next(spec)
    if new is not None:
        pool._use(new)
        pool._bringup.begin(for_chosen(start, pool.provider.chosen))
        await old.release()
        if pool._elastic is not None:
            await _price_cap(pool, pool._elastic, spec)
    return new


async def _price_cap(pool: Compute, elastic: Elastic, spec: PoolSpec) -> None:
    """The autoscaler grows no further than ``max_hourly_cost`` buys at the price of a node
    where the pool is: its provider, or the chosen candidate of a provider list (not the
    cheapest offer across the list)."""
    if pool.max_hourly_cost is None:
        return
    on = getattr(pool.provider, "chosen", None) or pool.provider
    offers = await asyncio.get_running_loop().run_in_executor(None, on.offers, spec)
    prices = [o.hourly for o in offers or [] if o.hourly is not None]
    elastic.price_cap(min(prices) if prices else None, pool.max_hourly_cost)


class _PoolEvents(NodeEvents):
    """What a pool's nodes report: start-up progress, includes on request, output."""

    def __init__(self, pool: Compute) -> None:
        self.pool = pool

    def phase(self, node: Node, phase: str) -> None:
        self.pool._console.set_phase(node.rank, phase)

    def building(self, node: Node, info: dict[str, Any]) -> None:
        self.pool._built = True
        self.pool._console.set_phase(node.rank, "environment")
        if info.get("need_includes"):
            with node.write_lock:
                node.proc.write(frame(Kind.INCLUDES, 0, self.pool._includes), node.give_up)

    def build_output(self, node: Node, data: bytes) -> None:
        self.pool._console.build_output(node.rank, data)

    def broken(self, node: Node, generation: int, reason: str) -> None:
        self.pool._dispatcher.recovery.restart_group(f"{node.name}: {reason}", generation)

    def redact(self, text: str) -> str:
        return redact(text, self.pool._secrets)

    def store(self, node: Node, ident: int, body: bytes | bytearray) -> None:
        def reply(answer: tuple[Any, ...]) -> None:
            if ident:  # 0: the agent's own word (a process ended), which wants no answer
                node.send_control(Kind.STORED, ident=ident, body=encode_answer(answer))

        self.pool._store.submit(node.rank, bytes(body), reply)

    def lost(self, node: Node) -> None:
        self.pool._store.forget(node.rank)
        if self.pool._state is PoolState.RUNNING or self.pool._state is PoolState.STARTING:
            self.pool._lost_at[node.rank] = time.monotonic()
            why = self.redact(node.loss)
            self.pool._observer.emit(NodeLost(pool=self.pool.pool_id, node=node.rank, why=why))

    def task_started(self, node: Node, sub: Submission) -> None:
        self.pool._observer.started(node.rank, sub)

    def task_finished(
        self, node: Node, sub: Submission, status: int, body: bytes | bytearray
    ) -> None:
        self.pool._observer.finished(node.rank, sub, status, body)

    def metrics(self, node: Node, body: dict[str, Any]) -> None:
        pool = self.pool
        if "error" in body:  # a metric that cannot be sampled there: said once
            name, why = body["error"]
            body["error"] = [name, self.redact(str(why))]  # (what a command printed)
            pool._console.say(f"node {node.rank}: metric {name!r} is off: {body['error'][1]}")
        pool._observer.samples(node.rank, body, pool.pool_id)

    def output(self, node: Node, stream: int, lines: list[str], local_rank: int = 0) -> None:
        if self.pool._secrets:  # the one point task output passes, to console or sink
            lines = [redact(line, self.pool._secrets) for line in lines]
        if self.pool._observer.logging:
            self.pool._observer.lines(node.rank, node.global_rank(local_rank), stream, lines)
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
