"""Jobs inside a cluster daemon: their logs and listeners (:class:`Job`) and their phases on
the pool (:class:`Runner`).

Phases (SkyPilot's, document 003), each a barrier::

    sync    workdir and file_mounts unpacked on every node (skipped when unchanged)
    setup   ``setup`` on every node of the cluster
    run     ``run`` on the first ``num_nodes`` nodes

When a node's script exits non-zero (or its process dies), the other nodes of the phase
are stopped (``Compute.cancel``) and the job fails; its report names that node, its exit
status and its last lines first: the root cause first, the consequences after.
"""

from __future__ import annotations

import contextlib
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .._client.compute import Compute
from .._client.lines import Throttle
from .._redaction import is_secret, redact
from .._system.private import private_dirs
from .._wire.exits import describe_exit
from .backends.base import check_gpus
from .conventions import EXIT_INTERRUPTED
from .ipc import Event, node_name, prefix
from .jobspec import JobSpec, hostfile, phase_env, shared_machine_home
from .ledger import Allocation, Demand, demand_of
from .node_ops import (
    TOKEN_VAR,
    free_port,
    reap,
    run_script,
    slurm_allocation_env,
    unpack,
    wait_job,
)
from .state import JobRecord, JobStatus, NodeRecord
from .sync import build as build_archive

TAIL_LINES = 20
"""Lines of a failing node shown in the job's report."""
_MIN_REDACTED = 4  # shorter secret values would blank out ordinary text


_TAG = re.compile("\x1e(\\d+)\x1f")


def untag(line: str) -> tuple[int | None, str]:
    """The job a tagged line came from (``node_ops.JOB_TAG``; None: untagged) and the line
    without its tags."""
    found = _TAG.search(line)
    if found is None:
        return None, line
    return int(found.group(1)), _TAG.sub("", line)


class Subscriber:
    """A client following a job: its events, optionally only one node's."""

    def __init__(self, node: int | None) -> None:
        self.node = node
        self.events: queue.Queue[Event] = queue.Queue()


