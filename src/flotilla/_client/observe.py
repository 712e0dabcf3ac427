"""A pool's observer: its nodes' latest metrics, its calls' counts and durations, and the
subscribers of its typed events (``flotilla.events``).

The pool reports what happens (``emit``, and the cheap per-call ``started``/``finished``);
the observer keeps what ``pool.view()`` and ``pool.metrics()`` return, and hands the
events to the callbacks of ``pool.subscribe``. Per call it only counts unless somebody
listens: no event object is made for a call when nobody subscribed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .._wire.frames import Status
from .._wire.serialize import decode
from ..events import (
    Event,
    FunctionStats,
    LogLine,
    MetricFailed,
    MetricSample,
    NodeHealthFailed,
    NodeLost,
    NodeReady,
    NodeView,
    PoolPhase,
    PoolView,
    TaskFinished,
    TaskStarted,
)

if TYPE_CHECKING:
    from .node import Submission

logger = logging.getLogger("flotilla")
_monotonic = time.monotonic

_ERRORS: dict[int, str] = {
    Status.DIED: "WorkerDiedError",
    Status.TIMEOUT: "TaskTimeoutError",
    Status.CANCELLED: "CancelledError",
    Status.ABORTED: "WorkerDiedError",
}


@dataclass(slots=True)
class _Node:
    phase: str = "starting"
    address: str = ""
    host: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    sampled: float = 0.0
    running: int = 0
    done: int = 0
    failed: int = 0
    healthy: bool | None = None


@dataclass(slots=True)
class _Fn:
    name: str
    done: int = 0
    failed: int = 0
    total: float = 0.0
    low: float = float("inf")
    high: float = 0.0
    first: float = 0.0


@dataclass(slots=True)
class _Sub:
    on_event: Callable[[Event], Any] | None
    on_log: Callable[[LogLine], Any] | None
    on_change: Callable[[PoolView, PoolView], Any] | None


OnEvent = Callable[[Event], Any] | None
"""A subscriber's callback for every event of a pool (``flotilla.events``)."""
OnLog = Callable[[LogLine], Any] | None
"""A subscriber's callback for every line a pool's tasks print."""
OnChange = Callable[[PoolView, PoolView], Any] | None
"""A subscriber's callback with the views (old, new) around each change."""


