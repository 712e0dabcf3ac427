"""Streaming results: a function that yields sends each value as it is produced; `>>`
returns an iterator, a slow consumer pauses the producer, memory stays bounded."""

from __future__ import annotations

import gc
import itertools
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import flotilla as sky
from flotilla._wire.frames import STREAM_WINDOW


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.Compute]:
    with sky.Compute(nodes=2) as p:
        yield p


@sky.function
def count(n: int) -> Iterator[int]:
    yield from range(n)


@sky.function
def first_then_wait() -> Iterator[object]:
    yield "first"
    yield sky.queue("go").get(timeout=60)  # put by the client once it has "first"


@sky.function
def endless() -> Iterator[int]:
    produced = sky.counter("produced")
    i = 0
    while True:
        produced.increment()
        yield i
        i += 1


@sky.function
def fails_after_one() -> Iterator[int]:
    yield 1
    raise ValueError("broke mid-stream")


@sky.function
def megabytes(n: int) -> Iterator[bytes]:
    for i in range(n):
        yield bytes([i % 256]) * (1 << 20)


def test_rshift_returns_an_iterator_over_the_values(pool: sky.Compute) -> None:
    it = count(5) >> pool
    assert iter(it) is it
    assert list(it) == [0, 1, 2, 3, 4]
    assert list(count(0) >> pool) == []


def test_a_value_arrives_before_the_function_ends(pool: sky.Compute) -> None:
    it = first_then_wait() >> pool
    assert next(it) == "first"
    pool.queue("go").put("second")  # the function is still running: it takes this
    assert list(it) == ["second"]


def test_a_slow_consumer_pauses_the_producer(pool: sky.Compute) -> None:
    it = endless() >> pool
    taken = [next(it) for _ in range(20)]
    assert taken == list(range(20))
    # the producer may run a window ahead of the leave it was given, never further
    assert int(pool.counter("produced")) <= 20 + STREAM_WINDOW + 1
    it.close()  # the generator ends at its next yield (GeneratorExit); the process stays
    assert list(count(3) >> pool) == [0, 1, 2]  # the pool goes on


def test_an_error_mid_stream_is_raised_after_the_values_before_it(pool: sky.Compute) -> None:
    it = fails_after_one() >> pool
    assert next(it) == 1
    with pytest.raises(ValueError, match="broke mid-stream"):
        next(it)


def test_other_ways_of_sending_collect_the_values(pool: sky.Compute) -> None:
    assert count(3) @ pool == [[0, 1, 2], [0, 1, 2]]
    assert (count(2) & count(3)) >> pool == ([0, 1], [0, 1, 2])
    assert (count(2) > pool).result() == [0, 1]


def test_streaming_256_mib_keeps_the_clients_memory_bounded(pool: sky.Compute) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    total = 0
    for i, value in enumerate(megabytes(256) >> pool):
        assert len(value) == 1 << 20 and value[0] == i % 256
        total += len(value)
    assert total == 256 << 20
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 64 * 1024, f"peak memory grew {grown} KiB"


@sky.stream
def squares(n: int) -> Iterator[int]:
    for i in range(n):
        yield i * i


def test_skywards_stream_decorator(pool: sky.Compute) -> None:
    assert list(squares(4) >> pool) == [0, 1, 4, 9]
    assert list(sky.stream(timeout=30)(count)(2) >> pool) == [0, 1]
    with pytest.raises(sky.ConfigurationError, match="generator function"):
        sky.stream(lambda: 1)


# -- streamed arguments (Iterator[T] parameters) ------------------------------------------------
@sky.function
def total(values: Iterator[int]) -> int:
    assert not isinstance(values, list)  # an iterator that reads as the client sends
    return sum(values)


@sky.function
def double_each(values: Iterator[int], factor: int = 2) -> Iterator[int]:
    for v in values:
        yield v * factor


@sky.function
def take_three(values: Iterator[int]) -> list[int]:
    it = iter(values)
    return [next(it), next(it), next(it)]


def test_a_generator_argument_is_streamed_to_the_node(pool: sky.Compute) -> None:
    assert total(i for i in range(1000)) >> pool == sum(range(1000))
    assert total(values=iter(range(10))) >> pool == 45
    assert total([]) >> pool == 0


def test_streamed_in_and_out(pool: sky.Compute) -> None:
    assert list(double_each(iter(range(20)), factor=3) >> pool) == [3 * i for i in range(20)]


