"""The managed-job controller: one process per managed job, outliving ``jobs launch``.

``flotilla jobs launch`` starts it as ``python -m flotilla.cli.managed.controller ID``
(its own session, output to ``ID/controller.log``) and writes the job (a JobSpec, with its
variables and secrets, plus the cluster's provider) into its stdin: the job's values never
touch the disk. The controller then owns the job until it ends:

1. provision the job's own cluster (a pool on the job's provider), sync, ``setup`` on every
   node, ``run`` on every node (the CLI's :class:`~flotilla.cli.jobs.Runner`, so phases,
   variables, reports and logs are those of ``flotilla launch``);
2. when an attempt ends badly, tell a **lost node** (its agent or host went away: a phase
   call failed without an exit status, or a node does not answer afterwards) from a
   **failed program** (an exit status), and ask the job's :class:`RecoveryPolicy`;
3. recover: kill what the attempt left running, then replace the lost nodes or tear the
   cluster down and launch a new one, and run ``setup`` and ``run`` again on every node
   with the same FLOTILLA_TASK_ID / SKYPILOT_TASK_ID, so the program resumes from its
   checkpoint;
4. tear the cluster down when the job ends (succeeded, failed, cancelled).

SIGTERM (``flotilla jobs cancel``) cancels the job. If the controller itself is killed,
its pool's agents notice the client is gone and exit; ``jobs cancel`` then reaps what the
job left by its run token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from ..._client.compute import Compute, PoolState
from ..._client.function import function
from ..._errors import FlotillaError
from ..._providers.base import Options
from ..._system import procs
from ..._volume import Volume
from ...events import JobState
from ..backends import registry
from ..jobs import Failure, Job, Runner
from ..jobspec import JobSpec, task_id
from ..node_ops import describe_nodes
from ..observe import EVENTS, append_event
from ..state import JobStatus, NodeRecord
from .recovery import Cause, JobRecovery, RecoveryPolicy
from .state import JobsHome, ManagedJobState

if TYPE_CHECKING:
    from .group import GroupBarrier

PROBE_TIMEOUT = 10.0
"""Seconds a node has to answer the controller's probe after a failed attempt."""
RELAUNCH_TRIES = 3
"""Attempts at getting the cluster back during a recovery before the job fails."""
RELAUNCH_BACKOFF = 2.0
"""Seconds before the second relaunch attempt; doubled after each failure."""


@function
def alive() -> int:
    """This node's executor pid: answers when the node is alive."""
    return os.getpid()