class Observer:
    """What one pool shows of itself (see the module docstring)."""

    def __init__(self, pool_id: str) -> None:
        self.pool_id = pool_id
        self.phase = "new"
        self.nodes: dict[int, _Node] = {}
        self.functions: dict[int, _Fn] = {}  # by the function's key
        self.lock = threading.RLock()
        self.subs: tuple[_Sub, ...] = ()
        self.listening = False  # somebody wants events (per-call ones are made then only)
        self.logging = False  # somebody wants log lines
        self.sinks: list[Callable[[Event], Any]] = []  # flotilla's own (the CLI's log)

    # -- subscribers -----------------------------------------------------------------
    def subscribe(
        self, on_event: OnEvent, on_log: OnLog, on_change: OnChange
    ) -> Callable[[], None]:
        """What ``Compute.subscribe`` does (see :class:`Observed`)."""
        for name, cb in (("on_event", on_event), ("on_log", on_log), ("on_change", on_change)):
            if cb is not None and not callable(cb):
                from .._errors import ConfigurationError

                raise ConfigurationError(f"subscribe({name}=...) must be callable, got {cb!r}")
        sub = _Sub(on_event, on_log, on_change)
        with self.lock:
            self.subs = (*self.subs, sub)
            self._listeners()

        def unsubscribe() -> None:
            with self.lock:
                self.subs = tuple(s for s in self.subs if s is not sub)
                self._listeners()

        return unsubscribe

    def _listeners(self) -> None:
        self.listening = bool(self.sinks) or any(
            s.on_event is not None or s.on_change is not None for s in self.subs
        )
        self.logging = bool(self.sinks) or any(
            s.on_log is not None or s.on_event is not None for s in self.subs
        )

    def add_sink(self, sink: Callable[[Event], Any]) -> None:
        with self.lock:
            self.sinks.append(sink)
            self._listeners()

    def _dispatch(self, event: Event, before: PoolView | None) -> None:
        for sink in self.sinks:
            try:
                sink(event)
            except Exception as e:  # flotilla's own: never breaks the pool
                logger.debug("an event sink failed: %s", e)
        after = None
        for sub in self.subs:
            try:
                if sub.on_event is not None:
                    sub.on_event(event)
                if sub.on_log is not None and isinstance(event, LogLine):
                    sub.on_log(event)
                if sub.on_change is not None and before is not None:
                    if after is None:
                        after = self.view()
                    sub.on_change(before, after)
            except Exception as e:
                with self.lock:
                    self.subs = tuple(s for s in self.subs if s is not sub)
                    self._listeners()
                names = [n for n in ("on_event", "on_log", "on_change") if getattr(sub, n)]
                logger.warning(
                    "a pool.subscribe callback (%s) raised %s: %s; it is unsubscribed",
                    "/".join(names),
                    type(e).__name__,
                    e,
                )

    def emit(self, event: Event) -> None:
        """Apply ``event`` to the pool's state and hand it to the subscribers."""
        with self.lock:
            wants_change = any(s.on_change is not None for s in self.subs)
            before = self.view() if wants_change and not isinstance(event, LogLine) else None
            self._apply(event)
            if self.subs or self.sinks:
                self._dispatch(event, before)

    def _node(self, rank: int) -> _Node:
        node = self.nodes.get(rank)
        if node is None:
            node = self.nodes[rank] = _Node()
        return node

    def _apply(self, event: Event) -> None:
        if isinstance(event, PoolPhase):
            self.phase = event.phase
            if event.phase == "closed":
                for n in self.nodes.values():
                    n.phase = "closed"
        elif isinstance(event, NodeReady):
            n = self._node(event.node)
            n.phase, n.address, n.host = "ready", event.address, event.host
            n.running = 0
        elif isinstance(event, NodeLost):
            n = self._node(event.node)
            n.phase, n.running = "lost", 0
        elif isinstance(event, MetricSample):
            n = self._node(event.node)
            n.metrics.update(event.values)
            n.sampled = event.time
        elif isinstance(event, NodeHealthFailed):
            self._node(event.node).healthy = False

    # -- the pool's reports ----------------------------------------------------------
    def started(self, rank: int, sub: Submission) -> None:
        """A call was given to a process of the node at ``rank`` (per call: cheap)."""
        n = self.nodes.get(rank)
        if n is not None:
            n.running += 1
        if self.listening:
            fn = self._fn(sub, time.monotonic())
            self.emit(TaskStarted(pool=self.pool_id, node=rank, function=fn.name, task=sub.tid))

    def _fn(self, sub: Submission, first: float) -> _Fn:
        fn = self.functions.get(sub.fn_key)
        if fn is None:
            fn = self.functions[sub.fn_key] = _Fn(sub.call.function.name, first=first)
        return fn

    def finished(self, rank: int, sub: Submission, status: int, body: bytes | bytearray) -> None:
        """A call ended (its RESULT came): counted, with its duration from its start on
        the node (0 when it never started there). Per call: a few counters only."""
        started = sub.started_at
        duration = _monotonic() - started if started else 0.0
        fn = self.functions.get(sub.fn_key) or self._fn(sub, started or _monotonic())
        ok = status == 0  # Status.OK (an int compare: per call)
        n = self.nodes.get(rank)
        if ok:
            fn.done += 1
            if n is not None:
                n.done += 1
        else:
            fn.failed += 1
            if n is not None:
                n.failed += 1
        if n is not None and started and n.running > 0:
            n.running -= 1
        fn.total += duration
        if duration > fn.high:
            fn.high = duration
        if duration < fn.low:
            fn.low = duration
        if self.listening:
            self.emit(
                TaskFinished(
                    pool=self.pool_id,
                    node=rank,
                    function=fn.name,
                    task=sub.tid,
                    duration=duration,
                    ok=ok,
                    error=None if ok else _error_type(status, body),
                )
            )

    def samples(self, rank: int, body: dict[str, Any], pool_id: str) -> None:
        """A METRICS frame of the node at ``rank``."""
        if "v" in body:
            self.emit(
                MetricSample(
                    pool=pool_id,
                    time=float(body.get("t") or time.time()),
                    node=rank,
                    values=body["v"],
                )
            )
        elif "error" in body:
            name, why = body["error"]
            self.emit(MetricFailed(pool=pool_id, node=rank, name=str(name), why=str(why)))

    def lines(self, rank: int, global_rank: int, stream: int, lines: list[str]) -> None:
        if not self.logging:
            return
        for line in lines:
            self.emit(
                LogLine(pool=self.pool_id, node=rank, rank=global_rank, stream=stream, line=line)
            )

    # -- what the pool shows ---------------------------------------------------------
    def metrics(self) -> dict[int, dict[str, float]]:
        """The latest values of every node by rank, each with ``time`` (when sampled)."""
        with self.lock:
            return {
                rank: {**n.metrics, "time": n.sampled}
                for rank, n in sorted(self.nodes.items())
                if n.sampled
            }

    def view(self) -> PoolView:
        with self.lock:
            now = time.monotonic()
            nodes = tuple(
                NodeView(
                    node=rank,
                    phase=n.phase,
                    address=n.address,
                    host=n.host,
                    metrics=MappingProxyType(dict(n.metrics)),
                    sampled=n.sampled,
                    running=n.running,
                    done=n.done,
                    failed=n.failed,
                    healthy=n.healthy,
                )
                for rank, n in sorted(self.nodes.items())
            )
            functions: dict[str, FunctionStats] = {}
            for fn in self.functions.values():
                ended = fn.done + fn.failed
                if fn.name in functions:  # the same name, another definition: merged
                    continue
                functions[fn.name] = FunctionStats(
                    name=fn.name,
                    done=fn.done,
                    failed=fn.failed,
                    mean=fn.total / ended if ended else 0.0,
                    min=fn.low if ended else 0.0,
                    max=fn.high,
                    per_second=ended / max(now - fn.first, 1e-6) if ended else 0.0,
                )
            return PoolView(
                pool=self.pool_id,
                phase=self.phase,
                nodes=nodes,
                running=sum(n.running for n in self.nodes.values()),
                done=sum(n.done for n in self.nodes.values()),
                failed=sum(n.failed for n in self.nodes.values()),
                functions=MappingProxyType(functions),
                time=time.time(),
            )


