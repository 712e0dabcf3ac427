"""The programming model: lazy functions, operators, runtime context, output, errors."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _procs import wait_until

import flotilla as sky
from flotilla._info import SINGLE_NODE


@sky.function
def noop(x: Any = None) -> Any:
    return x


@sky.function
def add(a: int, b: int = 0) -> int:
    return a + b


@sky.function
def whoami() -> sky.InstanceInfo:
    return sky.instance_info()


@sky.function
def touch(path: str) -> str:
    Path(path).write_text("ran")
    return path


# -- public namespace ------------------------------------------------------------------


def test_all_lists_exactly_the_public_api() -> None:
    import types

    loaded = {n for n in sky.__all__ if getattr(sky, n) is not None}  # resolves every name
    public = {
        n
        for n, v in vars(sky).items()
        if not n.startswith("_") and (n in sky._SUBMODULES or not isinstance(v, types.ModuleType))
    }
    assert public == loaded - {"__version__"}
    assert sorted(dir(sky)) == sorted(set(dir(sky)))
    for name in sky.__all__:
        assert getattr(sky, name) is not None, name
    assert len(sky.__all__) == len(set(sky.__all__))


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = sky.nope  # type: ignore[attr-defined]


# -- lazy functions --------------------------------------------------------------------


def test_calling_a_function_runs_nothing_and_returns_a_picklable_call(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    call = touch(str(marker))
    assert isinstance(call, sky.PendingCall)
    assert not marker.exists()
    clone = pickle.loads(pickle.dumps(call))
    assert clone.args == (str(marker),)
    assert clone.local() == str(marker)
    assert marker.read_text() == "ran"


def test_local_runs_in_process_with_single_node_info() -> None:
    assert add.local(2, b=3) == 5
    assert whoami.local() == SINGLE_NODE
    assert SINGLE_NODE.total_nodes == 1 and SINGLE_NODE.is_head and SINGLE_NODE.peers


def test_function_options_are_validated() -> None:
    with pytest.raises(ValueError, match="timeout"):
        sky.function(timeout=0)(lambda: None)
    with pytest.raises(ValueError, match="retries"):
        sky.function(retries=-1)(lambda: None)
    f = sky.function(timeout=5, retries=2)(lambda: None)
    assert (f.timeout, f.retries) == (5, 2)


# -- operators -------------------------------------------------------------------------


def test_rshift_runs_on_one_node_and_returns_the_value(pool4: sky.Compute) -> None:
    assert add(2, b=40) >> pool4 == 42


def test_matmul_runs_on_every_node_in_rank_order(pool4: sky.Compute) -> None:
    infos = whoami() @ pool4
    assert [i.node for i in infos] == [0, 1, 2, 3]
    assert all(i.total_nodes == 4 for i in infos)


def test_and_and_gather_run_different_calls_in_parallel(pool4: sky.Compute) -> None:
    assert (add(1) & add(2) & add(3)) >> pool4 == (1, 2, 3)
    assert sky.gather(add(1), add(2, 2), noop("x")) >> pool4 == (1, 4, "x")


def test_gather_streams_results(pool4: sky.Compute) -> None:
    ordered = sky.gather(*(add(i) for i in range(20)), stream=True) >> pool4
    assert list(ordered) == list(range(20))
    unordered = sky.gather(*(add(i) for i in range(20)), stream=True, ordered=False) >> pool4
    assert sorted(unordered) == list(range(20))


def test_gt_returns_a_future(pool4: sky.Compute) -> None:
    fut = add(20, 22) > pool4
    assert fut.result(timeout=30) == 42
    group = (add(1) & add(2)) > pool4
    assert group.result(timeout=30) == (1, 2)


def test_map_spreads_calls_and_keeps_input_order(pool4: sky.Compute) -> None:
    assert pool4.map(lambda x: x * x, range(10)) == [x * x for x in range(10)]
    nodes = pool4.map(lambda _: sky.instance_info().node, range(40))
    assert set(nodes) == {0, 1, 2, 3}


def test_map_takes_several_iterables_like_map(pool4: sky.Compute) -> None:
    assert pool4.map(add, [1, 2, 3], [10, 20, 30]) == [11, 22, 33]
    assert pool4.map(lambda a, b: a * b, range(5), [2, 2]) == [0, 2]  # the shortest ends it
    assert pool4.map(add, []) == []
    with pytest.raises(TypeError, match="at least one iterable"):
        pool4.map(add)


# -- API traps: retries of exceptions, functions called inside a task -------------------------
def _flaky(counter: Path, failures: int) -> int:
    """Raise ConnectionError the first ``failures`` times (attempts counted in a file)."""
    attempts = len(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text("x" * attempts)
    if attempts <= failures:
        raise ConnectionError(f"attempt {attempts} failed")
    return attempts


def test_retry_on_runs_a_call_again_when_it_raises_one_of_those_types(
    pool2: sky.Compute, tmp_path: Path
) -> None:
    retried = sky.function(retries=3, retry_on=(ConnectionError,))(_flaky)
    assert retried(tmp_path / "a", 2) >> pool2 == 3  # two failures, the third attempt ran
    with pytest.raises(ConnectionError, match="attempt 4 failed"):
        retried(tmp_path / "b", 10) >> pool2  # 1 + 3 retries, then the error
    assert len((tmp_path / "b").read_text()) == 4
    other = sky.function(retries=3, retry_on=KeyError)(_flaky)
    with pytest.raises(ConnectionError, match="attempt 1 failed"):
        other(tmp_path / "d", 1) >> pool2  # not a retry_on type: raised at once
    plain = sky.function(retries=3)(_flaky)
    with pytest.raises(ConnectionError, match="attempt 1 failed"):
        plain(tmp_path / "e", 1) >> pool2  # retries alone: crashes only, not exceptions


def test_retry_on_takes_exception_classes_and_needs_retries() -> None:
    with pytest.raises(sky.ConfigurationError, match="exception classes"):
        sky.function(retries=1, retry_on=("ConnectionError",))(_flaky)  # type: ignore[arg-type]
    with pytest.raises(sky.ConfigurationError, match="retry_on needs retries=N"):
        sky.function(retry_on=(ConnectionError,))
    f = sky.function(retries=2, retry_on=OSError)(_flaky)
    assert f.retry_on == (OSError,)
    assert pickle.loads(pickle.dumps(f(Path("x"), 0))).function.retry_on == (OSError,)


@sky.function
def double(x: int) -> int:
    return 2 * x


def test_a_flotilla_function_called_inside_a_task_runs_there(pool2: sky.Compute) -> None:
    @sky.function
    def outer(x: int) -> tuple[int, bool]:
        value = double(x)  # a helper that is itself a flotilla function
        return value, isinstance(value, sky.PendingCall)

    assert outer(21) >> pool2 == (42, False)
    assert outer(1) @ pool2 == [(2, False), (2, False)]
    assert isinstance(double(1), sky.PendingCall)  # here, on the client: a pending call

    @sky.function
    def opens_a_pool_of_its_own() -> int:
        with sky.Compute(nodes=1) as inner:
            return double(5) >> inner  # bound while the task's own pool is open: sent there

    assert opens_a_pool_of_its_own() >> pool2 == 10


def test_rshift_prefers_the_least_busy_node(pool2: sky.Compute, tmp_path: Path) -> None:
    gate = tmp_path / "gate"

    @sky.function
    def wait_for_gate() -> int:
        import time

        while not gate.exists():
            time.sleep(0.01)
        return sky.instance_info().node

    busy = wait_for_gate() > pool2
    free = whoami() >> pool2  # the other node must answer while the first is busy
    gate.write_text("open")
    assert free.node != busy.result(timeout=30)


# -- runtime context -------------------------------------------------------------------


def test_instance_info_describes_the_cluster(pool4: sky.Compute) -> None:
    infos = whoami() @ pool4
    head = infos[0]
    assert head.is_head and not any(i.is_head for i in infos[1:])
    assert all(i.head_addr == "127.0.0.1" and i.head_port == head.head_port for i in infos)
    assert 1024 < head.head_port < 65536
    assert all(i.pool_id == pool4.pool_id for i in infos)
    assert all([p.node for p in i.peers] == [0, 1, 2, 3] for i in infos)
    assert all(p.addr == "127.0.0.1" for p in head.peers)
    assert all(i.accelerators == 0 and i.cluster for i in infos)


def test_standalone_mode_has_no_peers_and_node_0_is_head() -> None:
    """As in Skyward: is_head is node 0's, with or without cluster mode."""
    with sky.Compute(nodes=2, options=sky.Options(cluster=False)) as pool:
        infos = whoami() @ pool
    assert [i.node for i in infos] == [0, 1]
    assert [i.is_head for i in infos] == [True, False]
    assert all(i.peers == () and not i.cluster and i.head_addr == "" for i in infos)
    # Skyward's worker names: one worker slot per node here
    assert [(i.worker, i.workers_per_node, i.global_worker_index) for i in infos] == [
        (0, 1, 0),
        (0, 1, 1),
    ]
    assert all(i.total_workers == 2 for i in infos)


