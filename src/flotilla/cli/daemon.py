"""The cluster daemon: one process per named cluster, owning its pool.

``flotilla launch -c NAME`` starts it as ``python -m flotilla.cli.daemon NAME`` (its own
session, output to ``NAME/daemon.log``). It provisions the pool, then serves the CLI over
``NAME.sock`` (see ``ipc``; the socket's side is ``daemon_socket.DaemonSocket``): jobs are
queued and run as their nodes have room for them (``ledger.Ledger``: FIFO, several at once
when their resources allow), their output streamed to whoever follows them and kept per
node. It stops on ``flotilla down`` (and removes the cluster), on SIGTERM, and by itself
after ``--idle-minutes`` without jobs (the record stays, STOPPED). If it is killed, its
record shows STALE and its agents wait a while for a new daemon, which re-attaches to them
and to the running jobs (see ``adopt``); ``flotilla down NAME`` still removes it all.

``launch --down`` of a new cluster runs the same :class:`ClusterDaemon` inside the CLI
process instead (no second process to start).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .._client import mesh
from .._client.compute import Compute
from .._errors import FlotillaError, ProvisionError
from .._redaction import redact
from .._system import procs
from .._volume import Volume
from .._worker import Worker
from .adopt import (
    abandon,
    adoptable,
    grace,
    hold,
    keep_login,
    keeps_agents,
    login_for,
    release,
    requeue,
    restore,
    reveal,
    save_spec,
    take_over,
)
from .adopt import provider as reattaching
from .backends import registry
from .conventions import EXIT_LOST
from .daemon_socket import DaemonSocket
from .ipc import Event, prefix
from .jobs import Job, Runner, Subscriber, untag
from .jobspec import JobSpec, task_id
from .ledger import JOBS_PER_NODE, Allocation, Ledger, demand_of
from .node_ops import describe_nodes
from .observe import EventLog
from .state import (
    ClusterRecord,
    ClusterState,
    JobRecord,
    JobStatus,
    NodeRecord,
    Paths,
    delete,
    load_own,
    locked,
    update,
)

_CANCEL_WAIT = 30.0  # seconds a cancelled job gets to wind down before shutdown goes on


class OutputRouting:
    """A cluster daemon's routing of its nodes' lines to the running jobs they belong to
    (by their tag; ``node_ops.JOB_TAG``), the others to its own log."""

    running: dict[int, tuple[Job, Allocation | None]]
    secrets: set[str]

    def _job_of(self, line: str) -> tuple[Job | None, str]:
        """The running job a node's line belongs to (by its tag), and the line untagged."""
        job_id, clean = untag(line)
        entry = self.running.get(job_id) if job_id is not None else None
        return (entry[0] if entry is not None else None), clean

    def _on_output(self, node: int, stream: int, lines: list[str]) -> None:
        by_job: dict[int, tuple[Job, list[str]]] = {}
        stray: list[str] = []
        for line in lines:
            job, clean = self._job_of(line)
            if job is None:
                stray.append(clean)
            else:
                by_job.setdefault(job.id, (job, []))[1].append(clean)
        for job, mine in by_job.values():
            job.output(node, stream, mine)
        if stray:  # a background process of an earlier job: keep it in the daemon's log
            head = prefix(node, node)
            shown = [redact(line, self.secrets) for line in stray]
            sys.stderr.write("".join(f"{head}{line}\n" for line in shown))

    def _on_state(self, node: int, stream: int, text: str) -> None:
        job, clean = self._job_of(text)
        if job is not None:  # between jobs, a bar's final line still comes as output
            job.state(node, stream, clean)


