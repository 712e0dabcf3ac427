"""A cluster's metrics and events on the command line: ``flotilla top``, ``flotilla events``
and ``flotilla logs --export``.

The cluster's daemon keeps (:class:`EventLog`, in the cluster's private folder):

* `events.jsonl`: its pool's typed events (``flotilla.events``, one JSON object a line:
  phases, nodes ready/lost/replaced, health checks, failed metrics, calls) and its jobs'
  state changes (``JobState``); not the metric samples nor the output lines (the jobs'
  logs hold those);
* `top.json`: the pool's latest view (``pool.view()``: every node's phase, address,
  metrics, calls), rewritten every second while it changes.

The commands read those files: no request to the daemon, so ``top`` of 128 nodes costs the
daemon nothing more than its own writes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..events import Event, JobState, LogLine, MetricSample, as_dict, view_dict
from .console import CLIError
from .state import ClusterState, Paths, all_names, load

EVENTS = "events.jsonl"
TOP = "top.json"
_TOP_EVERY = 1.0  # seconds between two writes of top.json (while something changed)
_SORTS = ("node", "cpu", "mem", "gpu", "running", "done")


# -- the daemon's side ---------------------------------------------------------------------
def _write(path: Path, data: Any) -> None:
    """``data`` as JSON in ``path``, atomically (no fsync: a snapshot, rewritten soon)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def append_event(path: Path, event: Event) -> None:
    """Add ``event`` to the events file ``path`` (one JSON object a line; private; best
    effort: a record of events never stops what it records)."""
    line = json.dumps(as_dict(event), separators=(",", ":")) + "\n"
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


class EventLog:
    """A cluster daemon's record of its pool's events and latest view (see the module
    docstring). ``sink`` is given to the pool's observer; ``job`` is called at every
    change of a job."""

    def __init__(self, paths: Paths) -> None:
        self.events = paths.dir / EVENTS
        self.top = paths.dir / TOP
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.stopped = threading.Event()
        self.jobs: dict[int, str] = {}  # job id -> the state last logged
        self.view: Any = None  # the pool's view(), once it runs
        self.thread: threading.Thread | None = None

    def sink(self, event: Event) -> None:
        if isinstance(event, LogLine):
            return
        self.changed.set()
        if isinstance(event, MetricSample):
            return
        self.append(event)

    def append(self, event: Event) -> None:
        with self.lock:
            append_event(self.events, event)

    def job(self, job_id: int, state: str, name: str = "") -> None:
        if self.jobs.get(job_id) == state:
            return
        self.jobs[job_id] = state
        self.append(JobState(job=str(job_id), state=state, detail=name))

    def start(self, view: Any) -> None:
        """Write `top.json` from ``view()`` (the pool's) every second it changed."""
        self.view = view
        self.changed.set()
        self.thread = threading.Thread(target=self._run, name="flotilla-top", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.changed.wait()
            if self.stopped.is_set():
                break
            self.changed.clear()
            with contextlib.suppress(OSError, ValueError):
                _write(self.top, view_dict(self.view()))
            self.stopped.wait(_TOP_EVERY)

    def stop(self) -> None:
        self.stopped.set()
        self.changed.set()
        if self.view is not None:  # the last view: its nodes closed
            with contextlib.suppress(OSError, ValueError):
                _write(self.top, view_dict(self.view()))


# -- the commands ----------------------------------------------------------------------------
def add_parsers(sub: Any, logs: argparse.ArgumentParser) -> None:
    q = sub.add_parser("top", help="a live table of the clusters' nodes: CPU, memory, GPUs")
    q.add_argument(
        "cluster",
        nargs="?",
        help="one cluster, or a Python pool's id (default: every running cluster and pool)",
    )
    q.add_argument("--sort", choices=_SORTS, default="node", help="order of the rows")
    q.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    q.add_argument("--once", action="store_true", help="print the table once and exit")
    q.set_defaults(func=cmd_top)
    q = sub.add_parser(
        "events", help="a cluster's events (nodes, health, jobs, calls), or a managed job's"
    )
    q.add_argument("cluster", help="a cluster, or a managed job's id or name")
    q.add_argument("-f", "--follow", action="store_true", help="wait for more until Ctrl-C")
    q.add_argument("--json", action="store_true", help="one JSON object per line")
    q.set_defaults(func=cmd_events)
    logs.add_argument(
        "--export",
        nargs=2,
        metavar=("jsonl|md", "FILE"),
        help="write the job's output and the cluster's events to FILE instead (JSON lines "
        "or a Markdown report)",
    )


def _pools(wanted: str | None) -> list[dict[str, Any]]:
    """The running Python pools of this user (``_client/listing.py``), as snapshots; only
    the one whose pool id (or process id) is ``wanted`` when given."""
    from .._client.listing import running

    out = []
    for entry in running():
        if wanted and wanted not in (entry.get("pool"), str(entry.get("pid"))):
            continue
        out.append({**entry, "cluster": f"pool-{entry.get('pool')}", "state": "UP"})
    return out


def _snapshots(cluster: str | None) -> list[dict[str, Any]]:
    """The clusters' (or ``cluster``'s: a cluster, or a Python pool's id) latest views."""
    from .._errors import ConfigurationError

    if cluster:
        try:
            known = load(Paths(cluster)) is not None
        except ConfigurationError:
            known = False
        if not known:
            pools = _pools(cluster)
            if not pools:
                raise CLIError(
                    f"no cluster nor running pool named {cluster!r} (see `flotilla status`)"
                )
            return pools
    names = [cluster] if cluster else all_names()
    out = []
    for name in names:
        paths = Paths(name)
        rec = load(paths)
        if rec is None:
            continue
        state = rec.observed_state()
        snap: dict[str, Any] = {"cluster": name, "state": state.value, "nodes": []}
        try:
            with open(paths.dir / TOP, encoding="utf-8") as f:
                view = json.load(f)
        except (OSError, ValueError):
            view = None
        if view is not None and state in (ClusterState.UP, ClusterState.STARTING):
            snap.update(view)
            snap["cluster"], snap["state"] = name, state.value
        out.append(snap)
    return out if cluster else out + _pools(None)


def _gpu(metrics: Mapping[str, float]) -> str:
    utils = sorted(k for k in metrics if k.startswith("gpu_util_"))
    if not utils:
        return "-"
    shown = [f"{metrics[k]:.0f}%" for k in utils[:4]]
    return " ".join(shown) + (f" +{len(utils) - 4}" if len(utils) > 4 else "")


def _size(n: float) -> str:
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n / 1024:.0f}K"