def test_options_env_is_set_in_tasks() -> None:
    @sky.function
    def read_env() -> str:
        import os

        return os.environ["FLOTILLA_TEST_VAR"]

    with sky.Compute(nodes=1, options=sky.Options(env={"FLOTILLA_TEST_VAR": "yes"})) as pool:
        assert read_env() >> pool == "yes"


# -- data ------------------------------------------------------------------------------


def test_broadcast_of_a_large_array_reaches_every_node_intact(pool4: sky.Compute) -> None:
    arr = np.arange(5_000_000, dtype=np.float64)  # 40 MB: travels through shared memory

    @sky.function
    def mutate_and_sum(a: np.ndarray) -> tuple[float, float]:
        total = float(a.sum())
        a[0] = sky.instance_info().node + 100  # copy-on-write: private to this node
        return total, float(a[0])

    results = mutate_and_sum(arr) @ pool4
    assert [r[0] for r in results] == [float(arr.sum())] * 4
    assert [r[1] for r in results] == [100.0, 101.0, 102.0, 103.0]
    assert arr[0] == 0


def test_large_results_come_back_intact(pool2: sky.Compute) -> None:
    @sky.function
    def make(n: int) -> np.ndarray:
        return np.full(n, sky.instance_info().node, dtype=np.int32)

    out = make(3_000_000) @ pool2
    assert [int(a.sum()) for a in out] == [0, 3_000_000]
    assert out[1].flags.writeable


