"""What happens in a pool, as typed events (frozen dataclasses).

    import flotilla as sky
    from flotilla import events

    def on_event(e: events.Event) -> None:
        match e:
            case events.NodeLost(node=n, why=why):
                print(f"node {n} lost: {why}")
            case events.TaskFinished(function=f, duration=d, ok=False, error=err):
                print(f"{f} failed after {d:.1f} s: {err}")

    with sky.Compute(nodes=4) as pool:
        unsubscribe = pool.subscribe(on_event=on_event)
        ...
        unsubscribe()

Every event has ``pool`` (the pool's id) and ``time`` (wall-clock seconds, as
``time.time()``), and the fields of its kind. ``as_dict``/``from_dict`` turn them into JSON
objects and back (``{"type": "NodeLost", ...}``): the form of ``flotilla events --json``.

Callbacks run on the thread that noticed the event (the pool's event loop, or a caller
waiting for its result): keep them short. A callback that raises is reported once (a
warning on the ``flotilla`` logger) and unsubscribed; the pool goes on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Error",
    "Event",
    "JobState",
    "LogLine",
    "MetricFailed",
    "MetricSample",
    "NodeHealthFailed",
    "NodeLost",
    "NodeReady",
    "NodeReplaced",
    "PoolPhase",
    "Scaling",
    "ScalingDecision",
    "TaskFinished",
    "TaskStarted",
    "as_dict",
    "from_dict",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Fields of every event."""

    pool: str = ""
    time: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolPhase(Event):
    """The pool's phase changed: ``starting``, ``running``, ``closing``, ``closed``."""

    phase: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeReady(Event):
    """A node serves (at start, or after a replacement); ``address`` is its host's."""

    node: int
    address: str = ""
    host: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLost(Event):
    """A node was lost; ``why`` says how (its agent exited, it stopped answering, it
    failed its health check...)."""

    node: int
    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeReplaced(Event):
    """A lost node's replacement serves at its rank, ``seconds`` after the loss."""

    node: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeHealthFailed(Event):
    """A node's health check failed (``failures`` in a row; ``why``: the check's reason,
    the exception's text, or its timeout). At ``Options.health_checker``'s
    ``consecutive_failures`` the node is replaced (a :class:`NodeLost` follows)."""

    node: int
    why: str
    failures: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskStarted(Event):
    """A call was given to a node's process."""

    node: int
    function: str
    task: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskFinished(Event):
    """A call ended on a node: ``ok``, or ``error`` is the exception's type name (or
    ``WorkerDiedError``, ``TaskTimeoutError``, ``CancelledError``...). ``duration`` is
    seconds from its start on the node to its result here."""

    node: int
    function: str
    task: int
    duration: float
    ok: bool
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSample(Event):
    """A node's metric values (name -> value, see ``flotilla.metrics``) sampled at
    ``time``."""

    node: int
    values: Mapping[str, float]


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricFailed(Event):
    """A metric's command failed, hung or printed something else than a number on a
    node: reported once, it is not run there again."""

    node: int
    name: str
    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LogLine(Event):
    """A line a task printed (``stream`` 1: stdout, 2: stderr; ``rank``: the process's
    global rank)."""

    node: int
    rank: int
    stream: int
    line: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Scaling(Event):
    """An elastic pool changed size: ``nodes`` now (``why``: grown for waiting calls,
    idle nodes released...)."""

    nodes: int
    why: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalingDecision(Event):
    """An elastic pool's autoscaler (or ``pool.resize``) decided to head from
    ``from_nodes`` to ``to_nodes`` nodes, for ``reason`` (calls queued, idle for the
    timeout, low use, ``pool.resize()``, a broadcast on the empty pool): the console line
    ``autoscaler: 0 -> 4 node(s): ...`` as an event. :class:`Scaling` follows as nodes join
    or leave."""

    from_nodes: int
    to_nodes: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(Event):
    """Something went wrong that no call raises (a callback failed, a replacement was
    impossible...)."""

    message: str
    node: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class JobState(Event):
    """A command-line job (or managed job) changed state (``flotilla events``)."""

    job: str
    state: str
    detail: str = ""


_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        PoolPhase,
        NodeReady,
        NodeLost,
        NodeReplaced,
        NodeHealthFailed,
        TaskStarted,
        TaskFinished,
        MetricSample,
        MetricFailed,
        LogLine,
        Scaling,
        ScalingDecision,
        Error,
        JobState,
    )
}


def as_dict(event: Event) -> dict[str, Any]:
    """``event`` as a JSON object: ``{"type": <class name>, <fields>...}``."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        out[f.name] = dict(value) if isinstance(value, Mapping) else value
    return out


def from_dict(data: Mapping[str, Any]) -> Event:
    """The event :func:`as_dict` made (unknown fields are ignored); ValueError for an
    unknown type."""
    cls = _TYPES.get(str(data.get("type")))
    if cls is None:
        raise ValueError(f"not a flotilla event: {data.get('type')!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


# -- snapshots (pool.view()) -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FunctionStats:
    """A function's calls so far: how many ended, failed, their durations (seconds) and
    ``per_second`` (calls ended per second since the first started)."""

    name: str
    done: int
    failed: int
    mean: float
    min: float
    max: float
    per_second: float


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node: ``phase`` (starting, ready, lost, replacing, closed), where it runs, its
    latest metrics (and when they were sampled), its calls running and done."""

    node: int
    phase: str
    address: str
    host: str
    metrics: Mapping[str, float]
    sampled: float
    running: int
    done: int
    failed: int
    healthy: bool | None = None  # None: no health check (or none ran yet)


@dataclass(frozen=True, slots=True)
class PoolView:
    """A frozen snapshot of a pool (``pool.view()``)."""

    pool: str
    phase: str
    nodes: tuple[NodeView, ...]
    running: int
    done: int
    failed: int
    functions: Mapping[str, FunctionStats]
    time: float


def view_dict(view: PoolView) -> dict[str, Any]:
    """A :class:`PoolView` as JSON (the form of ``flotilla top --json``)."""
    return {
        "pool": view.pool,
        "phase": view.phase,
        "time": view.time,
        "running": view.running,
        "done": view.done,
        "failed": view.failed,
        "nodes": [
            {
                "node": n.node,
                "phase": n.phase,
                "address": n.address,
                "host": n.host,
                "metrics": dict(n.metrics),
                "sampled": n.sampled,
                "running": n.running,
                "done": n.done,
                "failed": n.failed,
                "healthy": n.healthy,
            }
            for n in view.nodes
        ],
        "functions": {
            name: {
                "done": f.done,
                "failed": f.failed,
                "mean": f.mean,
                "min": f.min,
                "max": f.max,
                "per_second": f.per_second,
            }
            for name, f in view.functions.items()
        },
    }


__all__ += ["FunctionStats", "NodeView", "PoolView", "view_dict"]
