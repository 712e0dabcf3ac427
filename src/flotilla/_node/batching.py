"""The agent's scheduling policy: SCHED_BATCH while its executors work through a queue.

With a queue of quick tasks (a ``gather`` of thousands), every result an executor writes
woke the agent, and the woken agent took the CPU from the executor at once (Linux's wakeup
preemption): two context switches per call, the largest cost per call on a busy machine.
A ``SCHED_BATCH`` process does not preempt the one running when it wakes: the executor
goes on with the tasks given to it ahead, and the agent then takes several results at
once (about 15 % more calls per second on 2 CPUs). A lone call (``>>``) is never queued
behind others, so the agent keeps the normal policy then, and answers at once.

Only an agent started with the normal policy (``SCHED_OTHER``) switches; executors are
forked with the normal policy whatever the agent's is at the time. Where the system call
is missing or refused (another OS, a sandbox), nothing changes.
"""

from __future__ import annotations

import os


class Policy:
    """Switches this process between SCHED_OTHER and SCHED_BATCH (see the module).

    Attributes:
        batch: whether this process runs as SCHED_BATCH now.
    """

    def __init__(self) -> None:
        self.batch = False
        try:
            self._able = os.sched_getscheduler(0) == os.SCHED_OTHER
        except (AttributeError, OSError):  # not Linux, or not allowed
            self._able = False

    def set(self, batch: bool) -> None:
        """Run as SCHED_BATCH (``batch``) or with the normal policy again."""
        if batch == self.batch or not self._able:
            return
        try:
            os.sched_setscheduler(0, _policy(batch), os.sched_param(0))
        except OSError:  # refused: stay as we are from now on
            self._able = False
            return
        self.batch = batch

    def in_child(self) -> None:
        """In a process just forked (an executor): the normal policy, for the task."""
        if self.batch:
            try:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass


def _policy(batch: bool) -> int:
    return os.SCHED_BATCH if batch else os.SCHED_OTHER
