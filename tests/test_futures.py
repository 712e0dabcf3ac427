"""A pool's call futures (``_client/futures.py``): real ``concurrent.futures.Future`` objects
whose batch shares one condition; a sibling's result must never end another's wait."""

from __future__ import annotations

import os
import threading
from concurrent.futures import (
    FIRST_COMPLETED,
    Future,
    InvalidStateError,
    TimeoutError,
    as_completed,
    wait,
)
from pathlib import Path

import pytest

import flotilla as sky
from flotilla._client.calls import SEND_CHUNK
from flotilla._client.futures import Batch, CallFuture


def test_a_siblings_result_does_not_end_the_wait_for_another() -> None:
    batch = Batch(2)
    shared = batch.condition
    first, second = CallFuture[int](batch), CallFuture[int](batch)
    waiting = threading.Event()  # the waiter is about to wait
    got: list[object] = []

    def waiter() -> None:
        waiting.set()
        try:
            got.append(second.result())  # no timeout: the base class raised TimeoutError
        except BaseException as e:  # on the first wake-up (the sibling's notify_all)
            got.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    waiting.wait()
    for _ in range(1_000_000):  # until the waiter waits on the shared condition
        with shared:
            if shared._waiters:  # type: ignore[attr-defined]
                first.set_result(1)  # wakes the waiter: its own future is not settled
                break
    assert first.done()
    for _ in range(1_000_000):  # until it waits again (ours) or has given up (the base's)
        with shared:
            if shared._waiters or not t.is_alive():  # type: ignore[attr-defined]
                break
    second.set_result(2)
    t.join(10)
    assert got == [2]


def test_a_timeout_still_ends_the_wait() -> None:
    batch = Batch(2)
    pending, other = CallFuture[int](batch), CallFuture[int](batch)
    other.set_result(1)
    with pytest.raises(TimeoutError):
        pending.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        pending.exception(timeout=0)
    assert not pending.done()


@pytest.mark.parametrize("batched", [True, False])
def test_it_behaves_as_a_future(batched: bool) -> None:
    """A batch's futures, and lone ones (whose condition is made on first use)."""
    batch = Batch(3) if batched else None
    futures = [CallFuture[int](batch) for _ in range(3)]
    assert all(isinstance(f, Future) and f.running() and not f.done() for f in futures)
    assert not futures[0].cancel()  # a call under way: pool.cancel stops it
    seen: list[int] = []
    futures[0].add_done_callback(lambda f: seen.append(f.result()))
    futures[0].set_result(7)
    assert seen == [7] and futures[0].result() == 7 and futures[0].exception() is None
    with pytest.raises(InvalidStateError):
        futures[0].set_result(8)
    futures[1].set_exception(KeyError("x"))
    with pytest.raises(KeyError):
        futures[1].result()
    assert isinstance(futures[1].exception(), KeyError)
    done, pending = wait(futures, timeout=0, return_when=FIRST_COMPLETED)
    assert done == set(futures[:2]) and pending == {futures[2]}
    threading.Timer(0.01, futures[2].set_result, (9,)).start()
    assert [f is futures[1] or f.result() for f in as_completed(futures, timeout=10)][-1] == 9


def test_a_lone_futures_waiter_is_woken_by_its_result() -> None:
    """A lone future makes its condition only for a waiter (a lone call's caller reads
    its answer itself: its result is set with none); one waiting in another thread, in
    ``result()`` or ``wait()``, is woken by the result all the same."""
    quiet = CallFuture[int]()
    quiet.set_result(1)
    assert quiet.result() == 1 and "_condition" not in quiet.__dict__
    for how in ("result", "wait"):
        fut = CallFuture[int]()
        got: list[object] = []

        def waiter(fut: CallFuture[int] = fut, how: str = how, got: list[object] = got) -> None:
            if how == "result":
                got.append(fut.result())
            else:
                got.append(len(wait([fut], timeout=60).done))

        t = threading.Thread(target=waiter)
        t.start()
        for _ in range(10_000_000):  # until the waiter waits (on the condition it made)
            made = fut.__dict__.get("_condition")
            if made is not None and (made._waiters or fut._waiters):  # type: ignore[attr-defined]
                break
        fut.set_result(2)
        t.join(60)
        assert got == [2 if how == "result" else 1]


@sky.function
def square(x: int) -> int:
    return x * x


def test_a_batchs_calls_share_a_condition_and_each_gets_its_own_result() -> None:
    with sky.Compute(nodes=2) as pool:
        futures = pool._submit_many([square(i) for i in range(200)])
        assert len({id(f._condition) for f in futures}) == 1  # type: ignore[attr-defined]
        assert len({id(f.batch) for f in futures}) == 1  # type: ignore[attr-defined]
        assert [f.result() for f in reversed(futures)] == [i * i for i in reversed(range(200))]


def test_a_batch_ends_when_all_are_settled_or_one_failed() -> None:
    batch = Batch(3)
    futures: list[Future[int]] = [CallFuture[int](batch) for _ in range(3)]
    assert not batch.wait(futures[:2])  # not the whole batch: not waited for
    futures[0].set_result(0)
    futures[1].set_result(1)
    assert not batch.ended.is_set()
    futures[2].set_result(2)
    assert batch.wait(futures) and batch.ended.is_set()
    failing = Batch(3)
    futures = [CallFuture[int](failing) for _ in range(3)]
    futures[1].set_exception(KeyError("first failure"))
    assert failing.wait(futures)  # returns at the first failure, the others still run
    assert not futures[0].done() and not futures[2].done()


def test_gather_raises_a_calls_failure() -> None:
    with sky.Compute(nodes=2) as pool, pytest.raises(ZeroDivisionError):
        sky.gather(*[inverse(i) for i in range(20)]) >> pool


@sky.function
def inverse(x: int) -> float:
    return 1 / x


@sky.function
def touch(folder: str, i: int, _: object = None) -> None:
    with open(f"{folder}/{i}", "w"):
        pass


def test_a_batch_with_an_argument_that_cannot_be_sent_sends_none_of_its_calls(
    tmp_path: Path,
) -> None:
    """A batch is sent a chunk at a time (the first calls run while the rest are
    prepared), but every argument is pickled before the first is sent."""
    calls = [touch(str(tmp_path), i) for i in range(3 * SEND_CHUNK)]
    calls[-1] = touch(str(tmp_path), 0, threading.Lock())
    with sky.Compute(nodes=2) as pool:
        with pytest.raises(sky.SerializationError, match="lock"):
            sky.gather(*calls) >> pool
        touch(str(tmp_path), -1) @ pool  # after anything sent before it, on every node
    assert os.listdir(tmp_path) == ["-1"]