def _rows(snaps: list[dict[str, Any]], sort: str) -> list[dict[str, Any]]:
    rows = [{**n, "cluster": s["cluster"]} for s in snaps for n in s.get("nodes", [])]

    def key(row: dict[str, Any]) -> Any:
        m = row["metrics"]
        if sort == "cpu":
            return -m.get("cpu", -1.0)
        if sort == "mem":
            return -m.get("mem_used", -1.0)
        if sort == "gpu":
            return -max((v for k, v in m.items() if k.startswith("gpu_util_")), default=-1.0)
        if sort in ("running", "done"):
            return -row[sort]
        return (row["cluster"], row["node"])

    return sorted(rows, key=key)


def _table(snaps: list[dict[str, Any]], sort: str, height: int) -> Any:
    from rich.table import Table

    rows = _rows(snaps, sort)
    running = sum(s.get("running", 0) for s in snaps)
    title = (
        f"flotilla top: {len(snaps)} cluster(s), {len(rows)} node(s), {running} call(s) "
        f"running, sorted by {sort}"
    )
    table = Table(title=title, title_justify="left", expand=True)
    for column in ("CLUSTER", "NODE", "PHASE", "HOST", "CPU", "MEM", "GPU", "RUN", "DONE"):
        table.add_column(
            column, justify="right" if column in ("NODE", "CPU", "RUN", "DONE") else "left"
        )
    shown = rows[: max(1, height)]
    for row in shown:
        m = row["metrics"]
        cpu = f"{m['cpu']:.0f}%" if "cpu" in m else "-"
        mem = f"{_size(m['mem_used'])}/{_size(m['mem_total'])}" if m.get("mem_total") else "-"
        table.add_row(
            row["cluster"],
            str(row["node"]),
            row["phase"],
            row["host"] or row["address"] or "-",
            cpu,
            mem,
            _gpu(m),
            str(row["running"]),
            str(row["done"]),
        )
    if len(rows) > len(shown):
        table.caption = f"{len(rows) - len(shown)} more node(s) (--json: all)"
    for s in snaps:
        if not s.get("nodes"):
            table.add_row(s["cluster"], "-", s["state"].lower(), "-", "-", "-", "-", "-", "-")
    return table


_KEYS = {"n": "node", "c": "cpu", "m": "mem", "g": "gpu", "r": "running", "d": "done"}
"""``top``'s keys: the order of the rows (q quits)."""


def cmd_top(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({"clusters": _snapshots(args.cluster)}, indent=1))
        return 0
    from rich.console import Console

    console = Console()
    if args.once or not console.is_terminal:
        console.print(_table(_snapshots(args.cluster), args.sort, 10_000))
        return 0
    from rich.live import Live

    sort = [args.sort]

    def render() -> Any:
        # the rows that fit: the title, the header (3 lines), the bottom, the caption
        table = _table(_snapshots(args.cluster), sort[0], console.size.height - 8)
        table.caption = (table.caption + " · " if table.caption else "") + (
            "keys n c m g r d: sort by node, cpu, mem, gpu, running, done · q: quit"
        )
        return table

    try:
        with _keys() as key, Live(render(), console=console, auto_refresh=False) as live:
            while True:
                pressed = key(1.0)
                if pressed == "q":
                    return 0
                if pressed in _KEYS:
                    sort[0] = _KEYS[pressed]
                live.update(render(), refresh=True)
    except KeyboardInterrupt:
        return 0


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """``key(timeout)``: the key pressed within ``timeout`` seconds (or "") on a terminal
    in cbreak mode, restored at the end."""
    import select
    import termios
    import tty

    fd = sys.stdin.fileno()
    try:
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError):  # stdin is not a terminal: no keys, only the timer

        def wait(timeout: float) -> str:
            time.sleep(timeout)
            return ""

        yield wait
        return

    def key(timeout: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 1).decode(errors="replace").lower() if ready else ""

    tty.setcbreak(fd)
    try:
        yield key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _events(where: Paths | Path, follow: bool) -> Iterator[dict[str, Any]]:
    """The events of a cluster (or in an events file); with ``follow``, then those that
    come until Ctrl-C."""
    path = where.dir / EVENTS if isinstance(where, Paths) else where
    offset = 0
    partial = b""
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        offset += len(data)
        lines = (partial + data).split(b"\n")
        partial = lines.pop()
        for line in lines:
            with contextlib.suppress(ValueError):
                yield json.loads(line)
        if not follow:
            return
        time.sleep(0.25)


