"""Worker slots (Skyward's Worker): each node runs up to `concurrency` calls at once, and
map / gather fill every slot of every node; a broadcast still runs once per node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import flotilla as sky


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.Compute]:
    with sky.Compute(nodes=2, worker=sky.Worker(concurrency=3)) as p:
        yield p


@sky.function
def meet_all(_: int, parties: int) -> tuple[int, int, int]:
    """Returns only once `parties` calls run at the same time (a barrier of them all)."""
    assert sky.barrier("slots", parties).wait(timeout=120), "the calls did not run at once"
    info = sky.instance_info()
    return info.node, info.worker, info.workers_per_node


@sky.function
def where() -> tuple[int, int, int, int]:
    info = sky.instance_info()
    return info.node, info.worker, info.global_worker_index, info.total_workers


def test_map_fills_every_slot_of_every_node(pool: sky.Compute) -> None:
    got = pool.map(meet_all, range(6), [6] * 6)
    assert sorted((node, worker) for node, worker, _ in got) == [
        (n, w) for n in range(2) for w in range(3)
    ]
    assert {per_node for _, _, per_node in got} == {3}


def test_gather_fills_every_slot(pool: sky.Compute) -> None:
    got = sky.gather(*(meet_all(i, 6) for i in range(6))) >> pool
    assert len({(node, worker) for node, worker, _ in got}) == 6


def test_a_broadcast_runs_once_per_node(pool: sky.Compute) -> None:
    assert [(n, w) for n, w, _, _ in where() @ pool] == [(0, 0), (1, 0)]
    assert {total for _, _, _, total in where() @ pool} == {6}


def test_options_worker_and_compute_worker_precedence() -> None:
    opts = sky.Options(worker=sky.Worker(concurrency=2, executor="thread"))
    with sky.Compute(nodes=1, options=opts) as p:
        assert p.worker.concurrency == 2
        assert sorted(w for _, w, _ in p.map(meet_all, range(2), [2, 2])) == [0, 1]
    assert sky.Compute(options=opts, worker=sky.Worker(4)).worker.concurrency == 4
    assert sky.Compute().worker == sky.Worker()


def test_bad_workers_are_refused() -> None:
    with pytest.raises(sky.ConfigurationError, match="concurrency"):
        sky.Worker(concurrency=0)
    with pytest.raises(sky.ConfigurationError, match="executor"):
        sky.Worker(executor="fiber")  # type: ignore[arg-type]
    with pytest.raises(sky.ConfigurationError, match="Worker"):
        sky.Compute(worker=4)  # type: ignore[arg-type]
    with pytest.raises(sky.ConfigurationError, match=r"Options\.worker"):
        sky.Options(worker=2)  # type: ignore[arg-type]
    assert sky.Worker().resolved_executor == "process"
    assert sky.Worker(executor="thread").resolved_executor == "thread"


# the pool builds an environment with joblib for its nodes first: ~15 s here, minutes on a
# machine as loaded as a shared CI runner (it timed out at the default 120 s under load 12-50)
@pytest.mark.timeout(600)
def test_joblib_fills_every_slot() -> None:
    joblib = pytest.importorskip("joblib")
    with sky.Compute(nodes=2, worker=sky.Worker(concurrency=2), plugins=[sky.plugins.joblib()]):
        got = joblib.Parallel(n_jobs=-1, batch_size=1)(
            joblib.delayed(meet_all.local)(i, 4) for i in range(4)
        )
    assert len({(node, worker) for node, worker, _ in got}) == 4


# -- Worker(executor="thread"): the slots are threads of one process ---------------------------
@sky.function
def in_a_thread_slot(_: int, parties: int) -> tuple[int, int, int, int]:
    """Meets the other calls (they run at once), then adds itself to a list kept in an
    imported module (one per process): the process, thread, slot and how many calls that
    process's list has seen."""
    import os
    import sys
    import threading
    import types

    seen = sys.modules.setdefault("_flotilla_test_seen", types.ModuleType("_seen"))
    assert sky.barrier("threads", parties).wait(timeout=120), "the calls did not run at once"
    seen.__dict__.setdefault("calls", []).append(sky.instance_info().worker)
    assert sky.barrier("appended", parties).wait(timeout=120)
    return os.getpid(), threading.get_ident(), sky.instance_info().worker, len(seen.calls)


@sky.function
def pid_and_slot() -> tuple[int, int]:
    import os

    return os.getpid(), sky.instance_info().worker


@sky.function
def dies() -> None:
    import os

    os._exit(3)


@sky.function
def waits_for(path: str) -> int:
    """Runs until ``path`` exists (or a minute passed)."""
    import os
    import time

    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()


@sky.function
def doubled(values: Iterator[int]) -> Iterator[int]:
    for v in values:
        yield 2 * v


def test_thread_slots_share_one_process_and_its_memory() -> None:
    with sky.Compute(nodes=1, worker=sky.Worker(concurrency=3, executor="thread")) as p:
        got = p.map(in_a_thread_slot, range(3), [3] * 3)
        streams = [doubled(iter(range(i, i + 20))) >> p for i in range(3)]  # in and out
        assert [list(s) for s in streams] == [[2 * v for v in range(i, i + 20)] for i in range(3)]
    assert len({pid for pid, _, _, _ in got}) == 1  # one process...
    assert len({thread for _, thread, _, _ in got}) == 3  # ...a thread per slot
    assert sorted(slot for _, _, slot, _ in got) == [0, 1, 2]
    assert {seen for _, _, _, seen in got} == {3}  # one module global, seen by all three


def test_process_slots_stay_processes() -> None:
    with sky.Compute(nodes=1, worker=sky.Worker(concurrency=2, executor="process")) as p:
        slots = p.map(in_a_thread_slot, range(2), [2, 2])
    assert len({pid for pid, _, _, _ in slots}) == 2


def test_a_thread_slot_that_dies_takes_the_others_calls_with_it_saying_so(
    tmp_path: Path,
) -> None:
    go = tmp_path / "go"
    with sky.Compute(nodes=1, worker=sky.Worker(concurrency=2, executor="thread")) as p:
        before, _ = pid_and_slot() >> p
        running = waits_for(str(go)) > p  # on one slot...
        with pytest.raises(sky.WorkerDiedError, match="exited with status 3"):
            dies() >> p  # ...while the other one's call ends the shared process
        with pytest.raises(sky.WorkerDiedError, match="thread slots"):
            running.result(timeout=120)
        go.touch()
        slots = p.map(in_a_thread_slot, range(2), [2, 2])  # both slots serve again...
        assert len({pid for pid, _, _, _ in slots}) == 1
        assert {pid for pid, _, _, _ in slots} != {before}  # ...in a new process


def test_a_thread_slots_timeout_replaces_the_process_for_every_slot(tmp_path: Path) -> None:
    go = tmp_path / "go"
    with sky.Compute(nodes=1, worker=sky.Worker(concurrency=2, executor="thread")) as p:
        running = waits_for(str(go)) > p  # on one slot...
        slow = sky.function(waits_for.fn, timeout=1)  # ...and the other's call times out
        with pytest.raises(sky.TaskTimeoutError):
            slow(str(tmp_path / "never")) >> p
        with pytest.raises(sky.WorkerDiedError, match=r"thread slots.*had to be stopped"):
            running.result(timeout=120)
        go.touch()
        assert len({pid for pid, _, _, _ in p.map(in_a_thread_slot, range(2), [2, 2])}) == 1
