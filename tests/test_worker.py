"""Worker slots (Skyward's Worker): each node runs up to `concurrency` calls at once, and
map / gather fill every slot of every node; a broadcast still runs once per node."""

from __future__ import annotations

from collections.abc import Iterator

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