# -- errors ----------------------------------------------------------------------------


class BadInput(ValueError):
    pass


@sky.function
def fail(msg: str) -> None:
    raise BadInput(msg)


def test_remote_exception_keeps_its_type_traceback_and_node(pool2: sky.Compute) -> None:
    with pytest.raises(BadInput, match="broken input") as info:
        fail("broken input") >> pool2
    err = info.value
    assert err.node in (0, 1)  # type: ignore[attr-defined]
    assert "remote traceback" in err.__notes__[0]
    assert "raise BadInput(msg)" in err.remote_traceback  # type: ignore[attr-defined]


def test_broadcast_reraises_the_failure(pool2: sky.Compute) -> None:
    @sky.function
    def fail_on_one() -> int:
        if sky.instance_info().node == 1:
            raise KeyError("node one")
        return 0

    with pytest.raises(KeyError, match="node one") as info:
        fail_on_one() @ pool2
    assert info.value.node == 1  # type: ignore[attr-defined]
    assert add(1, 1) @ pool2 == [2, 2]


def test_remote_system_exit_does_not_exit_the_client(pool2: sky.Compute) -> None:
    @sky.function
    def leave() -> None:
        raise SystemExit(4)

    with pytest.raises(sky.RemoteError, match="SystemExit"):
        leave() >> pool2