class _Runner(Runner):
    """The CLI's Runner, keeping the first failure of the attempt's phases: whether it has
    an exit status tells a failed program from a lost node."""

    failure: Failure | None = None

    def _failed(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure


def _infra_failure(failure: Failure) -> bool:
    """Whether a phase failed because a node's process or agent died under it (no exit
    status) rather than because the program exited non-zero."""
    return failure.code is None or any(f.code is None for f in failure.also)


def _exit_codes(failure: Failure) -> list[int]:
    codes = [failure.exit_code] + [f.exit_code for f in failure.also if f.code is not None]
    return [c for i, c in enumerate(codes) if c not in codes[:i]]


class Controller:
    """Runs one managed job to its end, recovering it as its ``job_recovery`` says.

    Args:
        home: where the job's record and logs are.
        job_id: the job.
        request: what ``jobs launch`` sent: {"job": JobSpec as a dict}.
    """

    def __init__(
        self,
        home: JobsHome,
        job_id: int,
        request: dict[str, Any],
        group: GroupBarrier | None = None,
    ) -> None:
        rec = home.load(job_id)
        if rec is None:
            raise FlotillaError(f"there is no managed job {job_id}")
        self.home = home
        self.id = job_id
        self.record = rec
        self.spec = JobSpec.from_dict(request["job"])
        self.provider = registry.spec_from_dict(rec.provider)
        self.backend = registry.backend_for(self.provider)
        self.policy = RecoveryPolicy(JobRecovery.from_dict(rec.recovery))
        self.last_candidate: int | None = None
        """Where a fallback cluster last ran (its candidate's position, as given)."""
        self.cluster = f"{rec.name}-{job_id}"
        self.task_id = rec.task_id or task_id(self.cluster, job_id, rec.submitted)
        self.token = secrets.token_hex(6)
        self.pool: Compute | None = None
        self.runner: _Runner | None = None
        self.job: Job | None = None
        self.lock = threading.Lock()  # guards pool/runner/job against the canceller
        self.cancelled = threading.Event()
        self.group = group
        """A job group's barrier (``pipeline``): every task's cluster is up before any
        runs, and each learns the others' addresses."""

    # -- the record and the job's log -------------------------------------------------------
    def _set(self, **changes: Any) -> None:
        was = self.record.state
        with contextlib.suppress(FlotillaError, OSError), self.home.update(self.id) as rec:
            for name, value in changes.items():
                setattr(rec, name, value)
            self.record = rec
        if "state" in changes and changes["state"] != was:  # `flotilla events ID`
            why = str(changes.get("error") or "")
            event = JobState(job=str(self.id), state=str(changes["state"]), detail=why)
            append_event(self.home.dir(self.id) / EVENTS, event)

    def note(self, text: str) -> None:
        """A controller message in the job's log (``flotilla: ...``) and its own log."""
        with open(self.home.log(self.id), "a", encoding="utf-8") as f:
            f.write(f"flotilla: {text}\n")
        print(text, file=sys.stderr)

    def _on_output(self, node: int, stream: int, lines: list[str]) -> None:
        job = self.job
        if job is not None and not job.done.is_set():
            job.output(node, stream, lines)
        else:  # a straggler between attempts: keep it in the controller's log
            sys.stderr.write("".join(f"(node-{node}) {line}\n" for line in lines))

    def _on_status(self, job: Job) -> None:
        if job.status is JobStatus.RUNNING:
            now = time.time()
            self._set(
                state=ManagedJobState.RUNNING.value,
                run_started=now,
                started=self.record.started or now,
            )

    # -- the job -----------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to its end; the job's exit status. Never raises."""
        self._set(
            pid=os.getpid(),
            pid_start=procs.start_time(os.getpid()),
            state=ManagedJobState.STARTING.value,
            token=self.token,
            task_id=self.task_id,
        )
        try:
            state, code, error = self._attempts()
        except BaseException as e:  # a bug or the machine: never leave the job unfinished
            state, code, error = ManagedJobState.FAILED, 1, f"the controller failed: {e!r}"
        finally:
            self._teardown()
            shutil.rmtree(self.home.nodes(self.id), ignore_errors=True)
        if state is ManagedJobState.SUCCEEDED:
            self.note(f"managed job {self.id} succeeded (recoveries: {self.policy.recoveries})")
        else:
            self.note(f"managed job {self.id} {state.value}: {error}")
        self._set(state=state.value, exit_code=code, error=error, ended=time.time())
        return code

    def _attempts(self) -> tuple[ManagedJobState, int, str]:
        """Provision, run, recover until the job ends: (final state, exit code, why)."""
        try:
            self._provision()
            if self.group is not None:
                runner = self.runner
                assert runner is not None
                found = self.group.arrive(
                    self.record.name, [n.ip for n in runner.nodes], self.cancelled
                )
                self.spec = replace(self.spec, envs={**found, **self.spec.envs})
        except Exception as e:
            if self.group is not None:
                self.group.fail(self.record.name)
            if self.cancelled.is_set():
                return ManagedJobState.CANCELLED, 130, "cancelled while the cluster started"
            return ManagedJobState.FAILED, 1, f"the cluster could not start: {_why(e)}"
        while True:
            if self.cancelled.is_set():
                return ManagedJobState.CANCELLED, 130, "cancelled"
            job = Job(self.id, self.spec, self.task_id, self.home.dir(self.id))
            with self.lock:
                self.job = job
                runner = self.runner
                job.cancel_requested = self.cancelled.is_set()
            assert runner is not None
            runner.failure = None
            runner.run(job)
            if job.status is JobStatus.SUCCEEDED:
                return ManagedJobState.SUCCEEDED, 0, ""
            if self.cancelled.is_set() or job.status is JobStatus.CANCELLED:
                return ManagedJobState.CANCELLED, 130, "cancelled"
            failure = runner.failure
            lost = self._probe()
            codes: list[int] = []
            if lost or (failure is not None and _infra_failure(failure)):
                cause = Cause.NODE_LOST
            elif failure is not None:
                cause, codes = Cause.PROGRAM_FAILED, _exit_codes(failure)
            else:  # the job could not run at all (too few nodes, GPUs, a vanished workdir)
                return ManagedJobState.FAILED, job.exit_code or 1, _first(job.report)
            decision = self.policy.decide(cause, codes)
            if not decision.recover:
                return (
                    ManagedJobState.FAILED,
                    job.exit_code or 1,
                    (f"{_first(job.report)}; {decision.reason}"),
                )
            self._set(
                state=ManagedJobState.RECOVERING.value,
                recoveries=self.policy.recoveries,
                restarts_on_errors=self.policy.restarts_on_errors,
            )
            gone = set(lost)
            if failure is not None:
                gone |= {f.node for f in (failure, *failure.also) if f.code is None}
            what = f"node(s) {', '.join(map(str, sorted(gone)))} lost; " if gone else ""
            self.note(f"recovery {self.policy.recoveries}: {what}{decision.reason}")
            if decision.delay and self.cancelled.wait(decision.delay):
                return ManagedJobState.CANCELLED, 130, "cancelled during a recovery"
            try:
                self._recover(cause, lost)
            except Exception as e:
                if self.cancelled.is_set():
                    return ManagedJobState.CANCELLED, 130, "cancelled during a recovery"
                return ManagedJobState.FAILED, 1, f"the cluster could not be recovered: {_why(e)}"

    def _probe(self, timeout: float = PROBE_TIMEOUT) -> list[int]:
        """Ranks whose nodes do not answer within ``timeout`` s (every rank when the pool
        is unusable). A node the pool is replacing answers once it is back."""
        pool = self.pool
        if pool is None:
            return []
        everyone = list(range(self.record.num_nodes))
        if pool.state is not PoolState.RUNNING:
            return everyone
        futures: dict[int, Future[Any]] = {}
        lost: list[int] = []
        for rank in everyone:  # one by one: a lost node refuses its call at once
            try:
                futures[rank] = pool.submit_broadcast(alive(), nodes=[rank])[0]
            except Exception:
                lost.append(rank)
        wait(list(futures.values()), timeout)
        lost += [r for r, f in futures.items() if not f.done() or f.exception() is not None]
        return sorted(lost)

    def _recover(self, cause: Cause, lost: list[int]) -> None:
        """Get the cluster back for another attempt: the same one after a failed program;
        after a lost node, with FAILOVER the same pool once it has replaced the lost nodes
        (when it cannot, or with EAGER_NEXT_REGION, a new cluster)."""
        if cause is Cause.PROGRAM_FAILED:
            return  # the Runner killed what the attempt left; setup and run start over
        pool = self.pool
        if self.policy.recovery.strategy == "FAILOVER" and pool is not None:
            if not self._probe(pool.options.start_timeout + PROBE_TIMEOUT):
                self._attach(pool)  # new nodes: their facts, a Runner that syncs them
                return
            self.note("the lost node(s) could not be replaced: launching a new cluster")
        self._teardown()
        delay = RELAUNCH_BACKOFF
        for attempt in range(1, RELAUNCH_TRIES + 1):
            try:
                self._provision()
                return
            except Exception as e:
                self._teardown()
                if attempt == RELAUNCH_TRIES or self.cancelled.is_set():
                    raise
                self.note(f"the cluster could not start ({_why(e)}); again in {delay:g} s")
                if self.cancelled.wait(delay):
                    raise
                delay *= 2

    def _provision(self) -> None:
        """Start the job's cluster and its Runner."""
        started = time.monotonic()
        provider = self.backend.make_provider(self.provider, self.home.nodes(self.id))
        from ..._providers.fallback import Fallback

        last = self.last_candidate
        if last is not None and isinstance(provider, Fallback):
            # a fallback's relaunch (EAGER_NEXT_REGION): the next candidate first
            provider.next_after(last)
            self.note(f"recovering on the candidate after {provider.candidates[-1]!r} first")
        volumes = [Volume(**v) for v in self.record.volumes]
        pool = Compute(
            provider, nodes=self.record.num_nodes, options=self._options(), volumes=volumes
        )
        pool.output_sink = self._on_output
        with self.lock:
            self.pool = pool
        if self.cancelled.is_set():
            raise FlotillaError("cancelled")
        pool.open()
        chosen = provider.chosen_index if isinstance(provider, Fallback) else None
        if isinstance(provider, Fallback) and chosen is not None:  # as given
            self.last_candidate = (chosen + (last + 1 if last is not None else 0)) % len(
                provider.candidates
            )
        self._attach(pool)
        self.note(
            f"cluster {self.cluster}: {self.record.num_nodes} {self.provider.kind} node(s) up "
            f"in {time.monotonic() - started:.2f} s"
        )

    def _options(self) -> Options:
        """The pool's options: FAILOVER lets the pool replace lost nodes at their rank;
        EAGER_NEXT_REGION relaunches the whole cluster, so the pool does not bother."""
        return Options(replace_lost_nodes=self.policy.recovery.strategy == "FAILOVER")

    def _attach(self, pool: Compute) -> None:
        """A Runner for ``pool``'s current nodes (new ones sync and set up again)."""
        shares = self.backend.shares_filesystem
        facts = describe_nodes(pool, "" if shares else f"managed/{self.id}")
        nodes = [NodeRecord(**f) for f in facts]
        runner = _Runner(
            pool,
            self.cluster,
            self.provider.kind,
            nodes,
            shares,
            self._on_status,
            self.token,
            candidate=self.last_candidate,
        )
        with self.lock:
            self.runner = runner
        paths, _ = self.home.cluster(self.record)
        self.backend.on_up(paths, self.provider, nodes)

    def _teardown(self) -> None:
        """Stop everything the job's cluster runs: the job's processes (also those that
        left their process group), the agents, the machines. Idempotent."""
        with self.lock:
            pool, runner = self.pool, self.runner
            self.pool = self.runner = None
        if runner is not None:
            runner.reap_all()
        if pool is not None:
            with contextlib.suppress(Exception):
                pool.close()
        paths, record = self.home.cluster(self.record)
        record.token = self.token
        self.backend.on_down(paths, record)  # e.g. what a lost agent left on this machine

    # -- cancellation --------------------------------------------------------------------------
    def cancel(self) -> None:
        """Cancel the job (from a signal handler: the work is done on a thread)."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            threading.Thread(target=self._cancel_running, daemon=True).start()

    def _cancel_running(self) -> None:
        with self.lock:
            runner, job = self.runner, self.job
        if runner is not None and job is not None and not job.done.is_set():
            runner.cancel(job)


class _ToJobLog(logging.Handler):
    """The pool's own messages (node k lost, replacing, back after N s) into the job's
    log, where ``jobs logs`` shows them, and the controller's."""

    def __init__(self, controller: Served) -> None:
        super().__init__(logging.INFO)
        self.controller = controller

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.controller.note(self.format(record))


def _why(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _first(report: list[str]) -> str:
    return report[0] if report else "the job failed"


def main(argv: list[str] | None = None) -> None:
    """``python -m flotilla.cli.managed.controller ID [--ready-fd FD]``; the job comes as
    JSON on stdin."""
    parser = argparse.ArgumentParser(prog="python -m flotilla.cli.managed.controller")
    parser.add_argument("job", type=int)
    parser.add_argument("--ready-fd", type=int, default=-1)
    args = parser.parse_args(argv)
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    request = json.load(sys.stdin)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    controller = Controller(JobsHome(), args.job, request)
    serve(controller, args.ready_fd, lambda *_: controller.cancel())


class Served(Protocol):
    """A controller :func:`serve` runs: a managed job's (:class:`Controller`) or a
    pipeline's (``pipeline.PipelineController``)."""

    def _set(self, **changes: Any) -> None: ...

    def note(self, text: str) -> None: ...

    def run(self) -> int: ...


def serve(controller: Served, ready_fd: int, cancel: Callable[..., None]) -> NoReturn:
    """Run ``controller`` as this process: the pool's messages go to its log, SIGTERM and
    SIGINT call ``cancel`` (a signal handler), SIGHUP is ignored; it records this process
    as its controller, says it is ready on ``ready_fd`` (-1: none), runs, and the process
    exits with its status."""
    logging.getLogger("flotilla").addHandler(_ToJobLog(controller))
    signal.signal(signal.SIGTERM, cancel)
    signal.signal(signal.SIGINT, cancel)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    controller._set(pid=os.getpid(), pid_start=procs.start_time(os.getpid()))
    if ready_fd >= 0:
        with contextlib.suppress(OSError):
            os.write(ready_fd, b"1")
            os.close(ready_fd)
    code = controller.run()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