class Adopting(OutputRouting):
    """A cluster daemon's side of re-attaching (see ``adopt``): the nodes, jobs and (on a
    cloud) client identities of a daemon that died, taken over."""

    paths: Paths
    generation: int
    backend: Any
    spec: Any
    token: str
    jobs: dict[int, Job]
    queue: deque[Job]
    runner: Runner | None

    def _init_adopting(self) -> None:
        self.adopting: list[NodeRecord] = []  # the nodes of a daemon that died, re-attached
        self.adopted: list[JobRecord] = []  # the jobs it ran, followed again
        self.again: list[JobRecord] = []  # the jobs it queued or set up, queued again
        self.reattach_key = ""
        self.clients: list[str] = []  # a cloud cluster's client identities (adopt.Leases)
        self.leases: Any = None

    def _take_over(self, rec: ClusterRecord) -> None:
        """The record's nodes, key, token and jobs, when they can be re-attached to."""
        self.adopting = list(rec.nodes) if adoptable(rec) else []
        self.reattach_key = rec.reattach_secret if self.adopting else secrets.token_hex(32)
        self.token = rec.token if self.adopting else self.token  # (its jobs' processes)
        self.clients = list(rec.clients) if self.adopting else []
        rec.reattach_secret = self.reattach_key
        self.adopted, self.again = take_over(rec, bool(self.adopting), self.paths)

    def _reach(self, provider: Any) -> Any:
        """``provider``, or the one reaching the dead daemon's nodes again."""
        if not self.adopting:
            return provider
        login = login_for(self.paths)  # (a cloud's: see adopt.keep_login)
        try:
            return reattaching(provider, self.adopting, self.reattach_key, login)
        except ProvisionError:  # a node is gone: the others' instances are released too
            abandon(provider, self.clients, self.backend, self.spec, self.paths)
            raise

    def _keep_agents(self, pool: Compute, provider: Any) -> None:
        """The pool's agents outlive this daemon, for a new one; a cloud's instances too."""
        if keeps_agents(provider):
            pool.keep_agents(grace(), self.reattach_key)
            self.leases = hold(provider, self.clients)
            with update(self.paths, self.generation) as rec:
                rec.clients = self.clients

    def _restore_jobs(self, running: dict[int, tuple[Job, Allocation | None]]) -> list[str]:
        """The dead daemon's jobs: the running ones followed (their lines come as soon as
        the pool is open), the others queued again before new ones; their secrets."""
        found = []
        for job in [restore(self.paths, j) for j in self.adopted]:
            self.jobs[job.id], running[job.id] = job, (job, None)
            found.extend(job.secrets)
        again = [requeue(self.paths, j) for j in self.again]
        self.jobs.update({job.id: job for job in again})
        found.extend(secret for job in again for secret in job.secrets)
        self.queue.extendleft(reversed(again))
        return found

    def _reap_again(self) -> None:
        """What a setup the dead daemon ran left: stopped before the job runs again."""
        assert self.runner is not None
        for queued in self.again:
            self.runner.reap(self.jobs[queued.id])

    def _release(self) -> None:
        if self.leases is not None:  # a cloud's: what a daemon that died rented, too
            release(self.leases, bool(self.adopting), self.backend, self.spec, self.paths)