def test_unpicklable_argument_is_named_before_anything_is_sent(pool2: sky.Compute) -> None:
    lock = threading.Lock()
    with pytest.raises(sky.SerializationError, match=r"args\[1\]\['x'\]") as info:
        add(1, {"x": lock}) >> pool2
    assert "lock" in info.value.type_name
    with pytest.raises(sky.SerializationError, match=r"kwargs\['b'\]"):
        add(1, b=(i for i in range(3))) >> pool2  # type: ignore[arg-type]


def test_unpicklable_closure_is_named(pool2: sky.Compute) -> None:
    lock = threading.Lock()

    @sky.function
    def uses_lock() -> bool:
        return lock.locked()

    with pytest.raises(sky.SerializationError, match="lock") as info:
        uses_lock() >> pool2
    assert "closure lock" in info.value.path


def test_unpicklable_result_is_a_clear_error(pool2: sky.Compute) -> None:
    @sky.function
    def give_lock() -> Any:
        return {"ok": 1, "bad": threading.Lock()}

    with pytest.raises(sky.SerializationError, match=r"result\['bad'\]"):
        give_lock() >> pool2
    assert add(1) >> pool2 == 1


# -- misuse ----------------------------------------------------------------------------


def plain(x: int) -> int:
    return x


def test_misuse_gets_a_one_line_hint(pool2: sky.Compute) -> None:
    with pytest.raises(TypeError, match=r"@flotilla\.function"):
        plain >> pool2  # type: ignore[operator]
    with pytest.raises(TypeError, match=r"was not called: write `add\(...\) >> pool`"):
        add >> pool2
    with pytest.raises(TypeError, match=r"add\(...\) @ pool"):
        add @ pool2  # type: ignore[operator]
    with pytest.raises(TypeError, match="running flotilla pool"):
        add(1) >> 3  # type: ignore[operator]
    with pytest.raises(TypeError, match="pending calls"):
        add(1) & plain  # type: ignore[operator]


def test_nodes_must_be_positive() -> None:
    for bad in (1.5, True):
        with pytest.raises(sky.ConfigurationError, match=r"nodes must be int, tuple\[int, int\]"):
            sky.Compute(nodes=bad)  # type: ignore[arg-type]
    with pytest.raises(sky.ConfigurationError, match="desired must be >= 0, got -1"):
        sky.Compute(nodes=-1)
    with pytest.raises(sky.ConfigurationError, match=r"needs a max to grow to, e.g. Nodes\(0, max"):
        sky.Compute(nodes=0)


def test_a_malformed_range_of_nodes_is_refused_clearly() -> None:
    with pytest.raises(sky.ConfigurationError, match=r"max \(1\) must be >= desired \(4\)"):
        sky.Compute(nodes=(4, 1))
    with pytest.raises(sky.ConfigurationError, match=r"\(desired, max\).*got tuple: \(1, 2, 3\)"):
        sky.Compute(nodes=(1, 2, 3))  # type: ignore[arg-type]
    with pytest.raises(sky.ConfigurationError, match=r"min \(3\) must be <= desired \(2\)"):
        sky.Nodes(2, min=3)
    assert sky.Compute(nodes=(1, 4)).size == sky.Nodes(1, max=4)


def test_a_nul_byte_in_an_env_value_is_refused_naming_the_variable() -> None:
    with pytest.raises(sky.ConfigurationError, match=r"Image.env\['BAD'\] contains a NUL byte"):
        sky.Image(env={"BAD": "a\0b"})
    with pytest.raises(sky.ConfigurationError, match=r"Options.env\['BAD'\] contains a NUL"):
        sky.Compute(options=sky.Options(env={"BAD": sky.Secret("x\0")}))


def test_closed_and_unstarted_pools_refuse_calls() -> None:
    pool = sky.Compute(nodes=1)
    with pytest.raises(sky.PoolClosedError, match="not started"):
        add(1) >> pool
    with pool:
        assert add(1) >> pool == 1
    with pytest.raises(sky.PoolClosedError, match="closed"):
        add(1) >> pool
    with pytest.raises(sky.PoolClosedError):
        pool.open()