def _error_type(status: int, body: bytes | bytearray) -> str:
    """The type name of a failed call's exception (``ValueError``, ``WorkerDiedError``...)."""
    if status == Status.ERROR:
        try:
            name = str(decode(body, 1)[1])
        except Exception:
            return "RemoteError"
        return name.rsplit(".", 1)[-1]
    return _ERRORS.get(status, "Error")


def _size(n: float) -> str:
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n / 1024:.0f}K"


def stat_text(phase: str, running: int, metrics: Mapping[str, float]) -> str:
    """A node's live row: its phase, calls running, CPU, memory and GPUs."""
    parts = [f"{phase} {running} call(s)" if running else phase]
    if "cpu" in metrics:
        parts.append(f"cpu {metrics['cpu']:.0f}%")
    if "mem_used" in metrics and metrics.get("mem_total"):
        parts.append(f"mem {_size(metrics['mem_used'])}/{_size(metrics['mem_total'])}")
    gpus = sorted(k for k in metrics if k.startswith("gpu_util_"))
    for key in gpus[:8]:
        i = key.rsplit("_", 1)[1]
        text = f"gpu{i} {metrics[key]:.0f}%"
        used, total = metrics.get(f"gpu_mem_mb_{i}"), metrics.get(f"gpu_mem_total_mb_{i}")
        if used is not None and total:
            text += f" {used / 1024:.1f}/{total / 1024:.0f}G"
        parts.append(text)
    if len(gpus) > 8:
        parts.append(f"+{len(gpus) - 8} GPUs")
    return " · ".join(parts)


def stat_rows(view: PoolView) -> dict[int, str]:
    """The console's rows while calls run: one per node, and (key -1) a summary of all
    (what many nodes show instead: the average, and the busiest node)."""
    rows = {n.node: stat_text(n.phase, n.running, n.metrics) for n in view.nodes}
    cpus = [(n.metrics["cpu"], n.node) for n in view.nodes if "cpu" in n.metrics]
    mems = [
        (100.0 * n.metrics["mem_used"] / n.metrics["mem_total"], n.node)
        for n in view.nodes
        if n.metrics.get("mem_total")
    ]
    parts = [f"{len(view.nodes)} node(s), {view.running} call(s) running"]
    for name, values in (("cpu", cpus), ("mem", mems)):
        if values:
            top, node = max(values)
            mean = sum(v for v, _ in values) / len(values)
            parts.append(f"{name} avg {mean:.0f}% (max node-{node} {top:.0f}%)")
    rows[-1] = " · ".join(parts)
    return rows


class Observed:
    """What a pool whose ``_observer`` watches it shows of itself (the methods
    :class:`~flotilla.Compute` takes from it)."""

    _observer: Observer

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
        on_event: OnEvent = None,
        on_log: OnLog = None,
        on_change: OnChange = None,
    ) -> Callable[[], None]:
        """Call ``on_event`` with every event of the pool (``flotilla.events``),
        ``on_log`` with every line its tasks print, ``on_change`` with the views
        (old, new) around each change; returns the function that unsubscribes them. A
        callback that raises is reported once and unsubscribed."""
        return self._observer.subscribe(on_event, on_log, on_change)