class ClusterDaemon(Adopting):
    """A named cluster's pool and job queue; its socket is a :class:`DaemonSocket`."""

    def __init__(self, paths: Paths, generation: int | None = None) -> None:
        with locked(paths):  # the launching command writes the record under this lock
            record = load_own(paths, generation)
        self.generation = record.generation  # every change of the record checks it
        self.paths = paths
        self.name = paths.name
        self.spec = registry.spec_from_dict(record.provider)
        self.backend = registry.backend_for(self.spec)
        self.num_nodes = record.num_nodes
        self.volumes = [Volume(**v) for v in record.volumes]
        self.engines = list(record.engines)
        self.autodown = record.autodown  # the idle limit tears down instead of stopping
        self.idle = record.idle_minutes * 60 if record.idle_minutes is not None else None
        self.pool: Compute | None = None
        self.event_log: EventLog | None = None  # events.jsonl and top.json (observe.py)
        self.runner: Runner | None = None
        self.nodes: list[NodeRecord] = []
        self.error = ""  # why provisioning failed
        self.secrets: set[str] = set()  # every job's, to redact what they print later
        self.token = secrets.token_hex(6)  # in FLOTILLA_RUN_TOKEN of every job process
        self.up = threading.Event()  # set when provisioning ended, well or not
        self.notes: list[str] = []  # provisioning lines not told to a job yet
        self.jobs: dict[int, Job] = {}
        self.queue: deque[Job] = deque()
        self.running: dict[int, tuple[Job, Allocation | None]] = {}
        self.ledger: Ledger | None = None  # the nodes' room, once they are up
        self.cv = threading.Condition()
        self.stopping = False
        self.delete_on_stop = False
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.last_activity = time.time()
        self.socket = DaemonSocket(self)  # NAME.sock: how the CLI reaches this daemon
        self.provisioner: threading.Thread | None = None
        self.shutdown_lock = threading.Lock()
        self.refresh_lock = threading.Lock()
        self._init_adopting()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Take over the record, listen on the socket, start provisioning and the job loop."""
        with self._update() as rec:
            self._take_over(rec)  # a dead daemon's nodes and jobs, if they can be reached
            rec.pid = os.getpid()
            rec.pid_start = procs.start_time(rec.pid)
            rec.state = ClusterState.STARTING.value
            rec.error = ""
            rec.last_activity = self.last_activity
        self.socket.bind()
        self.provisioner = self._thread(self._provision, "provision")
        self._thread(self.socket.accept_forever, "accept")
        self._thread(self._job_loop, "jobs")

    def _thread(self, target: Any, name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=f"flotilla-{name}", daemon=True)
        t.start()
        return t

    def serve_forever(self) -> None:
        """Wait for a stop request, the idle limit or a failed provisioning; then stop."""
        while True:
            timeout = None
            with self.cv:
                busy = bool(self.running) or bool(self.queue)
                if self.stopping:
                    break
                if self.up.is_set() and self.error and not busy:
                    break  # provisioning failed and every job was told
                if self.idle is not None and not busy and self.up.is_set():
                    left = self.last_activity + self.idle - time.time()
                    if left <= 0:
                        what = "tearing down" if self.autodown else "stopping"
                        print(f"idle for {self.idle / 60:g} min: {what}", file=sys.stderr)
                        self.delete_on_stop = self.delete_on_stop or self.autodown
                        break
                    timeout = left
            self.wake.wait(timeout)
            self.wake.clear()
        self.shutdown()

    def set_autostop(self, minutes: float | None, down: bool) -> None:
        """Stop (``down``: tear down) the cluster after ``minutes`` without jobs, counted
        from now; None: never (``flotilla autostop --cancel``)."""
        with self.cv:
            self.idle = minutes * 60 if minutes is not None else None
            self.autodown = down and minutes is not None
            self.last_activity = time.time()
        with self._update() as rec:
            rec.idle_minutes = minutes
            rec.autodown = self.autodown
            rec.last_activity = self.last_activity
        self.wake.set()

    def request_stop(self, delete_record: bool) -> None:
        with self.cv:
            self.stopping = True
            self.delete_on_stop = self.delete_on_stop or delete_record
            self.cv.notify_all()
        self.wake.set()

    def shutdown(self) -> None:
        """Cancel the jobs, close the pool, then remove or update the record. Idempotent."""
        with self.shutdown_lock:
            if not self.stopped.is_set():
                self._shutdown()
        self.socket.join_handlers(2.0)  # let `down` and followers get their last answer

    def _shutdown(self) -> None:
        with self.cv:
            self.stopping = True
            pending = list(self.queue)
            self.queue.clear()
            current = [job for job, _ in self.running.values()]
            self.cv.notify_all()
        with contextlib.suppress(FlotillaError, OSError), self._update() as rec:
            if not self.error:
                rec.state = ClusterState.STOPPING.value
        for job in pending:  # not 130: that says Ctrl-C; the cluster went away under it
            down = [f"job {job.id} was cancelled: cluster down"]
            job.finish(JobStatus.CANCELLED, EXIT_LOST, down, save=self._save_job)
        for job in current:
            job.cancel_code, job.cancel_why = EXIT_LOST, ": cluster down"
            job.cancel_requested = True  # also when it still waits for provisioning
            if self.runner is not None:
                self.runner.cancel(job)
        for job in current:
            job.done.wait(_CANCEL_WAIT)
        if self.provisioner is not None:
            self.provisioner.join()
        if self.runner is not None:
            self.runner.reap_all()  # what jobs left running: `ray start` daemons and such
            if self.runner.mesh and self.pool is not None:
                with contextlib.suppress(Exception):  # best effort: nodes may be gone
                    mesh.disconnect(self.pool, self.workdirs, self.runner.mesh)
        if self.pool is not None:  # stopped: the nodes' disks stay (a provider that can)
            self.backend.before_close(self.pool.provider, keep=not self.delete_on_stop)
            self.pool.close()
            if self.event_log is not None:
                self.event_log.stop()
            record_cost(self, "down", self.pool)
        self._release()
        self.socket.close()
        if self.delete_on_stop:
            if self.autodown:  # what `down` does besides removing the record
                with contextlib.suppress(FlotillaError, OSError):
                    rec = load_own(self.paths, self.generation)
                    self.backend.on_down(self.paths, rec)
            delete(self.paths, self.generation)
        else:
            with contextlib.suppress(FlotillaError, OSError), self._update() as rec:
                rec.state = (ClusterState.FAILED if self.error else ClusterState.STOPPED).value
                rec.nodes = []
                rec.last_activity = self.last_activity
        self.stopped.set()

    def _update(self) -> contextlib.AbstractContextManager[ClusterRecord]:
        """The record, to change it, while it is still this daemon's generation."""
        return update(self.paths, self.generation)

    def _provision_note(self, text: str) -> None:
        """A line about provisioning (a fallback's candidates), for the daemon's log and
        the console of the job that waits for the cluster."""
        print(f"flotilla: {text}", file=sys.stderr, flush=True)
        with self.cv:
            self.notes.append(text)

    # -- provisioning ------------------------------------------------------------------
    def _provision(self) -> None:
        try:
            provider = self.backend.make_provider(self.spec, self.paths.nodes)
            provider = self._reach(provider)  # re-attaching: nothing is provisioned
            if hasattr(provider, "report"):  # a fallback: its choices reach the first job
                provider.report = self._provision_note
            wants = self.backend.pool_resources(self.spec)
            pool = Compute(
                provider,
                nodes=self.num_nodes,
                accelerator=wants.accelerator,
                vcpus=wants.vcpus,
                memory_gb=wants.memory_gb,
                max_hourly_cost=wants.max_hourly_cost,
                max_node_hourly_cost=wants.max_node_hourly_cost,
                volumes=self.volumes,
                plugins=engine_plugins(self.engines),
                worker=Worker(concurrency=JOBS_PER_NODE + 1),  # +1: syncs, ports, reaping
            )
            self.event_log = EventLog(self.paths)
            pool._observer.add_sink(self.event_log.sink)  # its events: `flotilla events`
            pool.listed = False  # `flotilla top` shows it as the cluster
            pool.output_sink = self._on_output
            pool.state_sink = self._on_state
            pool.on_replaced = self._on_replaced
            self._keep_agents(pool, provider)
            with self.cv:
                if self.stopping:
                    return
                self.secrets.update(self._restore_jobs(self.running))
            pool.open()
            for job, _ in list(self.running.values()):  # re-attached: its secrets' values
                reveal(job, pool, self.token)
                self.secrets.update(job.secrets)
            self.pool = pool
            self.event_log.start(pool.view)  # `flotilla top`
            if not self.adopting:  # (a re-attached cluster's run goes on)
                record_cost(self, "up", pool)
            shared = self.backend.shares_filesystem
            self.nodes = self.adopting or self._node_records()
            if self.leases is not None and not self.adopting:  # a cloud's: for a new daemon
                keep_login(self.backend, self.spec, self.paths, self.nodes)
            self.runner = Runner(
                pool,
                self.name,
                self.spec.kind,
                self.nodes,
                shared,
                self._save_job,
                self.token,
                candidate=getattr(provider, "chosen_index", None),  # a fallback's choice
            )
            self.runner.tag_output = True  # several jobs at once: their lines tell them apart
            self._reap_again()
            with self.cv:
                self.ledger = Ledger(self.nodes, JOBS_PER_NODE)
                for job, _ in list(self.running.values()):  # re-attached: followed again
                    where = self.ledger.take(job.demand, len(job.nodes))
                    self.running[job.id] = (job, where)
                    self._thread(lambda j=job, w=where: self._run(j, w, True), f"job-{job.id}")
            self._connect_nodes()
            with self._update() as rec:
                rec.state = ClusterState.UP.value
                rec.nodes = self.nodes
                rec.token = self.token
            self.backend.on_up(self.paths, self.spec, self.nodes)
        except BaseException as e:  # root cause first: the provider's own message
            self.error = str(e) or type(e).__name__
            print(f"provisioning failed: {self.error}", file=sys.stderr)
            with contextlib.suppress(FlotillaError, OSError), self._update() as rec:
                rec.state = ClusterState.FAILED.value
                rec.error = self.error
            with self.cv:  # the jobs it would have followed again
                lost, self.running = [j for j, _ in self.running.values()], {}
            for job in lost:
                job.finish(
                    JobStatus.FAILED,
                    EXIT_LOST,
                    [f"job {job.id} lost: {self.error}"],
                    save=self._save_job,
                )
        finally:
            self.up.set()
            self.wake.set()

    def _connect_nodes(self) -> None:
        """Let nodes that are separate machines reach each other over SSH (see mesh.py);
        not on SLURM (``srun --overlap`` is the way there) nor on this machine alone."""
        assert self.pool is not None and self.runner is not None
        if self.backend.shares_filesystem or any(n.scheduler_job for n in self.nodes):
            return
        if self.adopting:  # the daemon before connected them (its calls hold the slots)
            self.runner.mesh = self.token
            return
        self.runner.mesh = ""
        try:
            why = mesh.connect(self.pool, [n.ip for n in self.nodes], self.workdirs, self.token)
        except Exception as e:  # the cluster works without it: say why, carry on
            why = f"{type(e).__name__}: {e}"
        if why is None:
            self.runner.mesh = self.token
        else:
            print(f"the nodes cannot reach each other over ssh: {why}", file=sys.stderr)

    @property
    def workdirs(self) -> dict[int, str]:
        """Each node's working directory for jobs, by rank."""
        return {n.node: n.workdir for n in self.nodes}

    def _node_records(self) -> list[NodeRecord]:
        """What each node says of itself (address, host, working directory, agent pid)."""
        assert self.pool is not None
        subdir = "" if self.backend.shares_filesystem else f"clusters/{self.name}"
        return [NodeRecord(**f) for f in describe_nodes(self.pool, subdir)]

    def _on_replaced(self, ranks: list[int]) -> None:
        self._thread(self._refresh_nodes, "nodes")  # not on the pool's loop: it broadcasts

    def _refresh_nodes(self) -> None:
        """A node was replaced (a new machine at its rank): the records, which ``flotilla
        ssh`` and the next jobs use, follow the new machine. (A running job's calls queue
        before this one on the nodes: the records change when it ends.)"""
        with self.refresh_lock:
            if self.pool is None or self.runner is None:
                return  # still provisioning: the records are written when it ends
            try:
                nodes = self._node_records()
            except FlotillaError as e:
                print(f"could not describe the replaced node(s): {e}", file=sys.stderr)
                return
            with self.cv:
                if self.stopping:
                    return
                self.nodes[:] = nodes  # the runner holds this list
            self._connect_nodes()  # the new machine's host key and authorization
            if self.leases is not None:  # the new machine's login, for a new daemon
                keep_login(self.backend, self.spec, self.paths, self.nodes)
            with contextlib.suppress(FlotillaError, OSError), update(self.paths) as rec:
                rec.nodes = self.nodes  # (after: a record naming it says it is ready)
            self.backend.on_up(self.paths, self.spec, self.nodes)

    # -- jobs --------------------------------------------------------------------------
    def submit(self, spec: JobSpec, follow: bool = False) -> tuple[Job, Subscriber | None]:
        """Queue a job; it runs after the jobs before it, once its nodes have room for it.
        A job that could never fit the cluster is refused here. With ``follow``, a follower
        of all its events (output and end), subscribed before it is queued: a job of a few
        milliseconds may be over before its submitter would follow it."""
        with self.cv:
            if self.stopping:
                raise FlotillaError(f"cluster {self.name} is going down")
            ledger = self.ledger
        if ledger is not None:
            self._check_fits(ledger, spec)
        now = time.time()
        with self._update() as rec:
            job_id = rec.next_job
            rec.next_job += 1
            job = Job(job_id, spec, task_id(self.name, job_id, now), self.paths.job_dir(job_id))
            rec.jobs.append(job.record())
            rec.last_activity = now
        save_spec(job)
        sub = job.subscribe(None, replay=False)[1] if follow else None
        with self.cv:
            self.secrets.update(job.secrets)  # its background processes may print them later
            self.jobs[job_id] = job
            self.queue.append(job)
            self.last_activity = now
            self.cv.notify_all()
        return job, sub

    def _save_job(self, job: Job) -> None:
        if self.event_log is not None:
            self.event_log.job(job.id, job.status.value, job.spec.name or "")
        with contextlib.suppress(FlotillaError, OSError), self._update() as rec:
            rec.jobs = [job.record() if j.id == job.id else j for j in rec.jobs]
            rec.last_activity = time.time()

    def _check_fits(self, ledger: Ledger, spec: JobSpec) -> None:
        count = spec.num_nodes or len(ledger.sizes)
        candidate = self.runner.candidate if self.runner is not None else None
        why = ledger.refusal(demand_of(spec, candidate), count, self.name, spec.accelerator)
        if why:
            raise FlotillaError(why)

    def _next(self) -> tuple[Job, Allocation | None] | None:
        """The first queued job once its nodes have room (FIFO: a job waits for the ones
        before it), taken off the queue with its allocation; None when stopping."""
        self.up.wait()
        with self.cv:
            while True:
                if self.stopping:
                    return None
                if self.queue:
                    job = self.queue[0]
                    if self.ledger is None:  # the cluster did not start
                        return self.queue.popleft(), None
                    count = job.spec.num_nodes or len(self.nodes)
                    job.candidate = self.runner.candidate if self.runner is not None else None
                    why = self.ledger.refusal(job.demand, count, self.name, job.spec.accelerator)
                    if why:  # queued while the cluster started; it never fits
                        self.queue.popleft()
                        job.finish(
                            JobStatus.FAILED,
                            2,
                            [f"job {job.id} refused: {why}"],
                            save=self._save_job,
                        )
                        self.wake.set()
                        continue
                    where = self.ledger.take(job.demand, count)
                    if where is not None:
                        self.queue.popleft()
                        self.running[job.id] = (job, where)
                        return job, where
                self.cv.wait()

    def _job_loop(self) -> None:
        while True:
            taken = self._next()
            if taken is None:
                return
            job, where = taken
            with self.cv:
                notes, self.notes = self.notes, []
            for note in notes:
                job.phase(note)
            if self.runner is None or where is None:
                why = self.error or "it is going down"
                job.finish(
                    JobStatus.FAILED,
                    1,
                    [f"job {job.id} failed: cluster {self.name} could not start: {why}"],
                    save=self._save_job,
                )
                with self.cv:
                    self.last_activity = time.time()
                self.wake.set()  # nothing may be left to do: serve_forever decides
                continue
            self._thread(lambda j=job, w=where: self._run(j, w), f"job-{job.id}")

    def _run(self, job: Job, where: Allocation | None, adopted: bool = False) -> None:
        """Run one job on its allocation (``adopted``: follow it, a daemon that died ran
        it), then free it for the next ones."""
        assert self.runner is not None
        try:
            if adopted:
                self.runner.adopt(job, job.nodes)
            else:
                assert where is not None
                with self.refresh_lock:  # a replaced node's records and keys come first
                    pass
                self.runner.run(job, where)
        finally:
            with self.cv:
                self.running.pop(job.id, None)
                if self.ledger is not None and where is not None:
                    self.ledger.give_back(where)
                self.last_activity = time.time()
                self.cv.notify_all()
            if job.spec.down_after:
                self.request_stop(delete_record=True)
            self.wake.set()

    def cancel(self, job: Job) -> None:
        """Cancel a queued or running job and wait for it to end."""
        with self.cv:
            queued = job in self.queue
            if queued:
                self.queue.remove(job)
        if queued:
            job.finish(
                JobStatus.CANCELLED, 130, [f"job {job.id} was cancelled"], save=self._save_job
            )
        elif not job.done.is_set() and self.runner is not None:
            self.runner.cancel(job)
        job.done.wait(_CANCEL_WAIT)
        with self.cv:  # its nodes' room is free when `cancel` answers
            self.cv.wait_for(lambda: job.id not in self.running, _CANCEL_WAIT)