class CountingLocal(sky.Local):
    """The real local provider, counting how often it was asked for machines."""

    starts = 0

    async def acquire(self, spec: sky.PoolSpec) -> Any:
        CountingLocal.starts += 1
        return await super().acquire(spec)


def test_missing_accelerator_fails_before_anything_starts() -> None:
    CountingLocal.starts = 0
    with (
        pytest.raises(sky.ConfigurationError, match=r"A100:8.*has 0 GPU"),
        sky.Compute(provider=CountingLocal(), nodes=2, accelerator="A100:8"),
    ):
        pass
    with pytest.raises(sky.ConfigurationError, match="A100"):
        sky.Compute(provider=CountingLocal(), accelerator=sky.accelerators.A100()).open()
    assert CountingLocal.starts == 0


def test_plugin_needing_a_cluster_is_refused_in_standalone_mode() -> None:
    class NeedsCluster(sky.Plugin):
        name = "needs-cluster"
        requires_cluster = True

    with pytest.raises(sky.ConfigurationError, match=r"needs-cluster.*cluster=False"):
        sky.Compute(nodes=2, plugins=[NeedsCluster()], options=sky.Options(cluster=False))


# -- cancellation and subsets ----------------------------------------------------------


def test_cancel_stops_a_running_call_and_skips_a_queued_one(tmp_path: Path) -> None:
    from concurrent.futures import CancelledError

    started = tmp_path / "started"
    skipped = tmp_path / "skipped-ran"

    @sky.function
    def hang(marker: str) -> int:
        import os
        import time

        Path(marker).write_text(str(os.getpid()))
        time.sleep(60)
        return 0

    with sky.Compute(nodes=1) as pool:
        running = hang(str(started)) > pool
        queued = touch(str(skipped)) > pool
        while not started.exists():  # synchronise on the task having started
            pass
        pool.cancel([queued])
        pool.cancel([running])
        with pytest.raises(CancelledError):
            running.result(timeout=30)
        with pytest.raises(CancelledError):
            queued.result(timeout=30)
        assert not skipped.exists()
        assert add(1, 1) >> pool == 2  # the node got a new process and answers


@sky.function
def wait_for(marker: str, go: str) -> int:
    """Create ``marker``, then wait until ``go`` exists."""
    import time

    Path(marker).write_text("")
    while not Path(go).exists():
        time.sleep(0.005)
    return 1


def test_a_call_given_ahead_to_a_busy_process_is_skipped_when_cancelled(tmp_path: Path) -> None:
    """While a queue of quick calls runs the agent gives its process a few calls ahead
    (they wait in its pipe): one of those that is cancelled ends at once, never runs, and
    those after it do."""
    from concurrent.futures import CancelledError

    started, go = tmp_path / "started", tmp_path / "go"
    skipped, after = tmp_path / "skipped-ran", tmp_path / "after"
    with sky.Compute(nodes=1) as pool:
        quick = [noop(i) for i in range(50)]  # queued quick calls: the next ones given ahead
        running = sky.gather(*quick, wait_for(str(started), str(go))) > pool
        queued = touch(str(skipped)) > pool
        later = touch(str(after)) > pool
        assert wait_until(started.exists, timeout=30)
        pool.cancel([queued])
        with pytest.raises(CancelledError):
            queued.result(timeout=30)  # while the call before it still runs
        go.touch()
        assert running.result(timeout=30)[-1] == 1
        assert later.result(timeout=30) == str(after)
        assert not skipped.exists()
        assert add(1, 1) >> pool == 2


