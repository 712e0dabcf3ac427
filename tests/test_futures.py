"""A pool's call futures (``_client/futures.py``): real ``concurrent.futures.Future`` objects
whose batch shares one condition; a sibling's result must never end another's wait."""

from __future__ import annotations

import threading
from concurrent.futures import (
    FIRST_COMPLETED,
    Future,
    InvalidStateError,
    TimeoutError,
    as_completed,
    wait,
)

import pytest

import flotilla as sky
from flotilla._client.futures import CallFuture


def test_a_siblings_result_does_not_end_the_wait_for_another() -> None:
    shared = threading.Condition()
    first, second = CallFuture[int](shared), CallFuture[int](shared)
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
    shared = threading.Condition()
    pending, other = CallFuture[int](shared), CallFuture[int](shared)
    other.set_result(1)
    with pytest.raises(TimeoutError):
        pending.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        pending.exception(timeout=0)
    assert not pending.done()


def test_it_behaves_as_a_future() -> None:
    shared = threading.Condition()
    futures = [CallFuture[int](shared) for _ in range(3)]
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


@sky.function
def square(x: int) -> int:
    return x * x


def test_a_batchs_calls_share_a_condition_and_each_gets_its_own_result() -> None:
    with sky.Compute(nodes=2) as pool:
        futures = pool._submit_many([square(i) for i in range(200)])
        assert len({id(f._condition) for f in futures}) == 1  # type: ignore[attr-defined]
        assert [f.result() for f in reversed(futures)] == [i * i for i in reversed(range(200))]
