"""The controller of a managed pipeline: SkyPilot's multi-document task file, run as one
managed job whose tasks each run on a cluster of their own.

``flotilla jobs launch pipeline.yaml`` records the pipeline (a record with ``execution``
and its tasks' ids) and one record per task, writes the tasks' JobSpecs to the pipeline's
private ``request.json`` and starts ``python -m flotilla.cli.managed.pipeline ID``. This
process runs each task with a task :class:`~.controller.Controller` (in this process: the
task records name this pid as their controller):

* ``serial``: the tasks one after the other, each after the one before it succeeded; a
  task that fails (its own recoveries spent) or is cancelled stops the pipeline, and the
  tasks after it are recorded CANCELLED without running;
* ``parallel`` (a job group): every task at once; each task's cluster is started, then a
  barrier waits for all of them, so that each task's ``run`` gets the others' addresses
  (:func:`group_env`); one task failing cancels the others.

**Resuming.** The state lives in the records, written as it changes. When this process
is killed (SIGKILL, the machine rebooted), the next ``flotilla jobs`` command that looks at
the pipeline (``queue``, ``logs``, a following ``launch``) finds its controller gone and
starts a new one (:func:`~.commands.revive`). The new controller never runs a task that
succeeded again; a task that was running is cleaned up (what its cluster left on this
machine, by its run token) and run again from its ``setup``, with the same task id
(SKYPILOT_TASK_ID), so that it resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from typing import Any

from ..._errors import FlotillaError
from ..._system import procs
from ..state import read_json
from .cleanup import reap_leftovers
from .controller import Controller, serve
from .group import GroupBarrier
from .state import JobsHome, ManagedJobRecord, ManagedJobState


class PipelineController:
    """Runs a pipeline's tasks to the pipeline's end, resuming where a killed controller
    left it (see the module docstring)."""

    def __init__(self, home: JobsHome, pipeline_id: int) -> None:
        rec = home.load(pipeline_id)
        if rec is None or not rec.is_pipeline:
            raise FlotillaError(f"there is no managed pipeline {pipeline_id}")
        request = read_json(
            home.request(pipeline_id),
            lambda why: FlotillaError(f"the pipeline's request is unreadable: {why}"),
        )
        if request is None:
            raise FlotillaError(f"managed pipeline {pipeline_id} has no request.json")
        self.home = home
        self.id = pipeline_id
        self.record = rec
        self.requests: list[dict[str, Any]] = request["tasks"]
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.running: list[Controller] = []

    def _set(self, **changes: Any) -> None:
        with contextlib.suppress(FlotillaError, OSError), self.home.update(self.id) as rec:
            for name, value in changes.items():
                setattr(rec, name, value)
            self.record = rec

    def note(self, text: str) -> None:
        """A message in the pipeline's log (``flotilla: ...``) and this process's log."""
        with open(self.home.log(self.id), "a", encoding="utf-8") as f:
            f.write(f"flotilla: {text}\n")
        print(text, file=sys.stderr)

    def _task(self, index: int) -> ManagedJobRecord:
        rec = self.home.load(self.record.tasks[index])
        if rec is None:
            raise FlotillaError(f"the record of the pipeline's task {index + 1} is missing")
        return rec

    def _label(self, rec: ManagedJobRecord) -> str:
        return f"task {rec.index + 1}/{len(self.record.tasks)} ({rec.name}, job {rec.id})"

    def _prepare(self, rec: ManagedJobRecord) -> ManagedJobState:
        """A task's state as this controller takes the pipeline over. A task that was
        running under a controller that is gone is cleaned up and made PENDING again, to
        run again with the same task id."""
        state = ManagedJobState(rec.state)
        if state.finished or (state is ManagedJobState.PENDING and not rec.pid):
            return state
        reap_leftovers(self.home, rec)
        with self.home.update(rec.id) as r:
            r.state = ManagedJobState.PENDING.value
            r.pid = r.pid_start = 0
            r.recoveries += 1
            r.error = ""
        self.note(
            f"{self._label(rec)} was {state.value} when the pipeline's controller stopped: "
            f"running it again (same task id {rec.task_id})"
        )
        return ManagedJobState.PENDING

    def _controller(self, rec: ManagedJobRecord, group: GroupBarrier | None) -> Controller:
        controller = Controller(self.home, rec.id, self.requests[rec.index], group)
        with self.lock:
            self.running.append(controller)
            if self.cancelled.is_set():
                controller.cancel()
        return controller

    def run(self) -> int:
        """Run (or resume) the pipeline to its end; its exit status. Never raises."""
        resumed = self.record.state != ManagedJobState.PENDING.value
        now = time.time()
        self._set(
            pid=os.getpid(),
            pid_start=procs.start_time(os.getpid()),
            state=ManagedJobState.RUNNING.value,
            started=self.record.started or now,
            recoveries=self.record.recoveries + resumed,
        )
        if resumed:
            self.note(
                f"managed pipeline {self.id}: a new controller (pid {os.getpid()}) resumes it"
            )
        try:
            if self.record.execution == "parallel":
                state, error = self._parallel()
            else:
                state, error = self._serial()
        except BaseException as e:  # a bug or the machine: never leave the pipeline unfinished
            state, error = ManagedJobState.FAILED, f"the pipeline's controller failed: {e!r}"
        for i in range(len(self.record.tasks)):  # what never ran: recorded as not run
            with contextlib.suppress(FlotillaError, OSError):
                rec = self._task(i)
                if rec.state == ManagedJobState.PENDING.value:
                    with self.home.update(rec.id) as r:
                        r.state = ManagedJobState.CANCELLED.value
                        r.error = f"not run: {error or 'the pipeline ended'}"
                        r.ended = time.time()
        code = {ManagedJobState.SUCCEEDED: 0, ManagedJobState.CANCELLED: 130}.get(state, 1)
        if state is ManagedJobState.SUCCEEDED:
            self.note(f"managed pipeline {self.id} succeeded")
        else:
            self.note(f"managed pipeline {self.id} {state.value}: {error}")
        self._set(state=state.value, exit_code=code, error=error, ended=time.time())
        with contextlib.suppress(OSError):
            os.unlink(self.home.request(self.id))
        return code

    def _serial(self) -> tuple[ManagedJobState, str]:
        for i in range(len(self.record.tasks)):
            rec = self._task(i)
            state = self._prepare(rec)
            if state is ManagedJobState.SUCCEEDED:
                continue
            if state.finished:  # ended before a controller restart: the pipeline ends so
                return state, f"{self._label(rec)} {state.value}: {rec.error}"
            if self.cancelled.is_set():
                return ManagedJobState.CANCELLED, "cancelled"
            self.note(f"{self._label(rec)} starts (task id {rec.task_id})")
            self._controller(rec, None).run()
            rec = self._task(i)
            if rec.state != ManagedJobState.SUCCEEDED.value:
                final = ManagedJobState(rec.state)
                if self.cancelled.is_set():
                    final = ManagedJobState.CANCELLED
                return final, f"{self._label(rec)} {rec.state}: {rec.error}"
        return ManagedJobState.SUCCEEDED, ""

    def _parallel(self) -> tuple[ManagedJobState, str]:
        records = [self._task(i) for i in range(len(self.record.tasks))]
        states = [self._prepare(rec) for rec in records]
        bad = [
            (rec, s)
            for rec, s in zip(records, states, strict=True)
            if s.finished and s is not ManagedJobState.SUCCEEDED
        ]
        if bad:
            rec, s = bad[0]
            return s, f"{self._label(rec)} {s.value}: {rec.error}"
        todo = [rec for rec, s in zip(records, states, strict=True) if not s.finished]
        group = GroupBarrier(self.record.name, [rec.name for rec in todo])
        controllers = [self._controller(rec, group) for rec in todo]
        first_bad: list[ManagedJobRecord] = []

        def one(controller: Controller, rec: ManagedJobRecord) -> None:
            controller.run()
            final = self.home.load(rec.id) or rec
            if final.state != ManagedJobState.SUCCEEDED.value and not self.cancelled.is_set():
                with self.lock:
                    first_bad.append(final)
                self.note(f"{self._label(final)} {final.state}: cancelling the other tasks")
                self.cancel()

        self.note(f"job group {self.record.name}: {len(todo)} task(s) start at once")
        threads = [
            threading.Thread(target=one, args=(c, r), daemon=True)
            for c, r in zip(controllers, todo, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if first_bad:
            rec = first_bad[0]
            return ManagedJobState(rec.state), f"{self._label(rec)} {rec.state}: {rec.error}"
        if self.cancelled.is_set():
            return ManagedJobState.CANCELLED, "cancelled"
        return ManagedJobState.SUCCEEDED, ""

    def cancel(self) -> None:
        """Cancel the pipeline: the running tasks are cancelled, the others never start."""
        self.cancelled.set()
        with self.lock:
            running = list(self.running)
        for controller in running:
            controller.cancel()


def main(argv: list[str] | None = None) -> None:
    """``python -m flotilla.cli.managed.pipeline ID [--ready-fd FD]``."""
    parser = argparse.ArgumentParser(prog="python -m flotilla.cli.managed.pipeline")
    parser.add_argument("pipeline", type=int)
    parser.add_argument("--ready-fd", type=int, default=-1)
    args = parser.parse_args(argv)
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    controller = PipelineController(JobsHome(), args.pipeline)

    def cancel(*_: Any) -> None:  # not in the handler: it takes locks the main thread holds
        threading.Thread(target=controller.cancel, daemon=True).start()

    serve(controller, args.ready_fd, cancel)


if __name__ == "__main__":
    main()