def test_a_call_given_ahead_has_its_timeout_counted_from_its_own_start() -> None:
    """A call waiting behind a longer one (given ahead to the process) gets its whole
    timeout once it starts."""

    def nap(seconds: float) -> float:
        import time

        time.sleep(seconds)
        return seconds

    limited = sky.function(timeout=1.0)(nap)
    with sky.Compute(nodes=1) as pool:
        quick = [noop(i) for i in range(50)]  # queued quick calls: the next ones given ahead
        first = sky.gather(*quick, sky.function(nap)(1.5)) > pool
        second = limited(0.2) > pool  # given ahead at once, starts 1.5 s later
        assert first.result(timeout=30)[-1] == 1.5
        assert second.result(timeout=30) == 0.2


def test_broadcast_to_a_subset_of_nodes(pool4: sky.Compute) -> None:
    futures = pool4.submit_broadcast(whoami(), nodes=[1, 3])
    assert [f.result(timeout=30).node for f in futures] == [1, 3]


def test_output_sink_receives_lines_instead_of_printing(
    pool2: sky.Compute, capsys: pytest.CaptureFixture[str]
) -> None:
    @sky.function
    def speak() -> None:
        print("hello from", sky.instance_info().node)

    got: list[tuple[int, int, list[str]]] = []
    pool2.output_sink = lambda rank, stream, lines: got.append((rank, stream, lines))
    try:
        speak() @ pool2
    finally:
        pool2.output_sink = None
    assert sorted(got) == [(0, 1, ["hello from 0"]), (1, 1, ["hello from 1"])]
    assert "hello from" not in capsys.readouterr().out


def test_a_single_calls_output_is_delivered_before_its_value_returns() -> None:
    """``>>`` returns after the call's printed lines reached the output sink, also when
    the caller's thread reads the node's stream itself (quick calls, one at a time), and
    quiet calls in between return their values."""

    @sky.function
    def speak(i: int) -> int:
        print(f"line {i}")
        return i

    got: list[str] = []
    with sky.Compute(nodes=1) as pool:
        pool.output_sink = lambda rank, stream, lines: got.extend(lines)
        for i in range(100):
            assert speak(i) >> pool == i
            assert got[-1:] == [f"line {i}"]
            assert noop(i) >> pool == i
    assert got == [f"line {i}" for i in range(100)]


class TwoPerNode(sky.Plugin):
    """A plugin asking for two processes per node, as torch(procs_per_node=2) does."""

    procs_per_node = 2


def test_several_processes_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    @sky.function
    def where() -> tuple[int, int, int, int]:
        import os

        info = sky.instance_info()
        print("hi")
        return info.node, info.local_rank, info.procs_per_node, os.getpid()

    with sky.Compute(nodes=2, plugins=[TwoPerNode()]) as pool:
        results = where() @ pool
        assert add(1, 2) >> pool == 3
        assert len(set(pool.map(lambda _: __import__("os").getpid(), range(16)))) == 4
    assert [r[:3] for r in results] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert len({r[3] for r in results}) == 4  # four processes
    out = capsys.readouterr().out
    assert sorted(line for line in out.splitlines() if "hi" in line) == [
        f"(node-{r // 2}, rank={r}) hi" for r in range(4)
    ]


def test_large_in_band_arguments_arrive_whole(pool2: sky.Compute) -> None:
    @sky.function
    def size_of(data: bytes) -> int:
        return len(data)

    payload = b"y" * (5 << 20)  # bytes pickle in band: one frame read in many parts
    assert size_of(payload) >> pool2 == 5 << 20
    assert size_of(payload) @ pool2 == [5 << 20] * 2


def test_frame_reader_completes_large_bodies_fed_in_chunks() -> None:
    from flotilla._wire.frames import FrameReader, Kind, frame

    body = bytes(range(256)) * 8192  # 2 MiB
    wire = b"".join(bytes(p) for p in frame(Kind.TASK, 7, body)) * 2
    reader = FrameReader()
    got = []
    for i in range(0, len(wire), 100_000):
        got += reader.feed(wire[i : i + 100_000])
    assert [(k, ident, bytes(b)) for k, ident, b in got] == [(Kind.TASK, 7, body)] * 2
