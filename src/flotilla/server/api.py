"""What the server serves, as plain data (no web framework here): the clusters, their nodes,
jobs and metrics from the files the CLI and its daemons keep (``cli.state``: NAME.json;
``cli.observe``: events.jsonl and top.json), the managed jobs (``cli.managed.state``), the
running Python pools (``$FLOTILLA_HOME/pools``, which every ``Compute`` with metrics keeps
while it runs), Prometheus text, and the actions, run through the ``flotilla`` command
itself so that they do exactly what it does and fail with the message it prints.

Nothing here holds a secret value: the records hold none (only variable names), and
fields whose names look secret are shown as ``***`` (``flotilla._redaction``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .._errors import ConfigurationError
from .._redaction import MASK, looks_secret
from ..cli.observe import TOP
from ..cli.state import (
    ClusterRecord,
    ClusterState,
    CorruptStateError,
    JobStatus,
    Paths,
    all_names,
    load,
)

ACTION_TIMEOUT = 900.0
"""Seconds an action (the ``flotilla`` command it runs) may take before it is killed."""


class ApiError(Exception):
    """A request the server cannot serve: ``status`` (an HTTP status) and the message the
    command line would print."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def redacted(value: Any) -> Any:
    """``value`` with every field whose name looks secret shown as ``***``."""
    if isinstance(value, dict):
        return {
            k: MASK if looks_secret(str(k)) and v not in (None, "") else redacted(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redacted(v) for v in value]
    return value


# -- clusters --------------------------------------------------------------------------------
def paths_of(name: str) -> Paths:
    """The cluster's files; 404 for a name no cluster can have."""
    try:
        return Paths(name)
    except ConfigurationError as e:
        raise ApiError(404, str(e)) from None


def record_of(name: str) -> tuple[Paths, ClusterRecord]:
    """The cluster's paths and record; 404 when there is none (the CLI's message)."""
    paths = paths_of(name)
    try:
        rec = load(paths)
    except CorruptStateError as e:
        raise ApiError(409, str(e)) from None
    if rec is None:
        raise ApiError(
            404,
            f"there is no cluster {name!r} (see `flotilla status`; "
            f"`flotilla launch -c {name} TASK` starts one)",
        )
    return paths, rec


def _view(paths: Paths) -> dict[str, Any] | None:
    """The cluster's latest pool view (top.json), or None."""
    try:
        with open(paths.dir / TOP, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def job_data(job: Any) -> dict[str, Any]:
    """One job of a cluster (a ``JobRecord``'s fields), as the API and ``queue --json``
    show it."""
    return asdict(job)


def summary(name: str, rec: ClusterRecord) -> dict[str, Any]:
    """One cluster as ``GET /api/v1/clusters`` lists it."""
    state = rec.observed_state()
    jobs = rec.observed_jobs()
    return {
        "name": name,
        "state": state.value,
        "provider": str(rec.provider.get("kind", "?")),
        "num_nodes": rec.num_nodes,
        "created": rec.created,
        "last_activity": rec.last_activity,
        "idle_minutes": rec.idle_minutes,
        "autodown": rec.autodown,
        "error": rec.error,
        "jobs": len(jobs),
        "jobs_running": sum(1 for j in jobs if not JobStatus(j.status).finished),
    }


def summary_of(name: str) -> dict[str, Any]:
    return summary(name, record_of(name)[1])


def clusters(names: list[str] | None = None) -> list[dict[str, Any]]:
    """Every cluster's summary (``names``: those only; one that does not exist is listed
    with state MISSING), as the API and ``flotilla status --json`` show them."""
    out: list[dict[str, Any]] = []
    for name in names or all_names():
        try:
            rec = load(Paths(name))
        except CorruptStateError as e:  # this cluster only: the others are listed
            out.append({"name": name, "state": "CORRUPT", "error": str(e)})
            continue
        if rec is not None:
            out.append(summary(name, rec))
        elif names:
            out.append({"name": name, "state": "MISSING", "error": "no such cluster"})
    return out


def cluster(name: str) -> dict[str, Any]:
    """One cluster: its summary, provider (redacted), nodes (the record's and the latest
    view's: phase, address, metrics), addresses, the pool's phase and its jobs."""
    paths, rec = record_of(name)
    out = summary(name, rec)
    state = rec.observed_state()
    view = _view(paths) if state in (ClusterState.UP, ClusterState.STARTING) else None
    seen = {int(n["node"]): n for n in (view or {}).get("nodes", []) if "node" in n}
    nodes = []
    for n in rec.nodes:
        live = seen.pop(n.node, {})
        nodes.append(
            {
                "node": n.node,
                "ip": n.ip,
                "host": n.host,
                "workdir": n.workdir,
                "cpus": n.cpus,
                "memory_gb": n.memory_gb,
                "gpus": n.gpus,
                "phase": live.get("phase", "up" if state is ClusterState.UP else "-"),
                "address": live.get("address", n.ip),
                "metrics": live.get("metrics", {}),
                "sampled": live.get("sampled", 0.0),
                "running": live.get("running", 0),
                "done": live.get("done", 0),
                "failed": live.get("failed", 0),
                "healthy": live.get("healthy"),
            }
        )
    for node, live in sorted(seen.items()):  # starting: in the view, not yet recorded
        nodes.append({"ip": live.get("address", ""), "workdir": "", **live, "node": node})
    out.update(
        provider=redacted(rec.provider),
        phase=(view or {}).get("phase", state.value.lower()),
        sampled=(view or {}).get("time", 0.0),
        nodes=nodes,
        addresses=[n["address"] or n["ip"] for n in nodes],
        engines=rec.engines,
        jobs=[job_data(j) for j in rec.observed_jobs()],
    )
    return out


def jobs(name: str) -> list[dict[str, Any]]:
    return [job_data(j) for j in record_of(name)[1].observed_jobs()]


def job(name: str, job_id: int) -> dict[str, Any]:
    paths, rec = record_of(name)
    for j in rec.observed_jobs():
        if j.id == job_id:
            return job_data(j)
    raise ApiError(404, f"cluster {paths.name} has no job {job_id} (see `flotilla queue`)")


def job_log(name: str, job_id: int, node: int | None) -> Path:
    """The file of job ``job_id``'s output (``node``: that node's only)."""
    paths, rec = record_of(name)
    job(name, job_id)
    if node is not None and not 0 <= node < rec.num_nodes:
        raise ApiError(400, f"cluster {paths.name} has nodes 0 to {rec.num_nodes - 1}")
    return paths.job_dir(job_id) / ("job.log" if node is None else f"node-{node}.log")


def job_finished(name: str, job_id: int) -> dict[str, Any] | None:
    """The job when it has ended (LOST counts: its daemon is gone), else None."""
    try:
        found = job(name, job_id)
    except ApiError:
        return {"status": "GONE", "exit_code": None}
    return found if JobStatus(found["status"]).finished else None


# -- managed jobs and pools ------------------------------------------------------------------
def _jobs_home() -> Any:
    from ..cli.managed.state import JobsHome

    return JobsHome()


def managed_jobs() -> list[dict[str, Any]]:
    out = []
    for rec in _jobs_home().all():
        data = redacted(asdict(rec))
        data["state"] = rec.observed_state().value
        out.append(data)
    return out


def managed_job(job_id: int) -> dict[str, Any]:
    home = _jobs_home()
    try:
        rec = home.load(job_id)
    except ConfigurationError as e:
        raise ApiError(409, str(e)) from None
    if rec is None:
        raise ApiError(404, f"there is no managed job {job_id} (see `flotilla jobs queue`)")
    data: dict[str, Any] = redacted(asdict(rec))
    data["state"] = rec.observed_state().value
    return data


def managed_log(job_id: int) -> Path:
    managed_job(job_id)
    return Path(_jobs_home().log(job_id))


def managed_finished(job_id: int) -> dict[str, Any] | None:
    from ..cli.managed.state import ManagedJobState

    found = managed_job(job_id)
    if not ManagedJobState(found["state"]).finished:
        return None
    return {"status": found["state"], "exit_code": found["exit_code"]}


def pools() -> list[dict[str, Any]]:
    """The running Python pools of this user: each ``Compute`` (with metrics on) keeps an
    entry in ``$FLOTILLA_HOME/pools`` while it runs and removes it when it closes."""
    from .._client.listing import running

    return [redacted(entry) for entry in running()]


# -- Prometheus ------------------------------------------------------------------------------
_NAMED = {
    "cpu": ("flotilla_node_cpu_percent", "CPU use of the node (percent)"),
    "mem_used": ("flotilla_node_memory_used_bytes", "memory in use on the node"),
    "mem_total": ("flotilla_node_memory_total_bytes", "memory of the node"),
}


def _label(value: object) -> str:
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def prometheus(streams: int) -> str:
    """Every cluster's and node's gauges in Prometheus' text format."""
    series: dict[str, tuple[str, list[str]]] = {}

    def add(metric: str, help_text: str, labels: dict[str, object], value: float) -> None:
        shown = ",".join(f"{k}={_label(v)}" for k, v in labels.items())
        number = str(int(value)) if float(value).is_integer() else repr(float(value))
        row = f"{metric}{{{shown}}} {number}" if shown else f"{metric} {number}"
        series.setdefault(metric, (help_text, []))[1].append(row)

    add("flotilla_server_streams", "event and output streams open now", {}, streams)
    for entry in clusters():
        name = entry["name"]
        add(
            "flotilla_cluster_up",
            "1 while the cluster is UP",
            {"cluster": name, "state": entry["state"]},
            1 if entry["state"] == "UP" else 0,
        )
        if entry["state"] == "CORRUPT":
            continue
        add("flotilla_cluster_nodes", "nodes of the cluster", {"cluster": name}, entry["num_nodes"])
        add(
            "flotilla_cluster_jobs_running",
            "jobs not finished",
            {"cluster": name},
            entry["jobs_running"],
        )
        for node in cluster(name)["nodes"]:
            labels: dict[str, object] = {"cluster": name, "node": node["node"]}
            add(
                "flotilla_node_ready",
                "1 while the node is ready",
                labels,
                1 if node["phase"] in ("ready", "up") else 0,
            )
            add("flotilla_node_calls_running", "calls running on the node", labels, node["running"])
            for key, value in sorted(node["metrics"].items()):
                if not isinstance(value, int | float):
                    continue
                if key in _NAMED:
                    metric, help_text = _NAMED[key]
                    add(metric, help_text, labels, value)
                elif key.startswith("gpu_util_"):
                    gpu = {**labels, "gpu": key.removeprefix("gpu_util_")}
                    add("flotilla_node_gpu_utilization_percent", "GPU use (percent)", gpu, value)
                else:
                    add("flotilla_node_metric", "another metric", {**labels, "name": key}, value)
    lines = []
    for metric, (help_text, rows) in series.items():
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge", *rows]
    return "\n".join(lines) + "\n"


# -- actions: the command line itself --------------------------------------------------------
def run_cli(
    *args: str, task: Path | None = None, timeout: float = ACTION_TIMEOUT
) -> dict[str, Any]:
    """Run ``flotilla ARGS`` (this interpreter's, this FLOTILLA_HOME); its output. A
    command that fails is an ApiError with the message it printed (``error: ...``):
    400 for a bad request (exit 2), 409 for what flotilla could not do. The path of
    ``task`` (the request's body in a file) is shown as ``task``."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "flotilla", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise ApiError(504, f"`flotilla {args[0]}` took more than {timeout:.0f} s") from None
    text = done.stdout + done.stderr
    stderr = done.stderr
    if task is not None:
        text, stderr = text.replace(str(task), "task"), stderr.replace(str(task), "task")
    output = text.splitlines()
    if done.returncode != 0:
        errors = [line.split("error: ", 1)[1] for line in stderr.splitlines() if "error: " in line]
        message = "; ".join(errors) or (output[-1] if output else f"exit {done.returncode}")
        raise ApiError(400 if done.returncode == 2 else 409, message)
    return {"ok": True, "output": output}


def _task_file(body: str, is_command: bool) -> tuple[Path, Path]:
    """A private folder holding ``task.yaml``: ``body`` (a task file), or a task that runs
    the shell command ``body``."""
    if is_command:
        import yaml

        body = yaml.safe_dump({"run": body})
    folder = Path(tempfile.mkdtemp(prefix="flotilla-api-"))  # mode 0700
    task = folder / "task.yaml"
    fd = os.open(task, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body)
    return folder, task


def launch(body: str, is_command: bool, name: str, nodes: int | None) -> dict[str, Any]:
    """``flotilla launch TASK -c NAME [--nodes N] -d``: ``body`` is the task file (or a
    shell command); the answer has the cluster and the new job."""
    paths_of(name)
    folder, task = _task_file(body, is_command)
    try:
        flags = ["--nodes", str(nodes)] if nodes is not None else []
        done = run_cli("launch", str(task), "-c", name, *flags, "-d", task=task)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {**done, **_last_job(name)}


def exec_(name: str, body: str, is_command: bool, nodes: int | None) -> dict[str, Any]:
    """``flotilla exec NAME TASK [--nodes N] -d``."""
    record_of(name)
    folder, task = _task_file(body, is_command)
    try:
        flags = ["--nodes", str(nodes)] if nodes is not None else []
        done = run_cli("exec", name, str(task), *flags, "-d", task=task)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {**done, **_last_job(name)}


def _last_job(name: str) -> dict[str, Any]:
    with contextlib.suppress(ApiError):
        rec = record_of(name)[1]
        if rec.jobs:
            return {"cluster": name, "job": rec.jobs[-1].id}
    return {"cluster": name}


def cancel(name: str, job_id: int) -> dict[str, Any]:
    job(name, job_id)
    return {**run_cli("cancel", name, str(job_id), "-y"), **job(name, job_id)}


def lifecycle(action: str, name: str) -> dict[str, Any]:
    """``flotilla stop|start|down NAME``."""
    record_of(name)
    args = ("down", name, "-y") if action == "down" else (action, name)
    return {**run_cli(*args), "cluster": name}


def cancel_managed(job_id: int) -> dict[str, Any]:
    managed_job(job_id)
    return {**run_cli("jobs", "cancel", str(job_id)), **managed_job(job_id)}


# -- following a file ------------------------------------------------------------------------
class Tail:
    """The complete lines added to a file since the last :meth:`read` (from ``offset``,
    a byte offset: where an earlier reader stopped, or the file's start)."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self.offset = offset
        self.partial = b""

    @property
    def position(self) -> int:
        """The byte offset just past the last complete line read: where to resume."""
        return self.offset - len(self.partial)

    def entries(self, limit: int = 1 << 20) -> list[tuple[str, int]]:
        """The new complete lines, each with the byte offset just past it."""
        start = self.position
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(limit)
        except FileNotFoundError:
            return []
        self.offset += len(data)
        raw = (self.partial + data).split(b"\n")
        self.partial = raw.pop()
        out = []
        for line in raw:
            start += len(line) + 1
            out.append((line.decode("utf-8", "replace"), start))
        return out

    def read(self, limit: int = 1 << 20) -> list[str]:
        return [line for line, _ in self.entries(limit)]

    def rest(self) -> list[str]:
        """What is left once the writer is done: the last line even without its newline."""
        lines = self.read()
        while True:
            more = self.read()
            if not more:
                break
            lines += more
        if self.partial:
            lines.append(self.partial.decode("utf-8", "replace"))
            self.partial = b""
        return lines