class Job:
    """A submitted job: its status, logs (job.log and node-K.log) and followers.

    ``output`` runs on the pool's loop thread, everything else on daemon threads; one lock
    keeps the log files and the followers' event streams in the same order.
    """

    def __init__(self, job_id: int, spec: JobSpec, task: str, folder: Path) -> None:
        self.id = job_id
        self.spec = spec
        self.task_id = task
        self.dir = folder
        self.status = JobStatus.PENDING
        self.submitted = time.time()
        self.started = 0.0
        self.ended = 0.0
        self.exit_code: int | None = None
        self.failed_node: int | None = None
        self.report: list[str] = []
        self.secrets = [v for v in spec.secrets.values() if len(v) >= _MIN_REDACTED] + [
            v for k, v in spec.envs.items() if is_secret(k, v) and len(v) >= _MIN_REDACTED
        ]
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.cancel_requested = False
        self.cancel_code = EXIT_INTERRUPTED  # the exit code a cancelled job ends with...
        self.cancel_why = ""  # ...and why it was cancelled, when not by request
        self.active: list[Future[Any]] = []
        self.ranks: dict[int, int] = {}
        self.tails: dict[int, deque[str]] = {}
        self.subscribers: list[Subscriber] = []
        self.throttles: dict[tuple[int, int], Throttle] = {}  # bars in the logs, per node
        self.candidate: int | None = None  # where its cluster started (see demand_of)
        self.nodes: list[int] = []  # where its ``run`` runs (once it does)
        self.hidden: list[str] = []  # a re-attached job: its secrets' names (adopt.py)
        self.held: list[tuple[int, int, list[str]]] | None = None  # its lines until then
        self._files: dict[str, IO[str]] = {}
        private_dirs(folder.parent, folder)

    def record(self) -> JobRecord:
        return JobRecord(
            id=self.id,
            name=self.spec.name,
            task_id=self.task_id,
            status=self.status.value,
            num_nodes=self.spec.num_nodes or 0,
            submitted=self.submitted,
            started=self.started,
            ended=self.ended,
            exit_code=self.exit_code,
            failed_node=self.failed_node,
            error=self.report[0] if self.report else "",
            resources=self.demand.describe(
                "" if self.spec.candidate_gpus else self.spec.accelerator
            ),
            nodes=list(self.nodes),
        )

    @property
    def demand(self) -> Demand:
        """What the job holds on each of its nodes (see :class:`Demand`)."""
        return demand_of(self.spec, self.candidate)

    # -- logs and followers -------------------------------------------------------------
    def _file(self, name: str) -> IO[str]:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.dir / name, "a", encoding="utf-8")  # noqa: SIM115
        return f

    def _publish(self, event: Event, node: int | None = None) -> None:
        for sub in self.subscribers:
            if sub.node is None or sub.node == node:
                sub.events.put(event)

    def output(self, node: int, stream: int, lines: list[str]) -> None:
        """Lines a node printed: logged, kept for the report, sent to the followers."""
        lines = [untag(line)[1] for line in lines]
        with self.lock:
            if self.held is not None:  # until its secrets are known (see reveal)
                self.held.append((node, stream, lines))
                return
            throttle = self.throttles.get((node, stream))
            if throttle is not None:
                throttle.reset()  # a finished line ends the node's bar
            self._lines(node, stream, lines)

    def state(self, node: int, stream: int, text: str) -> None:
        """A node redrew its unfinished line with ``\\r`` (a progress bar): followers get
        every state (a terminal redraws the bar in place); the logs get a line now and
        then (the first state, then one per few seconds; the final line comes as output)."""
        text = untag(text)[1]
        with self.lock:
            if self.held is not None:
                return
            rank = self.ranks.get(node, node)
            clean = redact(text, self.secrets)
            event = {"ev": "bar", "node": node, "rank": rank, "stream": stream, "line": clean}
            self._publish(event, node)
            throttle = self.throttles.setdefault((node, stream), Throttle())
            if throttle.due():
                self._lines(node, stream, [text], publish=False)

    def _lines(self, node: int, stream: int, lines: list[str], publish: bool = True) -> None:
        """Log lines (held: ``self.lock``) and, unless not ``publish``, send them on."""
        rank = self.ranks.get(node, node)
        head = prefix(node, rank)
        tail = self.tails.setdefault(node, deque(maxlen=TAIL_LINES))
        clean = [redact(line, self.secrets) for line in lines]
        self._file(f"node-{node}.log").write("".join(f"{line}\n" for line in clean))
        self._file("job.log").write("".join(f"{head}{line}\n" for line in clean))
        for line in clean:
            tail.append(line)
            if publish:
                self._publish(
                    {"ev": "out", "node": node, "rank": rank, "stream": stream, "line": line},
                    node,
                )
        for f in self._files.values():
            f.flush()
        if self.done.is_set():  # a straggler after the end: do not keep files open
            self._close()

    def _close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def reveal(self, values: list[str]) -> None:
        """A re-attached job's secrets' values (read back from its processes): redacted
        from now on; the lines held meanwhile go on."""
        with self.lock:
            self.secrets += [v for v in values if len(v) >= _MIN_REDACTED]
            held, self.held = self.held or [], None
        for node, stream, lines in held:
            self.output(node, stream, lines)

    def phase(self, text: str, ranks: dict[int, int] | None = None) -> None:
        """Announce a phase; ``ranks`` (node -> rank) names the lines that follow."""
        with self.lock:
            if ranks is not None:
                self.ranks = ranks
                self.tails = {}
            self._file("job.log").write(f"flotilla: {text}\n")
            self._file("job.log").flush()
            self._publish({"ev": "phase", "text": text})

    def subscribe(self, node: int | None, replay: bool) -> tuple[list[str], Subscriber | None]:
        """Follow the job (``node``: only that node's lines): its log so far (when
        ``replay``) and a Subscriber that gets what comes next, or None when the job has
        already ended."""
        with self.lock:
            backlog: list[str] = []
            if replay:
                name = "job.log" if node is None else f"node-{node}.log"
                with contextlib.suppress(FileNotFoundError):
                    backlog = (self.dir / name).read_text(encoding="utf-8").splitlines()
            if self.done.is_set():
                return backlog, None
            sub = Subscriber(node)
            self.subscribers.append(sub)
            return backlog, sub

    def unsubscribe(self, sub: Subscriber) -> None:
        with self.lock, contextlib.suppress(ValueError):
            self.subscribers.remove(sub)

    def end_event(self) -> Event:
        return {
            "ev": "end",
            "job": self.id,
            "status": self.status.value,
            "exit_code": self.exit_code,
            "report": self.report,
            "elapsed": round((self.ended or time.time()) - (self.started or self.submitted), 3),
        }

    def finish(
        self,
        status: JobStatus,
        exit_code: int,
        report: list[str],
        save: Callable[[Job], None] | None = None,
    ) -> None:
        """End the job: its log, then ``save(job)`` (the cluster's record), then its
        followers are told; a command that returns on the news finds the record ended."""
        with self.lock:
            self.status = status
            self.exit_code = exit_code
            self.report = [redact(line, self.secrets) for line in report]
            self.ended = time.time()
            log = self._file("job.log")
            for line in self.report or [f"job {self.id} {status.value}"]:
                log.write(f"flotilla: {line}\n")
            self._close()
        if save is not None:
            save(self)
        with self.lock:
            self._publish(self.end_event())
            self.subscribers.clear()
            self.done.set()


