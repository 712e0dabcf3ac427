"""``Compute``: a pool of nodes and its lifecycle; the calls' dispatch and retry policy is
in ``dispatch.py``, the replacement of lost nodes in ``renew.py``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, as_completed
from enum import Enum
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

from .._accelerators import Accelerator, parse_accelerator
from .._collections import activate, deactivate
from .._errors import ConfigurationError, PoolClosedError, SerializationError, check_number
from .._image import Image, check_env, ship_user_modules
from .._providers.base import AgentProcess, Allocation, Options, PoolSpec, Provider
from .._providers.ledger import sigterm_exits
from .._providers.limits import ensure_open_files, out_of_files
from .._redaction import plain_env, plugin_secrets, redact, redact_exception, secret_values
from .._volume import Volume, check_volumes, node_spec
from .._wire.bodies import Config
from .._wire.frames import Kind, frame
from .._wire.serialize import pickle_obj
from .._worker import Worker
from ..events import (
    Event,
    LogLine,
    NodeLost,
    NodeReady,
    NodeReplaced,
    PoolPhase,
    PoolView,
    Scaling,
    view_dict,
)
from ..metrics import DEFAULT, Metric, resolve, specs
from . import feeds, shm
from . import loop as _loop
from .bringup import Bringup
from .collections import PoolCollections
from .console import Console
from .dispatch import Dispatcher
from .elastic import Elastic, Nodes
from .function import Function, PendingCall, Pool, as_call, count_open_pools, function
from .futures import Batch
from .health import HealthLoop
from .interpreter import Policy, check_image
from .listing import Listing
from .node import Node, NodeEvents, NodeState, Submission
from .observe import Observer, stat_rows
from .outcome import results
from .renew import Renewals
from .skyward_settings import with_pool_settings, worker_of
from .store import Store, encode_answer
from .stream import Stream, Values, yields

logger = logging.getLogger("flotilla")
VOLUME_FLUSH_TIMEOUT = 300.0
"""Seconds a node's agent waits, at the end, for its writable volumes to be written back
(the client waits as long for the agents to exit)."""
SEND_CHUNK = 256
"""Calls of a batch (``gather``) sent at a time: the nodes start on the first ones while
the next are prepared, and a node slow to read does not keep the others waiting."""
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


class Compute(PoolCollections, Pool):
    """A pool of nodes. Use it as a context manager; leaving the block stops everything.

    Args:
        provider: where the nodes run; None means ``flotilla.Local()`` (local processes);
            a list of providers: fallback, see ``allocation``.
        nodes: number of nodes (>= 1), or an elastic pool, as in Skyward: ``(desired,
            max)`` or :class:`flotilla.Nodes` ``(desired, max=..., min=...)`` (``min=0``:
            scale to zero; ``desired=0``: lazy start; see ``elastic.py``; Local, SSH,
            Container and Kubernetes providers).
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
        max_hourly_cost: the most the pool may cost per hour, in USD (all its nodes): a
            provider that knows its prices (Vast, AWS when priced) refuses offers above it
            before renting.
        metrics: Skyward's: the metrics every node samples (``flotilla.metrics``: a list
            of ``Metric``); not given: the Image's, else ``metrics.Default()``; None:
            none. Read them with :meth:`metrics`, :meth:`view`, :meth:`subscribe`.

    Send calls with the operators ``call >> pool`` (one node), ``call @ pool`` (every node),
    ``call > pool`` (a Future), ``(a & b) >> pool`` / ``gather(...) >> pool`` (in parallel),
    or with :meth:`map`.
    """

    def __init__(
        self,
        provider: Provider | Sequence[Provider] | None = None,
        nodes: int | tuple[int, int] | Nodes = 1,
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
        *,
        max_hourly_cost: float | None = None,
        metrics: Any = DEFAULT,
    ) -> None:
        size = Nodes.of(nodes)
        if provider is None:
            from .._providers.local import Local

            provider = Local()
        provider = with_pool_settings(provider, ttl, allocation)
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
        self.vcpus = _resource("vcpus", vcpus, "CPUs per node, e.g. vcpus=4")
        self.memory_gb = _resource("memory_gb", memory_gb, "GiB per node, e.g. memory_gb=16")
        from .._providers.local import Local

        self.volumes = check_volumes(volumes, this_machine=isinstance(provider, Local))
        self._volume_spec: dict[str, Any] | None = None
        self.max_hourly_cost = _resource(
            "max_hourly_cost", max_hourly_cost, "USD per hour for the pool, e.g. 10"
        )
        self.pool_id = secrets.token_hex(4)
        self.metrics_config = resolve(
            metrics, image.metrics if isinstance(image, Image) else DEFAULT
        )
        """The metrics the nodes sample (``flotilla.metrics``)."""
        self._observer = Observer(self.pool_id)
        self._check_plugins()
        per_accelerator = self.accelerator.whole if self.accelerator is not None else 1
        self.procs_per_node = max(
            [
                per_accelerator if n is None else int(n)
                for n in (getattr(p, "procs_per_node", 1) for p in self.plugins)
            ]
            + [1]
        )
        """Processes per node: what a plugin asks (``plugins.torch(procs_per_node=2)``;
        None: one per accelerator)."""
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
        self._bringup = Bringup(
            self.pool_id,
            options,
            self.accelerator,
            self.procs_per_node,
            self._group,
            provider.home,
            self._shm_prefix,
            self._new_node,
        )
        self._dispatcher = Dispatcher(
            self._group,
            self.procs_per_node,
            self._shm_prefix,
            running=lambda: self._state is PoolState.RUNNING,
            replacer=self._replace if options.replace_lost_nodes else None,
        )
        self._bringup.workers = self.workers_per_node
        self._bringup.threads = self.worker.resolved_executor == "thread"  # (one process)
        self._renewals = Renewals(self._dispatcher, self._bringup, self._replaced)
        self._bringup.observe = _observe_config(self.metrics_config, provider)
        self._elastic = (
            Elastic(
                size,
                self._dispatcher,
                self._bringup,
                options.autoscale_idle_timeout,
                options.autoscale_cooldown,
                self.workers_per_node,
            )
            if size.elastic
            else None
        )
        self._heartbeat: asyncio.Task[None] | None = None
        self._health: HealthLoop | None = None  # Options.health_checker's checks
        self._lost_at: dict[int, float] = {}  # rank -> when its node was lost (monotonic)
        self._listing: Listing | None = None  # its entry for `flotilla top` (listing.py)
        self.listed = True
        """Whether ``flotilla top`` lists this pool (a CLI cluster's is listed as the
        cluster)."""
        self._busy_since = self._stats_due = 0.0  # the live rows of metrics (_live_stats)
        self._size_seen = 0  # an elastic pool's size, as last reported (Scaling)
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

    def _check_plugins(self) -> None:
        for p in self.plugins:
            if not (hasattr(p, "around_process") or hasattr(p, "transform")):
                raise ConfigurationError(
                    f"{p!r} is not a flotilla plugin (it has neither transform nor around_process)"
                )
            check = getattr(p, "check_plugins", None)
            if check is not None:  # a plugin that refuses some others (ray: torch)
                check(self.plugins)
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
    def _nodes(self) -> list[Node]:
        """The current node at each rank."""
        return self._dispatcher.nodes

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

    def _spec(self, image: Image) -> PoolSpec:
        return PoolSpec(
            self.pool_id,
            self.size.desired,
            self.accelerator,
            image,
            self.plugins,
            self.options,
            vcpus=self.vcpus,
            memory_gb=self.memory_gb,
            max_nodes=self.size.most if self.size.elastic else 0,
            max_hourly_cost=self.max_hourly_cost,
        )

    def open(self) -> Compute:
        """Start the pool (what entering the ``with`` block does)."""
        if self._state is not PoolState.NEW:
            raise PoolClosedError("a Compute pool can be started once; create a new Compute")
        image = self.image if self.image is not None else Image()
        if not isinstance(image, Image):
            raise ConfigurationError(f"image must be a flotilla.Image, got {type(image).__name__}")
        self._phase("starting")
        spec = self._spec(image)
        if self.size.elastic and not self.provider.elastic:
            raise ConfigurationError(
                f"nodes={self.size}: the {self.provider.name} provider has fixed-size pools "
                "only (elastic pools: Local, SSH, Container and Kubernetes); "
                "pass a number of nodes"
            )
        acc = spec.accelerator
        if (
            acc is not None
            and acc.fractional
            and not getattr(self.provider, "fractional_accelerators", False)
        ):
            raise ConfigurationError(
                f"accelerator {acc} is a fraction of one; "
                f"{type(self.provider).__name__} has no fractional accelerators (none "
                "of flotilla's providers has yet: Skyward's are AWS g6f and Vultr "
                "slices); ask for a whole one, or use plugins.mig() to partition one"
            )
        self.provider.validate(spec)
        # every provider: three pipes per node here
        ensure_open_files(self.size.most, str(getattr(self.provider, "name", "")))
        volume_secrets: list[str] = []
        if self.volumes:  # the buckets can be read: before anything is provisioned
            from .._providers.local import Local

            this_machine = isinstance(self.provider, Local)
            self._volume_spec, volume_secrets = node_spec(self.volumes, this_machine)
            self._volume_spec["flush_timeout"] = VOLUME_FLUSH_TIMEOUT
            self._bringup.volumes = self._volume_spec
        for p in self.plugins:
            hook = getattr(p, "transform", None)
            if hook is not None:
                image = hook(image, spec)
                if not isinstance(image, Image):
                    raise ConfigurationError(f"plugin {p!r}: transform() must return an Image")
        check_image(image)  # a plugin's too
        spec = self._spec(image)
        self._bringup.python = Policy.of(self.provider, image)
        try:
            blob = pickle_obj(list(self.plugins)).main if self.plugins else b""
        except Exception as e:
            raise SerializationError(f"the pool's plugins cannot be pickled: {e}") from e
        if not self.provider.shares_filesystem:
            ship_user_modules()
        self._includes = image.includes_archive()
        self._bringup.build_spec = image.build_spec(self._includes) if image.needs_build else None
        self._bringup.env = {**plain_env(image.env), **plain_env(self.options.env)}
        self._secrets = (
            secret_values(image.env)
            + secret_values(self.options.env)
            + plugin_secrets(self.plugins)
            + volume_secrets
        )
        self._dispatcher.secrets = self._secrets  # redacted from errors and restart causes
        self._state = PoolState.STARTING
        loop = _loop.get_loop()
        fut = asyncio.run_coroutine_threadsafe(self._start(spec, blob), loop)
        try:
            with sigterm_exits():  # what is being created is given back first (ledger)
                fut.result()
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

    async def _start(self, spec: PoolSpec, blob: bytes) -> None:
        loop = asyncio.get_running_loop()
        self._bringup.blob = blob
        await loop.run_in_executor(None, shm.sweep)  # what killed clients left
        self._bringup.console = Console(self._secrets)
        if self._elastic is not None:
            await self._start_elastic(spec, self._elastic)
            return
        self._allocation, procs = await self.provider.start(spec)
        chosen = getattr(self.provider, "chosen", None)
        if isinstance(chosen, Provider):  # a fallback's: its home and interpreter policy
            self._bringup.home = chosen.home
            self._bringup.python = dataclasses.replace(
                self._bringup.python,
                pinned=chosen.python_pinned,
                home=str(chosen.home),
                provider=type(chosen).__name__,
            )
        self._allocation.watch(self._renewals.provider_lost)
        self._renewals.allocation = self._allocation
        self._bringup.delivered = self._allocation.delivered_env
        self._console.begin(range(len(procs)))
        started = time.monotonic()
        nodes = self._bringup.nodes(range(len(procs)), procs)
        self._dispatcher.nodes[:] = nodes
        self._heartbeat = loop.create_task(self._heartbeats())  # builds may take a while
        await self._bringup.bring_up(nodes, nodes)
        self._console.end(f"{len(nodes)} node(s) ready in {time.monotonic() - started:.1f} s")
        self._ready(nodes)

    async def _start_elastic(self, spec: PoolSpec, elastic: Elastic) -> None:
        """An elastic pool: its machines are added one by one (``elastic.py``)."""
        self._allocation = await self.provider.acquire(dataclasses.replace(spec, nodes=0))
        self._allocation.watch(self._renewals.provider_lost)
        self._renewals.allocation = self._allocation
        if self.max_hourly_cost is not None:  # the autoscaler grows no further than it buys
            offers = await asyncio.get_running_loop().run_in_executor(
                None, self.provider.offers, spec
            )
            elastic.price_cap(offers[0].hourly if offers else None, self.max_hourly_cost)
        started = time.monotonic()
        self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeats())
        if not self.size.least:  # lazy start (desired=0), or scale to zero: nothing to wait for
            await elastic.open(self._allocation, self.options.start_timeout)
            if not self.size.start:
                self._console.say(
                    f"the pool is empty: its first call starts nodes (up to {elastic.cap})"
                )
            return
        self._console.begin(range(self.size.least))
        await elastic.open(self._allocation, self.options.start_timeout)
        self._console.end(f"{self.nodes} node(s) ready in {time.monotonic() - started:.1f} s")
        self._ready(self._nodes)

    def _new_node(self, rank: int, proc: AgentProcess) -> Node:
        d = self._dispatcher
        node = Node(rank, proc, d.on_result, d.on_lost, _PoolEvents(self))
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

    async def _heartbeats(self) -> None:
        """Ping every node (agents exit when the client is silent) and declare lost the
        nodes whose agents went silent (they BEAT every quarter of the timeout). Silence is
        checked every quarter second: a frozen node is found within the timeout + 0.25 s."""
        limit = self.options.heartbeat_timeout
        interval = limit / 4
        tick = min(interval, 0.25)
        last = next_ping = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            nodes = [*self._nodes, *self._renewals.starting]
            if self._elastic is not None:
                nodes += self._elastic.starting
            if now - last > interval:  # this process was stalled, not the nodes
                for node in nodes:
                    node.last_heard = max(node.last_heard, now)
            last = now
            ping = now >= next_ping
            if ping:
                next_ping = now + interval
            for node in nodes:
                if node.state in (NodeState.READY, NodeState.CONFIGURING):
                    if ping:
                        node.send_control(Kind.PING, wait=False)
                    node.check_silence(now, limit)
            self._dispatcher.shm_files.trim(now)  # kept argument files of an idle pool go
            self._live_stats(now)
            self._list(now)
            if self._elastic is not None and len(self._nodes) != self._size_seen:
                self._size_seen = len(self._nodes)
                self._observer.emit(Scaling(pool=self.pool_id, nodes=self._size_seen))
                seen = self._observer.nodes
                with self._observer.lock:  # released nodes leave the view
                    for rank in [r for r in seen if r >= self._size_seen]:
                        del seen[rank]
                self._ready(
                    [
                        n
                        for n in self._nodes
                        if n.state is NodeState.READY
                        and (n.rank not in seen or seen[n.rank].phase != "ready")
                    ]
                )

    def _list(self, now: float) -> None:
        """Keep this pool's entry for ``flotilla top`` (``listing.py``): with metrics on."""
        if self.metrics_config and self.listed and self._state is PoolState.RUNNING:
            if self._listing is None:
                self._listing = Listing(self.pool_id)
            if now >= self._listing.due:
                self._listing.write(now, view_dict(self._observer.view()))

    def _live_stats(self, now: float) -> None:
        """On a terminal, while calls run (for a second or more): a row per node with its
        metrics, redrawn every second (``observe.stat_rows``)."""
        console = self._console
        if not self.metrics_config or not console.live:
            return
        running = any(n.running for n in self._observer.nodes.values())
        if not running:
            self._busy_since = 0.0
            if console.stat_rows:
                console.stats({})
            return
        if not self._busy_since:
            self._busy_since = now
        if now - self._busy_since >= 1.0 and now >= self._stats_due:
            self._stats_due = now + 1.0
            console.stats(stat_rows(self._observer.view()))

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
        if self._listing is not None:  # (after the heartbeat, which writes it, stopped)
            self._listing.remove()
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

    # -- what the pool shows of itself (observe.py) -----------------------------------
    def metrics(self) -> dict[int, dict[str, float]]:
        """The latest sample of every node, by rank: metric name -> value (``cpu`` in
        percent, ``mem_used``/``mem_total`` in bytes..., see ``flotilla.metrics``), and
        ``time``, when it was sampled (``time.time()``). Nodes not sampled yet are
        missing; ``{}`` with ``metrics=None``."""
        return self._observer.metrics()

    def view(self) -> PoolView:
        """A frozen snapshot: the pool's phase, each node's (phase, address, latest
        metrics, calls running/done/failed) and each function's durations and
        throughput."""
        return self._observer.view()

    def subscribe(
        self,
        on_event: Callable[[Event], Any] | None = None,
        on_log: Callable[[LogLine], Any] | None = None,
        on_change: Callable[[PoolView, PoolView], Any] | None = None,
    ) -> Callable[[], None]:
        """Call ``on_event`` with every event of the pool (``flotilla.events``),
        ``on_log`` with every line its tasks print, ``on_change`` with the views
        (old, new) around each change; returns the function that unsubscribes them. A
        callback that raises is reported once and unsubscribed."""
        return self._observer.subscribe(on_event, on_log, on_change)

    # -- operators with something else on the left ---------------------------------------
    def __rrshift__(self, other: object) -> Any:
        raise _left_operand_error(">>", other)

    def __rmatmul__(self, other: object) -> Any:
        raise _left_operand_error("@", other)

    def __lt__(self, other: object) -> Any:  # `other > pool` when other has no __gt__
        raise _left_operand_error(">", other)

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

    def submit(self, call: PendingCall[R]) -> Future[R]:
        """Run ``call`` on the least busy node; returns a Future (``call > pool``)."""
        self._check_running()
        return self._send([as_call(call, ">")])[0].future

    def _send(self, calls: list[PendingCall[Any]], stream: bool = False) -> list[Submission]:
        """Send calls to the least busy slots; their streamed arguments follow
        (``feeds.py``); with ``stream``, ``>>``'s iterator over the values of the one call
        (``stream.py``)."""
        split = [feeds.split(c) for c in calls]
        d = self._dispatcher
        bound = [c for c, _ in split]
        encoded = d.encode(bound)  # a call that cannot be sent fails before any is sent
        batch = Batch(len(calls)) if len(calls) > 1 else None
        subs: list[Submission] = []
        for start in range(0, len(calls), SEND_CHUNK):  # the first calls run meanwhile
            end = start + SEND_CHUNK
            chunk = d.prepare(bound[start:end], encoded[start:end], batch)
            if stream:  # (one call)
                first = chunk[0]
                first.stream = Values(first.future)  # (the iterator: see _stream)
            for sub, (_, sources) in zip(chunk, split[start:end], strict=True):
                if sources:
                    feeds.prepare(sub)
            d.dispatch(chunk)
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
        if yields(call.function.fn):
            return self._stream(call)  # type: ignore[return-value]
        self._check_running()
        sub = self._send([call])[0]
        node, fut = sub.node, sub.future
        dispatcher = self._dispatcher
        if (
            node is not None
            and not fut.done()
            and not dispatcher.group  # a group's results may restart it: the loop's work
            and not dispatcher.most  # an elastic pool's may send backlogged calls: the same
            and not _loop.in_loop_thread()
        ):
            node.wait_direct(fut)
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
        return [s.future for s in self._dispatcher.broadcast(call, ranks, any_slot)]

    def current_nodes(self) -> int:
        """The nodes serving now (Skyward's ``current_nodes()``): an elastic pool's
        changes as it grows and shrinks (0 when it scaled to zero, or before it starts)."""
        if self._state is not PoolState.RUNNING:
            return 0
        return len(self._dispatcher.nodes)

    def resize(self, n: int) -> None:
        """Head for ``n`` nodes now (an elastic pool; within its ``min`` and ``max``):
        nodes are started or released (idle ones only, the last first) in the background;
        :meth:`current_nodes` says how far it got. The autoscaler goes on from there
        (an idle pool shrinks to ``min`` again after ``Options(autoscale_idle_timeout=...)``).
        """
        self._check_running()
        elastic = self._elastic
        if elastic is None or not self.size.auto_scaling:
            raise ConfigurationError(
                f"resize({n!r}): this pool has a fixed size ({self.size}); "
                "an elastic pool has a max: nodes=(desired, max) or Nodes(desired, max=...)"
            )
        if isinstance(n, bool) or not isinstance(n, int) or not elastic.floor <= n <= elastic.cap:
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

    @property
    def workers_per_node(self) -> int:
        """Task slots per node (``Worker(concurrency=...)``, or a plugin's processes)."""
        return max(self.procs_per_node, self.worker.concurrency)

    def map(self, fn: Callable[..., R] | Function[..., R], *iterables: Iterable[Any]) -> list[R]:
        """``list(map(fn, *iterables))``, spread over the nodes; results in input order (with
        several iterables, ``fn`` takes one item of each and the shortest one ends it)."""
        if not iterables:
            raise TypeError("pool.map(fn, items, ...) needs at least one iterable")
        f = fn if isinstance(fn, Function) else function(fn)
        return self.run_many([PendingCall(f, args, {}) for args in zip(*iterables, strict=False)])


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
        self.pool._dispatcher.restart_group(f"{node.name}: {reason}", generation)

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


def _resource(name: str, value: object, example: str) -> float | None:
    """A per-node resource request: None or a positive number (as a float)."""
    if value is None:
        return None
    check_number(value, f"{name} must be a positive number ({example}), got {value!r}", above=0)
    check_number(
        value, f"{name} must be a finite number ({example}), got {value!r}", below=float("inf")
    )
    assert isinstance(value, int | float)
    return float(value)


def _observe_config(metrics: tuple[Metric, ...], provider: Any) -> Config:
    """What CONFIG tells the agents of the metrics (``_node/metrics.py``): their specs and
    where usage is measured: the node's own process tree where the provider's nodes share
    one machine (local processes, containers, pods), else the machine (or its cgroup)."""
    if not metrics:
        return {}
    names = {
        type(p).__name__ for p in (provider if isinstance(provider, list | tuple) else [provider])
    }
    shared = bool(names & {"Local", "Container", "Kubernetes"})
    return {"metrics": specs(metrics), "metrics_scope": "tree" if shared else "host"}