@sky.function
def take_while_a_thread_stores(values: Iterator[int], name: str) -> int:
    """Sums ``values`` in the task's thread while another thread of the task puts 1 and 2
    on queue ``name``, once the task's thread waits for a value on its task pipe: the
    answer to that thread's first put reaches the executor while both wait on the pipe."""
    import threading

    main = threading.get_native_id()

    def main_waits() -> bool:  # in a read or poll of its task pipe
        try:
            with open(f"/proc/self/task/{main}/wchan") as f:
                return any(word in f.read() for word in ("pipe", "poll"))
        except OSError:
            return True  # (no way to tell: go on)

    def store() -> None:
        deadline = time.monotonic() + 60
        while not main_waits() and time.monotonic() < deadline:
            time.sleep(0.001)
        queue = sky.queue(name)
        queue.put(1)
        queue.put(2)  # (only once the first put was answered)

    thread = threading.Thread(target=store, daemon=True)
    thread.start()
    total = sum(values)
    thread.join()
    return total


def test_a_task_thread_using_the_collections_while_another_takes_a_streamed_argument(
    pool: sky.Compute,
) -> None:
    """Two threads of a task wait on its executor's task pipe at once: the task's thread
    for a value of its streamed argument, another for the answer to its put on a queue.
    Whichever thread reads the answer, the other sees it: the put returns, the second
    put goes out, and the client's iterator, which gives its values once both puts are
    in, lets the task end (an executor whose other thread stayed in its read until more
    came hung here)."""
    name = f"stores-{os.getpid()}-{time.monotonic_ns()}"
    queue = sky.queue(name)

    def values() -> Iterator[int]:
        assert [queue.get(timeout=60), queue.get(timeout=60)] == [1, 2]
        yield from range(10)

    assert take_while_a_thread_stores(values(), name) >> pool == 45


@sky.function
def wait_for(name: str) -> object:
    return sky.queue(name).get(timeout=60)


def test_a_call_that_waits_for_a_free_process_still_gets_its_streamed_argument() -> None:
    # an elastic pool below its max parks a call while every process is busy: its
    # streamed argument is sent once the call is on a node (it was cancelled)
    with sky.Compute(nodes=(1, 2), options=sky.Options(autoscale_idle_timeout=600)) as pool:
        busy = wait_for("free") > pool
        parked = total(iter(range(100))) > pool
        assert parked.result(timeout=60) == sum(range(100))
        pool.queue("free").put("done")
        assert busy.result(timeout=60) == "done"


def test_the_client_sends_only_a_window_ahead_of_the_task(pool: sky.Compute) -> None:
    pulled = []

    def source() -> Iterator[int]:
        for i in range(1_000_000):
            pulled.append(i)
            yield i

    assert take_three(source()) >> pool == [0, 1, 2]
    assert len(pulled) <= 3 + 2 * STREAM_WINDOW  # never the million


def test_a_failing_argument_iterator_is_raised_on_the_node(pool: sky.Compute) -> None:
    def broken() -> Iterator[int]:
        yield 1
        raise OSError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        total(broken()) >> pool


@sky.function
def guarded(marker: str) -> Iterator[int]:
    """Endless; its finally (and only it) writes its process id to ``marker``."""
    try:
        yield from itertools.count()
    finally:
        Path(marker).write_text(str(os.getpid()))


@sky.function
def stubborn() -> Iterator[int]:
    while True:
        try:
            yield 1
        except GeneratorExit:
            pass  # and yields again: Python's close() raises RuntimeError


@sky.function
def pid() -> int:
    return os.getpid()


def _wait_for(path: Path, deadline: float = 60.0) -> str:
    end = time.monotonic() + deadline
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def test_closing_a_stream_runs_the_generators_finally_in_the_same_process(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "finally"
    with sky.Compute(nodes=1) as pool:  # one process: every call runs in it
        before = pid() >> pool
        it = guarded(str(marker)) >> pool
        assert [next(it), next(it)] == [0, 1]
        it.close()  # as Python's: returns once the generator's finally ran
        assert marker.read_text() == str(before)
        assert pid() >> pool == before  # the executor was not replaced
        with pytest.raises(StopIteration):
            next(it)
        it.close()  # again: nothing


def test_close_raises_what_the_generator_raised_while_closing() -> None:
    with sky.Compute(nodes=1) as pool:
        before = pid() >> pool
        it = stubborn() >> pool
        assert next(it) == 1
        with pytest.raises(RuntimeError, match="ignored GeneratorExit"):
            it.close()
        assert pid() >> pool == before


def test_a_dropped_stream_and_a_closing_pool_close_their_generators(tmp_path: Path) -> None:
    dropped, kept = tmp_path / "dropped", tmp_path / "kept"
    with sky.Compute(nodes=1) as pool:
        before = pid() >> pool
        it = guarded(str(dropped)) >> pool
        next(it)
        del it
        gc.collect()
        assert _wait_for(dropped) == str(before)
        assert pid() >> pool == before
        still_open = guarded(str(kept)) >> pool
        next(still_open)
    assert kept.read_text() == str(before)  # the pool's close ran it before it returned