@dataclass
class Failure:
    """The first node that failed in a phase (the root cause).

    Attributes:
        node: the node's index in the cluster.
        rank: its rank in the phase.
        phase: "sync", "setup" or "run".
        code: the script's exit status (negative: killed by that signal); None when its
            process or node died under it.
        reason: what happened, in words.
        also: nodes that failed on their own after it.
        stopped: nodes stopped because of it.
    """

    node: int
    rank: int
    phase: str
    code: int | None
    reason: str
    also: list[Failure] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The exit status the CLI returns for it."""
        if self.code is None:
            return 1
        return self.code if self.code > 0 else 128 - self.code


class Runner:
    """Runs jobs' phases on a cluster's pool, one job at a time.

    Args:
        pool: the running pool.
        cluster: the cluster's name.
        provider: the provider's kind (``ProviderSpec.kind``).
        nodes: the pool's nodes, in rank order.
        shares_filesystem: whether every node runs on this machine.
        on_status: called after each job status change (to save the state file).
        token: marks every process the jobs start (FLOTILLA_RUN_TOKEN), to find them.
        candidate: the position, as the task gave it, of the candidate the pool started
            on (a task's ``any_of``/``ordered``); None for a pool without candidates.
            It defines the accelerators per node the jobs get (``JobSpec.gpus_on``).
    """

    def __init__(
        self,
        pool: Compute,
        cluster: str,
        provider: str,
        nodes: list[NodeRecord],
        shares_filesystem: bool,
        on_status: Callable[[Job], None],
        token: str,
        candidate: int | None = None,
    ) -> None:
        self.pool = pool
        self.cluster = cluster
        self.provider = provider
        self.nodes = nodes
        self.shares_filesystem = shares_filesystem
        self.on_status = on_status
        self.workdirs = {n.node: n.workdir for n in nodes}
        self.token = token
        self.candidate = candidate
        self.synced: str | None = None  # digest of what every node has unpacked
        self.sync_lock = threading.Lock()  # jobs that run at once sync one at a time
        self.mesh = ""  # the tag of the nodes' SSH keys when they reach each other (mesh.py)
        self.tag_output = False
        """Tag each line the jobs print with the job (``node_ops.JOB_TAG``): set by a
        cluster that runs several jobs at once, whose output sink tells them apart."""

    def _status(self, job: Job, status: JobStatus) -> None:
        job.status = status
        self.on_status(job)

    def run(self, job: Job, where: Allocation | None = None) -> None:
        """Run every phase of ``job`` (``run`` on ``where``'s nodes, with its devices; None:
        the first ``num_nodes`` nodes, all their devices); never raises (failures end the
        job)."""
        spec = job.spec
        job.started = time.time()
        try:
            count = spec.num_nodes or len(self.nodes)
            if count > len(self.nodes):
                raise ValueError(
                    f"the job needs {count} nodes but cluster {self.cluster} has {len(self.nodes)}"
                )
            if where is None:
                check_gpus(spec.gpus_on(self.candidate), [n.gpus for n in self.nodes])
            nodes = where.nodes if where is not None else list(range(count))
            devices = where.devices if where is not None and not where.demand.whole else None
            everyone = list(range(len(self.nodes)))
            with self.sync_lock:
                failure = self._sync(job)
            if failure is None and spec.do_setup and spec.setup and not job.cancel_requested:
                self._status(job, JobStatus.SETTING_UP)
                failure = self._script(job, "setup", spec.setup, everyone)
            if failure is None and spec.run and not job.cancel_requested:
                job.nodes = nodes
                self._status(job, JobStatus.RUNNING)
                failure = self._script(job, "run", spec.run, nodes, devices)
                for attempt in range(1, spec.retries + 1):
                    if failure is None or job.cancel_requested:
                        break
                    self._reap(job)
                    who = node_name(failure.node, failure.rank)
                    job.phase(
                        f"job {job.id}: {who} {failure.reason}; running it again "
                        f"(retry {attempt} of {spec.retries}, same task id)"
                    )
                    failure = self._script(job, "run", spec.run, nodes, devices)
        except Exception as e:  # the pool is gone, a workdir vanished...
            self._reap(job)
            self._end(job, JobStatus.FAILED, 1, [f"job {job.id} ({spec.name}) failed: {e}"])
            return
        self._conclude(job, failure)

    def adopt(self, job: Job, nodes: list[int]) -> None:
        """Follow ``job``, whose ``run`` a daemon that died started on ``nodes`` (its
        scripts ran on, see ``_node/reattach.py``; their lines come as before) to its end,
        as :meth:`run` does; never raises."""
        ranks = {node: rank for rank, node in enumerate(nodes)}
        job.phase(f"job {job.id}: re-attached; run goes on on {len(nodes)} node(s)", ranks)
        try:
            call = wait_job(job.id, f"{self.token}.{job.id}.", self.workdirs)
            futures = self.pool.submit_broadcast(call, nodes=nodes, any_slot=True)
            failure = self._supervise(job, "run", futures, ok=0, nodes=nodes)
        except Exception as e:  # the pool is gone
            self._reap(job)
            self._end(job, JobStatus.FAILED, 1, [f"job {job.id} ({job.spec.name}) failed: {e}"])
            return
        self._conclude(job, failure)

    def _conclude(self, job: Job, failure: Failure | None) -> None:
        """End ``job`` after its phases: failed, cancelled or succeeded."""
        spec = job.spec
        if failure is not None or job.cancel_requested:
            self._reap(job)
        if failure is not None:
            status = JobStatus.FAILED_SETUP if failure.phase == "setup" else JobStatus.FAILED
            job.failed_node = failure.node
            self._end(job, status, failure.exit_code, self._report(job, failure))
        elif job.cancel_requested:
            why = f"job {job.id} ({spec.name}) was cancelled{job.cancel_why}"
            self._end(job, JobStatus.CANCELLED, job.cancel_code, [why])
        else:
            self._end(job, JobStatus.SUCCEEDED, 0, [])

    def _end(self, job: Job, status: JobStatus, code: int, report: list[str]) -> None:
        job.finish(status, code, report, save=self.on_status)

    def _reap(self, job: Job | None, timeout: float = 30.0) -> None:
        """Kill what ``job`` (None: every job of this pool) left running on the nodes, also
        processes that escaped its process group (setsid, daemons, launchers' workers)."""
        prefix = f"{self.token}." + (f"{job.id}." if job is not None else "")
        ranks = [0] if self.shares_filesystem else list(range(len(self.nodes)))
        with contextlib.suppress(Exception):  # best effort: the pool may be going away
            wait(self.pool.submit_broadcast(reap(prefix), nodes=ranks, any_slot=True), timeout)

    def reap(self, job: Job) -> None:
        """Kill what ``job`` left running on the nodes (a setup a daemon that died ran)."""
        self._reap(job)

    def reap_all(self) -> None:
        """Kill every process any job of this pool started (the cluster goes down)."""
        self._reap(None)

    def cancel(self, job: Job) -> None:
        """Stop ``job``: its running scripts are killed, its next phases skipped."""
        job.cancel_requested = True
        self.pool.cancel(list(job.active))

    # -- phases ------------------------------------------------------------------------
    def _sync(self, job: Job) -> Failure | None:
        spec = job.spec
        archive = build_archive(spec.workdir, spec.file_mounts)
        if archive is None or archive.digest == self.synced:
            return None
        left = archive.excluded
        left_out = ""
        if left.files:
            by = ", ".join(archive.rules) or "the built-in rules"
            left_out = f"; left out {left.describe()} by {by}"
        job.phase(
            f"job {job.id}: sync {archive.files} file(s), {len(archive.data) / 1e6:.1f} MB, "
            f"to {len(self.nodes)} node(s){left_out}",
            {n.node: n.node for n in self.nodes},
        )
        call = unpack(archive.data, archive.targets, self.shares_filesystem, self.workdirs)
        failure = self._supervise(
            job, "sync", self.pool.submit_broadcast(call, any_slot=True), ok=None
        )
        if failure is None:
            self.synced = archive.digest
        return failure

    def _script(
        self,
        job: Job,
        phase: str,
        script: str,
        nodes: list[int],
        devices: dict[int, list[int]] | None = None,
    ) -> Failure | None:
        """Run ``script`` on ``nodes`` (node indices, in rank order); ``devices``: the
        accelerators each node lends the job (CUDA_VISIBLE_DEVICES), None: all of them."""
        spec = job.spec
        count = len(nodes)
        port = self.pool.submit_broadcast(free_port(), nodes=[nodes[0]], any_slot=True)[0].result()
        common, per_node = phase_env(
            cluster=self.cluster,
            provider=self.provider,
            cluster_ips=[n.ip for n in self.nodes],
            job_nodes=count,
            job_id=job.id,
            task=job.task_id,
            gpus_per_node=spec.gpus_on(self.candidate),
            master_port=port,
            setup=phase == "setup",
            nodes=nodes,
        )
        if devices is not None:
            for node, given in devices.items():
                per_node.setdefault(node, {})["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, given))
        if self.shares_filesystem and "HOME" not in spec.envs:  # ~: as for file mounts
            for rank, env in per_node.items():
                env.update(shared_machine_home(self.workdirs[rank]))
        scheduler_nodes = [n.scheduler_node for n in self.nodes if n.scheduler_node]
        if scheduler_nodes and len(scheduler_nodes) == len(self.nodes):
            common.update(slurm_allocation_env(scheduler_nodes))  # srun sees every node
        common.update(spec.envs)
        common.update(spec.secrets)
        common[TOKEN_VAR] = f"{self.token}.{job.id}."
        hosts = hostfile([self.nodes[i].ip for i in nodes], spec.gpus_on(self.candidate))
        where = "" if nodes == list(range(count)) else f" ({', '.join(map(str, nodes))})"
        job.phase(
            f"job {job.id}: {phase} on {count} node(s){where}",
            {node: rank for rank, node in enumerate(nodes)},
        )
        call = run_script(
            script, common, per_node, hosts, job.id, self.workdirs, self.mesh, self.tag_output
        )
        futures = self.pool.submit_broadcast(call, nodes=nodes, any_slot=True)
        return self._supervise(job, phase, futures, ok=0, nodes=nodes)

    def _supervise(
        self,
        job: Job,
        phase: str,
        futures: list[Future[Any]],
        ok: int | None,
        nodes: list[int] | None = None,
    ) -> Failure | None:
        """Wait for a phase's calls (one per node, in rank order; ``nodes``: their node
        indices, default 0, 1...); on the first failure, stop the others. ``ok``: the
        value a script returns on success (None: any)."""
        where = nodes or list(range(len(futures)))
        job.active = futures
        if job.cancel_requested:
            self.pool.cancel(futures)
        pending = {f: rank for rank, f in enumerate(futures)}
        failure: Failure | None = None
        while pending:
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):
                rank = pending.pop(fut)
                try:
                    value = fut.result()
                except CancelledError:
                    if failure is not None:
                        failure.stopped.append(where[rank])
                    continue
                except Exception as e:
                    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                    found = Failure(where[rank], rank, phase, None, reason)
                else:
                    if ok is None or value == ok:
                        continue
                    how, _ = describe_exit(int(value))
                    found = Failure(where[rank], rank, phase, int(value), how)
                if failure is None:
                    failure = found
                    self.pool.cancel(list(pending))
                else:
                    failure.also.append(found)
        job.active = []
        if failure is not None:
            self._failed(failure)
        return failure

    def _failed(self, failure: Failure) -> None:
        """A phase failed (``failure``: its first failure, the others in it): nothing
        here; a subclass may keep it."""

    def _report(self, job: Job, failure: Failure) -> list[str]:
        """Root cause first: the failing node, how it failed, its last lines; then the
        nodes that failed too, then those stopped because of it."""
        who = node_name(failure.node, failure.rank)
        lines = [
            f"job {job.id} ({job.spec.name}) failed in {failure.phase}: {who} {failure.reason}"
        ]
        tail = list(job.tails.get(failure.node, ()))
        if tail:
            lines.append(f"last lines of {who}:")
            lines.extend(f"  {line}" for line in tail)
        for other in failure.also:
            lines.append(f"then {node_name(other.node, other.rank)} {other.reason}")
        if failure.stopped:
            names = ", ".join(node_name(r, r) for r in sorted(failure.stopped))
            lines.append(f"stopped because {who} failed: {names}")
        return lines
