"""The agent's scheduling policy (``_node/batching.py``): SCHED_BATCH while tasks queue on
its executor, the normal policy otherwise; executors always run tasks with the normal one.
Real local pools; each task reads its own policy and its agent's (its parent's)."""

from __future__ import annotations

import os
import sys

import pytest

import flotilla as sky

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="scheduling policies are Linux's"
)


@sky.function
def policies(until: int | None = None) -> tuple[int, int]:
    """(this process's policy, its agent's), once the agent's is ``until`` (or 30 s)."""
    import os
    import time

    agent = os.getppid()
    end = time.monotonic() + 30
    while until is not None and os.sched_getscheduler(agent) != until:
        if time.monotonic() > end:
            break
        time.sleep(0.001)
    return os.sched_getscheduler(0), os.sched_getscheduler(agent)


@sky.function
def die_once_batched() -> None:
    """End this executor while its agent runs as SCHED_BATCH: the agent forks another."""
    import os
    import time

    end = time.monotonic() + 30
    while os.sched_getscheduler(os.getppid()) != os.SCHED_BATCH and time.monotonic() < end:
        time.sleep(0.001)
    os._exit(3)


def test_a_queue_makes_the_agent_batch_and_a_lone_call_finds_it_normal() -> None:
    with sky.Compute(nodes=1) as pool:
        assert policies() >> pool == (os.SCHED_OTHER, os.SCHED_OTHER)  # a lone call
        queued = pool._submit_many([policies(os.SCHED_BATCH)] + [policies()] * 12)
        assert queued[0].result() == (os.SCHED_OTHER, os.SCHED_BATCH)
        assert all(f.result()[0] == os.SCHED_OTHER for f in queued)  # tasks: normal
        assert policies(os.SCHED_OTHER) >> pool == (os.SCHED_OTHER, os.SCHED_OTHER)


def test_an_executor_forked_while_the_agent_is_batch_runs_tasks_normally() -> None:
    with sky.Compute(nodes=1) as pool:
        queued = pool._submit_many(
            [die_once_batched(), policies(os.SCHED_BATCH)] + [policies()] * 12
        )
        with pytest.raises(sky.WorkerDiedError):
            queued[0].result()
        assert queued[1].result() == (os.SCHED_OTHER, os.SCHED_BATCH)  # the new executor's