def record_cost(daemon: ClusterDaemon, event: str, pool: Compute) -> None:
    """A line of the cost ledger (``costs``): the pool is up (its provider, nodes and
    price per hour when known) or closed."""
    from .costs import record

    provider = getattr(pool.provider, "chosen", None) or pool.provider
    hourly = getattr(pool._allocation, "hourly", None)
    record(
        event,
        daemon.name,
        daemon.generation,
        daemon.paths.home,
        provider=getattr(provider, "name", daemon.spec.kind),
        nodes=pool.nodes,
        hourly=hourly if isinstance(hourly, int | float) and hourly else None,
    )


def engine_plugins(engines: list[str]) -> list[Any]:
    """The plugins that start a cluster's ``engines`` (a task file's ``engines``)."""
    from .. import plugins

    made: dict[str, Callable[[], Any]] = {"ray": plugins.ray, "dask": plugins.dask}
    return [made[name]() for name in engines]


def follow_local(job: Job, sub: Subscriber) -> Iterator[Event]:
    """Events of a job of a daemon in this process (``launch --down``), then its end:
    those ``sub`` (``submit(..., follow=True)``'s) gets."""
    try:
        while True:
            event: Event = sub.events.get()
            yield event
            if event["ev"] == "end":
                return
    finally:
        job.unsubscribe(sub)


def main(argv: list[str] | None = None) -> None:
    """``python -m flotilla.cli.daemon NAME [--ready-fd FD]``: run a cluster's daemon."""
    parser = argparse.ArgumentParser(prog="python -m flotilla.cli.daemon")
    parser.add_argument("name")
    parser.add_argument("--ready-fd", type=int, default=-1)
    parser.add_argument("--generation", type=int, default=None)
    args = parser.parse_args(argv)
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    daemon = ClusterDaemon(Paths(args.name), args.generation)
    signal.signal(signal.SIGTERM, lambda *_: daemon.request_stop(delete_record=False))
    signal.signal(signal.SIGINT, lambda *_: daemon.request_stop(delete_record=False))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    daemon.start()
    if args.ready_fd >= 0:
        with contextlib.suppress(OSError):
            os.write(args.ready_fd, b"1")
            os.close(args.ready_fd)
    daemon.serve_forever()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