def describe(event: Mapping[str, Any]) -> str:
    """One event as a line of text: its time, then what happened."""
    stamp = time.strftime("%H:%M:%S", time.localtime(float(event.get("time", 0))))
    kind = event.get("type")
    node = f"node {event.get('node')}"
    text: str
    if kind == "PoolPhase":
        text = f"pool {event['phase']}"
    elif kind == "NodeReady":
        text = f"{node} ready" + (
            f" ({event['host'] or event['address']})"
            if event.get("host") or event.get("address")
            else ""
        )
    elif kind == "NodeLost":
        text = f"{node} lost: {event['why']}"
    elif kind == "NodeReplaced":
        text = f"{node} replaced after {event['seconds']:.1f} s"
    elif kind == "NodeHealthFailed":
        text = f"{node} failed its health check ({event['failures']}): {event['why']}"
    elif kind == "TaskStarted":
        text = f"{node} started {event['function']} (task {event['task']})"
    elif kind == "TaskFinished":
        how = "ok" if event.get("ok") else f"failed: {event.get('error')}"
        text = f"{node} finished {event['function']} in {event['duration']:.2f} s, {how}"
    elif kind == "MetricFailed":
        text = f"{node} metric {event['name']!r} off: {event['why']}"
    elif kind == "JobState":
        text = f"job {event['job']} {event['state'].lower()}" + (
            f" ({event['detail']})" if event.get("detail") else ""
        )
    elif kind == "Scaling":
        text = f"pool now has {event['nodes']} node(s)"
    elif kind == "ScalingDecision":
        change = f"{event['from_nodes']} -> {event['to_nodes']}"
        text = f"autoscaler: {change} node(s): {event['reason']}"
    else:
        text = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("type", "time", "pool"))
        text = f"{kind}: {text}"
    return f"{stamp} {text}"


def cmd_events(args: argparse.Namespace) -> int:
    from .._errors import ConfigurationError
    from .managed.state import JobsHome

    try:
        paths: Paths | None = Paths(args.cluster)
    except ConfigurationError:  # not a cluster's name: a managed job's id
        paths = None
    where: Paths | Path | None = paths
    if paths is None or load(paths) is None:  # a managed job's (id or name): its states
        try:
            rec = JobsHome().resolve(args.cluster)
        except ConfigurationError:
            raise CLIError(
                f"no cluster nor managed job named {args.cluster!r} (see `flotilla status`, "
                "`flotilla jobs queue`)"
            ) from None
        where = JobsHome().dir(rec.id) / EVENTS
    assert where is not None
    try:
        for event in _events(where, args.follow):
            sys.stdout.write((json.dumps(event) if args.json else describe(event)) + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 130 if not args.follow else 0
    return 0


def export(paths: Paths, job_id: int, fmt: str, target: str) -> int:
    """Write job ``job_id``'s output and the cluster's events to ``target`` (``jsonl``: one
    object a line, the output lines as ``{"type": "LogLine", "line": ...}``; ``md``: a
    Markdown report)."""
    try:
        with open(paths.job_dir(job_id) / "job.log", encoding="utf-8", errors="replace") as f:
            output = f.read().splitlines()
    except FileNotFoundError:
        output = []
    events = list(_events(paths, follow=False))
    out = Path(target)
    with open(out, "w", encoding="utf-8") as f:
        if fmt == "jsonl":
            for event in events:
                f.write(json.dumps(event) + "\n")
            for line in output:
                f.write(json.dumps({"type": "LogLine", "job": job_id, "line": line}) + "\n")
        else:
            f.write(f"# Cluster {paths.name}, job {job_id}\n\n## Output\n\n```text\n")
            f.write("".join(line.replace("```", "`\u200b``") + "\n" for line in output))
            f.write("```\n\n## Events\n\n| time | event |\n| --- | --- |\n")
            for event in events:
                stamp, _, text = describe(event).partition(" ")
                cell = text.replace("|", "\\|")
                f.write(f"| {stamp} | {cell} |\n")
    from .console import say

    say(f"wrote job {job_id}'s output ({len(output)} lines) and {len(events)} events to {out}")
    return 0
