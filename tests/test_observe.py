"""Seeing inside a running pool (issue 38): per-node metrics sampled by the agents, typed
events, ``pool.view()``, and health checks. Real local pools; the GPU readers get a
stand-in ``nvidia-smi`` on PATH and a fake NVML library built here with gcc."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _container import container_lab_fixture  # noqa: F401 - the fixture
from _hosts import ssh_lab_fixture  # noqa: F401 - the fixture

import flotilla as sky
from flotilla import events
from flotilla._node import metrics as node_metrics
from flotilla._node.metrics import parse_smi

MB = 1 << 20


def wait_for(check: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    """Poll ``check`` until it returns something true (a condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@sky.function
def hold(mb: int, release: str) -> int:
    block = bytearray(mb * MB)
    for i in range(0, len(block), 4096):  # touched: resident
        block[i] = 1
    while not os.path.exists(release):
        time.sleep(0.02)
    return len(block)


@sky.function
def burn(release: str) -> int:
    n = 0
    while not os.path.exists(release):
        for _ in range(10_000):
            n += 1
    return n


@sky.function
def pid() -> int:
    return os.getpid()


@sky.function
def fails() -> None:
    raise ValueError("bad input")


@sky.function
def says(text: str) -> str:
    print(text)
    return text


# -- metrics: each node its own row ---------------------------------------------------------
def test_each_node_shows_its_own_cpu_and_memory(tmp_path: Path) -> None:
    """Node 0 holds 300 MB while node 1 burns a core: node 0's memory and node 1's CPU show
    on their own rows (the local provider's nodes share this machine: each is its own
    process tree), sampled by the agents at their interval."""
    release = str(tmp_path / "release")
    metrics = [sky.metrics.CPU(interval=0.5), sky.metrics.Memory(interval=0.5)]
    with sky.Compute(nodes=2, metrics=metrics) as pool:
        held = pool.submit_broadcast(hold(300, release), nodes=[0])[0]
        burning = pool.submit_broadcast(burn(release), nodes=[1])[0]

        def apart() -> bool:
            m = pool.metrics()
            if 0 not in m or 1 not in m or "cpu" not in m[0] or "cpu" not in m[1]:
                return False
            return (
                m[0]["mem_used"] >= 300 * MB
                and m[1]["mem_used"] < 300 * MB
                and m[1]["cpu"] > m[0]["cpu"] + 10
            )

        try:
            wait_for(apart, "node 0's memory and node 1's CPU on their own rows")
        finally:
            Path(release).touch()
        assert held.result(60) == 300 * MB and burning.result(60) > 0
        m = pool.metrics()
        for rank in (0, 1):
            assert m[rank]["mem_total"] > 0 and m[rank]["cpus"] > 0
            assert abs(m[rank]["time"] - time.time()) < 3600
        view = pool.view()
        assert [n.node for n in view.nodes] == [0, 1]
        assert all(n.phase == "ready" for n in view.nodes)
        assert view.nodes[0].metrics["mem_used"] > 0


def test_no_metrics_with_metrics_none() -> None:
    with sky.Compute(nodes=1, metrics=None) as pool:
        assert pid() >> pool > 0
        assert pool.metrics() == {}
    with sky.Compute(nodes=1, image=sky.Image(metrics=None)) as pool:
        assert pool.metrics_config == ()


def test_skyward_spelling_of_metrics() -> None:
    m = sky.metrics.Metric("open_fds", "ls /proc/self/fd | wc -l", interval=5)
    assert (m.name, m.interval, m.multi) == ("open_fds", 5, False)
    assert sky.metrics.Disk("/data").name == "disk_data"
    assert sky.metrics.GPU().multi and sky.metrics.GPU(index=1).name == "gpu_util_1"
    assert {x.name for x in sky.metrics.Default()} >= {"cpu", "mem", "gpu_util", "gpu_temp"}
    assert sky.Compute(metrics=[sky.metrics.CPU()]).metrics_config == (sky.metrics.CPU(),)
    image = sky.Image(metrics=[sky.metrics.GPUTemp()])
    assert sky.Compute(image=image).metrics_config == (sky.metrics.GPUTemp(),)
    assert sky.Compute().metrics_config == sky.metrics.Default()
    with pytest.raises(sky.ConfigurationError, match="interval"):
        sky.metrics.Metric("x", "echo 1", interval=0)
    with pytest.raises(sky.ConfigurationError, match="Metric"):
        sky.Compute(metrics=["cpu"])


def test_a_bad_metric_command_is_reported_once_and_skipped(tmp_path: Path) -> None:
    """A command that fails, one that prints garbage and one that hangs are each reported
    once per node and not run again; the node keeps sampling the good metric and running
    calls."""
    hang = "sleep 61.4321"
    metrics = [
        sky.metrics.Metric("bad", "exit 3", interval=0.2),
        sky.metrics.Metric("garbage", "echo hello", interval=0.2),
        sky.metrics.Metric("hang", hang, interval=0.2),
        sky.metrics.Metric("good", "echo 42", interval=0.2),
    ]
    seen: list[events.Event] = []
    lock = threading.Lock()

    def on_event(e: events.Event) -> None:
        with lock:
            seen.append(e)

    pool = sky.Compute(nodes=2, metrics=metrics)
    pool.subscribe(on_event=on_event)  # before it starts: its first samples come then
    with pool:

        def failed() -> list[events.MetricFailed]:
            with lock:
                return [e for e in seen if isinstance(e, events.MetricFailed)]

        wait_for(lambda: len(failed()) >= 6, "the three bad metrics reported on both nodes")
        with lock:
            goods_then = sum(
                1 for e in seen if isinstance(e, events.MetricSample) and "good" in e.values
            )
        wait_for(
            lambda: (
                sum(
                    1
                    for e in list(seen)
                    if isinstance(e, events.MetricSample) and "good" in e.values
                )
                >= goods_then + 6
            ),
            "the good metric still sampled",
        )
        assert sorted((e.node, e.name) for e in failed()) == sorted(
            (n, name) for n in (0, 1) for name in ("bad", "garbage", "hang")
        )
        why = {e.name: e.why for e in failed()}
        assert "status 3" in why["bad"]
        assert "'hello'" in why["garbage"] and "not a number" in why["garbage"]
        assert "longer than" in why["hang"]
        assert pool.metrics()[0]["good"] == 42.0
        assert [pid() >> pool for _ in range(3)]
        out = subprocess.run(["pgrep", "-f", hang], capture_output=True, text=True, check=False)
        assert out.stdout.strip() == ""  # the hung command was killed


# -- GPUs ---------------------------------------------------------------------------------
def test_nvidia_smi_output_is_parsed() -> None:
    gpus = parse_smi("37, 1024, 16384, 55\n80, 2048, 16384, [N/A]\n")
    assert gpus == [
        {"gpu_util": 37.0, "gpu_mem_mb": 1024.0, "gpu_mem_total_mb": 16384.0, "gpu_temp": 55.0},
        {"gpu_util": 80.0, "gpu_mem_mb": 2048.0, "gpu_mem_total_mb": 16384.0},
    ]
    with pytest.raises(ValueError):
        parse_smi("NVIDIA-SMI has failed because it couldn't communicate with the driver")


def _stand_in_smi(folder: Path, output: str) -> None:
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--query-gpu=utilization.gpu,memory.used,memory.total,temperature.gpu*'
        "--format=csv,noheader,nounits*) ;; *) echo bad arguments: $* >&2; exit 9;; esac\n"
        f"printf '{output}'\n"
    )
    smi.chmod(0o755)


GPU_METRICS = [
    sky.metrics.GPU(interval=0.3),
    sky.metrics.GPUMemory(interval=0.3),
    sky.metrics.GPUMemoryTotal(),
    sky.metrics.GPUTemp(interval=0.3),
]


def test_gpu_metrics_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in_smi(tmp_path / "bin", "37, 1024, 16384, 55\\n80, 2048, 16384, 61\\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "none"))
    with sky.Compute(nodes=1, metrics=GPU_METRICS) as pool:
        m = wait_for(
            lambda: (x := pool.metrics().get(0, {})) and "gpu_temp_1" in x and x,
            "the GPU values",
        )
    assert (m["gpu_util_0"], m["gpu_util_1"]) == (37.0, 80.0)
    assert (m["gpu_mem_mb_0"], m["gpu_mem_mb_1"], m["gpu_mem_total_mb_1"]) == (1024, 2048, 16384)
    assert (m["gpu_temp_0"], m["gpu_temp_1"]) == (55.0, 61.0)


FAKE_NVML = r"""
typedef struct { unsigned int gpu, memory; } util_t;
typedef struct { unsigned long long total, free, used; } mem_t;
static int handles[3];
int nvmlInit_v2(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned int *n) { *n = 3; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **h) { *h = &handles[i]; return 0; }
static int index_of(void *h) { return (int *)h - handles; }
int nvmlDeviceGetUtilizationRates(void *h, util_t *u) {
    u->gpu = 10 + index_of(h); u->memory = 0; return 0; }
int nvmlDeviceGetMemoryInfo(void *h, mem_t *m) {
    m->total = 40960ULL << 20; m->used = (1000ULL + index_of(h)) << 20;
    m->free = m->total - m->used; return 0; }
int nvmlDeviceGetTemperature(void *h, int sensor, unsigned int *t) {
    if (index_of(h) == 2) return 3;  /* NVML_ERROR_NOT_SUPPORTED */
    *t = 70 + index_of(h); return 0; }
"""


def test_gpu_metrics_from_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML through ctypes (a fake libnvidia-ml.so.1 built here) is read first: its values
    win over a stand-in nvidia-smi's; a value NVML does not support is left out."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    lib = tmp_path / "lib"
    lib.mkdir()
    (tmp_path / "nvml.c").write_text(FAKE_NVML)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(lib / "libnvidia-ml.so.1"), str(tmp_path / "nvml.c")],
        check=True,
    )
    _stand_in_smi(tmp_path / "bin", "99, 1, 2, 99\\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))
    with sky.Compute(nodes=1, metrics=GPU_METRICS) as pool:
        m = wait_for(
            lambda: (
                (x := pool.metrics().get(0, {})) and "gpu_temp_1" in x and "gpu_util_2" in x and x
            ),
            "the GPU values",
        )
    assert [m[f"gpu_util_{i}"] for i in range(3)] == [10.0, 11.0, 12.0]
    assert [m[f"gpu_mem_mb_{i}"] for i in range(3)] == [1000.0, 1001.0, 1002.0]
    assert m["gpu_mem_total_mb_0"] == 40960.0
    assert (m["gpu_temp_0"], m["gpu_temp_1"]) == (70.0, 71.0) and "gpu_temp_2" not in m


def test_nvml_is_looked_for_where_the_loader_would_find_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node looks for NVML (``may_load``) before it imports ``_ctypes`` to load it (a
    node without it imports none): no library ``dlopen`` loads here is missed (a GPU
    node's NVML is found wherever the loader finds it), one that is nowhere is not looked
    for, and each of the loader's places finds one: a folder of ``LD_LIBRARY_PATH``, a
    default folder, the cache."""
    probe = (
        f"import sys; sys.path.insert(0, {str(Path(node_metrics.__file__).parents[2])!r}); "
        "from flotilla._node.metrics import NVML; NVML.load(); print('_ctypes' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True)
    assert done.stdout.strip() == str(node_metrics.may_load(node_metrics.NVML_LIBRARY)).encode()

    import _ctypes

    def loads(name: str) -> bool:
        try:
            _ctypes.dlopen(name)
        except OSError:
            return False
        return True

    real = ("libc.so.6", "libm.so.6", "libz.so.1", "libpthread.so.0", "libstdc++.so.6")
    assert [n for n in real if loads(n)], "no library of this machine loads"
    for name in (*real, node_metrics.NVML_LIBRARY):
        assert node_metrics.may_load(name) or not loads(name), name
    name = f"libflotilla-{os.getpid()}.so.1"
    assert not node_metrics.may_load(name) and not loads(name)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / name).write_bytes(b"")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/nowhere::{lib}")
    assert node_metrics.may_load(name)
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert not node_metrics.may_load(name)
    monkeypatch.setattr(node_metrics, "LIBRARY_DIRS", ("/nowhere", str(lib)))
    assert node_metrics.may_load(name)
    monkeypatch.setattr(node_metrics, "LIBRARY_DIRS", ())
    cache = tmp_path / "ld.so.cache"
    cache.write_bytes(b"glibc-ld.so.cache1.1\0" + name.encode() + b"\0/opt/x/" + name.encode())
    monkeypatch.setattr(node_metrics, "LD_CACHE", str(cache))
    assert node_metrics.may_load(name)
    assert not node_metrics.may_load("libflotilla-other.so.1")


def test_no_gpu_no_gpu_values_and_no_complaint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    seen: list[events.Event] = []
    with sky.Compute(nodes=1, metrics=[*GPU_METRICS, sky.metrics.Memory(0.2)]) as pool:
        pool.subscribe(on_event=seen.append)
        wait_for(lambda: sum(isinstance(e, events.MetricSample) for e in seen) >= 3, "samples")
        assert not any(k.startswith("gpu") for k in pool.metrics()[0])
    assert not [e for e in seen if isinstance(e, events.MetricFailed)]


# -- events and the view --------------------------------------------------------------------
def test_events_of_calls_logs_and_nodes(caplog: pytest.LogCaptureFixture) -> None:
    """Typed events for the pool's phases, its nodes and each call (function, node,
    duration, ok or the error's type) and its lines; a callback that raises is reported
    once and unsubscribed while the others go on; unsubscribe stops a callback."""
    got: list[events.Event] = []
    logs: list[events.LogLine] = []
    changes: list[tuple[events.PoolView, events.PoolView]] = []
    broken_calls = [0]

    def broken(_: events.Event) -> None:
        broken_calls[0] += 1
        raise RuntimeError("my callback is broken")

    pool = sky.Compute(nodes=2, metrics=None)
    pool.subscribe(on_event=got.append)
    pool.subscribe(on_event=broken)
    with caplog.at_level(logging.WARNING, logger="flotilla"), pool:
        stop = pool.subscribe(on_log=logs.append, on_change=lambda a, b: changes.append((a, b)))
        assert says("hello") >> pool == "hello"
        with pytest.raises(ValueError):
            fails() >> pool
        assert pool.map(pid, []) == []
        stop()
        says("unheard") >> pool
    types = [type(e).__name__ for e in got]
    assert types[0] == "PoolPhase" and types[-1] == "PoolPhase"
    assert [e.phase for e in got if isinstance(e, events.PoolPhase)] == [
        "starting",
        "running",
        "closing",
        "closed",
    ]
    assert sorted(e.node for e in got if isinstance(e, events.NodeReady)) == [0, 1]
    finished = [e for e in got if isinstance(e, events.TaskFinished)]
    assert [(e.function, e.ok, e.error) for e in finished] == [
        ("says", True, None),
        ("fails", False, "ValueError"),
        ("says", True, None),
    ]
    assert all(e.duration >= 0 and e.node in (0, 1) for e in finished)
    started = [e for e in got if isinstance(e, events.TaskStarted)]
    assert [e.function for e in started] == ["says", "fails", "says"]
    assert [line.line for line in logs] == ["hello"]
    assert changes and all(isinstance(b, events.PoolView) for _, b in changes)
    assert broken_calls[0] == 1
    warnings = [r for r in caplog.records if "my callback is broken" in r.getMessage()]
    assert len(warnings) == 1 and "unsubscribed" in warnings[0].getMessage()
    view = pool.view()
    assert view.phase == "closed" and view.done == 2 and view.failed == 1
    assert view.functions["says"].done == 2 and view.functions["fails"].failed == 1
    assert events.from_dict(events.as_dict(finished[1])) == finished[1]


# -- health checks --------------------------------------------------------------------------
def test_health_checker_validates_its_fields() -> None:
    with pytest.raises(sky.ConfigurationError, match="interval"):
        sky.HealthChecker(fn=lambda info: True, interval=0)
    with pytest.raises(sky.ConfigurationError, match="consecutive_failures"):
        sky.HealthChecker(fn=lambda info: True, consecutive_failures=0)
    with pytest.raises(sky.ConfigurationError, match="HealthChecker"):
        sky.Options(health_checker=lambda info: True)  # type: ignore[arg-type]


def test_a_health_check_gates_the_first_call(tmp_path: Path) -> None:
    """Until its check passes a node gets no call: the pool's start waits for it."""
    allow = tmp_path / "allow"
    tried = tmp_path / "tried"

    def check(info: Any) -> bool | str:
        Path(f"{tried}-{info.node}").touch()
        if not allow.exists():
            return "not yet"
        Path(f"{tmp_path}/passed-{info.node}").touch()
        return True

    options = sky.Options(
        health_checker=sky.HealthChecker(check, interval=0.2, consecutive_failures=1000)
    )
    pool = sky.Compute(nodes=2, options=options, metrics=None)
    opened = threading.Event()
    failure: list[BaseException] = []

    def start() -> None:
        try:
            pool.open()
        except BaseException as e:
            failure.append(e)
        opened.set()

    threading.Thread(target=start, daemon=True).start()
    try:
        wait_for(lambda: Path(f"{tried}-0").exists() and Path(f"{tried}-1").exists(), "checks")
        assert not opened.is_set()  # checked, not passed: the pool does not serve yet
        allow.touch()
        assert opened.wait(120) and not failure

        @sky.function
        def passed_before() -> bool:
            return Path(f"{tmp_path}/passed-{sky.instance_info().node}").exists()

        assert passed_before() @ pool == [True, True]
    finally:
        pool.close()


def test_a_node_failing_its_health_check_is_replaced(tmp_path: Path) -> None:
    """A check that raises counts as a failure with the exception's text; after
    ``consecutive_failures`` in a row the node is replaced, and the events say why."""
    sick = tmp_path / "sick"

    def check(info: Any) -> bool:
        if sick.exists() and sick.read_text() == str(os.getpid()):
            raise RuntimeError("the disk is full")
        return True

    got: list[events.Event] = []
    options = sky.Options(
        health_checker=sky.HealthChecker(check, interval=0.1, consecutive_failures=2)
    )
    with sky.Compute(nodes=2, options=options, metrics=None) as pool:
        pool.subscribe(on_event=got.append)
        before = pid() @ pool
        sick.write_text(str(before[1]))
        wait_for(
            lambda: any(isinstance(e, events.NodeReplaced) and e.node == 1 for e in list(got)),
            "node 1 replaced",
        )
        after = pid() @ pool
        assert after[0] == before[0] and after[1] != before[1]
    failed = [e for e in got if isinstance(e, events.NodeHealthFailed)]
    assert [(e.node, e.failures) for e in failed[:2]] == [(1, 1), (1, 2)]
    assert failed[0].why == "RuntimeError: the disk is full"
    lost = [e for e in got if isinstance(e, events.NodeLost)]
    assert len(lost) == 1 and lost[0].node == 1
    assert "failed its health check 2 times in a row: RuntimeError: the disk is full" in lost[0].why


# -- the console ----------------------------------------------------------------------------
LIVE_SCRIPT = """
import os, sys
import flotilla as sky

@sky.function
def burn(path):
    while not os.path.exists(path):
        pass
    return 1

metrics = [sky.metrics.CPU(0.5), sky.metrics.Memory(0.5)]
with sky.Compute(nodes=2, metrics=metrics) as pool:
    futures = [burn(sys.argv[1]) > pool for _ in range(2)]
    print("results", [f.result() for f in futures])
"""


def test_the_console_shows_a_row_of_metrics_per_node_while_calls_run(tmp_path: Path) -> None:
    """On a terminal, while calls run, each node has a live row with its calls, CPU and
    memory; the rows go when the calls end, and what the program prints stays."""
    from _tty import Terminal

    script = tmp_path / "live.py"
    script.write_text(LIVE_SCRIPT)
    release = tmp_path / "release"
    src = str(Path(sky.__file__).resolve().parent.parent)
    argv = ["env", f"PYTHONPATH={src}", sys.executable, str(script), str(release)]
    term = Terminal(argv, 120, 15, tmp_path)
    try:
        screen = term.wait_for(
            lambda s: (
                "(node-0, rank=0) ready 1 call(s) · cpu" in s
                and "(node-1, rank=1) ready 1 call(s) · cpu" in s
            ),
            "a row per node with its metrics",
            timeout=90,
        )
        assert "mem " in screen
        release.touch()
        screen = term.wait_for(lambda s: "[exited]" in s, "the end", timeout=90)
        assert "results [1, 1]" in screen and "call(s) · cpu" not in screen
    finally:
        term.close()


def _view_of(n: int) -> events.PoolView:
    nodes = tuple(
        events.NodeView(
            node=i,
            phase="ready",
            address=f"10.0.0.{i}",
            host="",
            metrics={"cpu": float(i % 100), "mem_used": 1e9, "mem_total": 8e9},
            sampled=1.0,
            running=1,
            done=0,
            failed=0,
        )
        for i in range(n)
    )
    return events.PoolView("p", "running", nodes, n, 0, 0, {}, 0.0)


def test_many_nodes_fold_into_a_summary_row_and_top_pages() -> None:
    """128 nodes: the console's live rows fold into one summary row (the average and the
    busiest node); ``top``'s table shows what the terminal holds and says how many more."""
    import io

    from rich.console import Console as RichConsole

    from flotilla._client.console import Console
    from flotilla._client.observe import stat_rows
    from flotilla.cli.observe import _table, view_dict

    console = Console()
    console.stat_rows = stat_rows(_view_of(128))
    out = io.StringIO()
    RichConsole(file=out, width=160).print(console._render())
    lines = out.getvalue().splitlines()
    assert lines == [
        "128 node(s), 128 call(s) running · cpu avg 42% (max node-99 99%) · mem avg 12% "
        "(max node-127 12%)"
    ]
    console.stat_rows = stat_rows(_view_of(6))
    out = io.StringIO()
    RichConsole(file=out, width=160).print(console._render())
    assert len(out.getvalue().splitlines()) == 6  # one row per node, no summary

    snap = {"cluster": "big", "state": "UP", **view_dict(_view_of(128))}
    out = io.StringIO()
    RichConsole(file=out, width=120).print(_table([snap], "cpu", 14))
    text = out.getvalue()
    rows = [line for line in text.splitlines() if " big " in line]
    assert len(rows) == 14 and "114 more node(s)" in text
    assert rows[0].split("│")[5].strip() == "99%"  # sorted by CPU, busiest first


# -- a cgroup-limited container ---------------------------------------------------------------
def test_a_limited_container_reports_its_limits(container_lab: Any) -> None:
    """A 0.5-CPU, 256 MB container (podman --cpus/--memory: its cgroup's limits) reports
    those as its capacity, not the host's."""
    metrics = [sky.metrics.CPU(0.5), sky.metrics.Memory(0.5)]
    with sky.Compute(
        provider=container_lab.provider(), nodes=1, vcpus=0.5, memory_gb=0.25, metrics=metrics
    ) as pool:
        m = wait_for(
            lambda: (x := pool.metrics().get(0, {})) and "cpu" in x and "mem_total" in x and x,
            "the container's metrics",
        )
    assert m["cpus"] == 0.5
    assert m["mem_total"] == 256 * MB
    assert 0 < m["mem_used"] < 256 * MB


def test_an_elastic_pool_reports_its_size_and_new_nodes() -> None:
    """An elastic pool that grows under a map then shrinks when idle: ``Scaling`` events
    with its size, its new nodes ``NodeReady`` and in the view, the released ones out."""
    got: list[events.Event] = []
    pool = sky.Compute(
        nodes=(1, 3),
        options=sky.Options(autoscale_idle_timeout=0.5, autoscale_cooldown=0.5),
        metrics=None,
    )
    pool.subscribe(on_event=got.append)

    def sizes() -> list[int]:
        return [e.nodes for e in list(got) if isinstance(e, events.Scaling)]

    with pool:
        pool.map(slow, range(9))
        wait_for(lambda: 3 in sizes(), "a Scaling event at 3 nodes")
        wait_for(lambda: sizes()[-1] == 1 and pool.nodes == 1, "back to 1 node")
        wait_for(lambda: len(pool.view().nodes) == 1, "the released nodes out of the view")
    assert sorted({e.node for e in got if isinstance(e, events.NodeReady)}) == [0, 1, 2]


@sky.function
def slow(x: int) -> int:
    time.sleep(0.3)
    return x


def test_top_lists_the_running_python_pools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running ``Compute`` is in ``flotilla top`` (its entry under FLOTILLA_HOME/pools,
    rewritten while it runs), and out of it once closed."""
    monkeypatch.setenv("FLOTILLA_HOME", str(tmp_path / "home"))
    src = str(Path(sky.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": src}

    def top(*args: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "flotilla", "top", "--json", *args],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return dict(json.loads(done.stdout))

    metrics = [sky.metrics.CPU(0.5), sky.metrics.Memory(0.5)]
    with sky.Compute(nodes=2, metrics=metrics) as pool:

        def listed() -> Any:
            found = [c for c in top()["clusters"] if c.get("pool") == pool.pool_id]
            if found and len(found[0]["nodes"]) == 2 and "cpu" in found[0]["nodes"][1]["metrics"]:
                return found[0]
            return None

        entry = wait_for(listed, "the pool in `flotilla top --json`")
        assert entry["pid"] == os.getpid() and entry["cluster"] == f"pool-{pool.pool_id}"
        assert [n["phase"] for n in entry["nodes"]] == ["ready", "ready"]
        assert top(pool.pool_id)["clusters"][0]["pool"] == pool.pool_id
    assert [c for c in top()["clusters"] if c.get("pool") == pool.pool_id] == []
    assert not list((tmp_path / "home" / "pools").glob("*.json"))


# -- SSH hosts (network namespaces) -------------------------------------------------------------
def test_ssh_hosts_report_their_own_machine_and_network(ssh_lab: Any) -> None:
    """Nodes on SSH hosts (each in its own network namespace) sample the machine (host
    scope) and their own network's counters; a bad command is reported per node there
    too."""
    hosts = ssh_lab.hosts[:2]
    metrics = [
        sky.metrics.CPU(0.5),
        sky.metrics.Memory(0.5),
        sky.metrics.Network(0.5),
        sky.metrics.Metric("broken", "exit 7", interval=0.5),
    ]
    got: list[events.Event] = []
    pool = sky.Compute(provider=ssh_lab.provider(hosts), nodes=2, metrics=metrics)
    pool.subscribe(on_event=got.append)
    with pool:
        m = wait_for(
            lambda: (x := pool.metrics()) and all("cpu" in x.get(r, {}) for r in (0, 1)) and x,
            "both hosts' metrics",
        )
        wait_for(
            lambda: len([e for e in list(got) if isinstance(e, events.MetricFailed)]) == 2,
            "the broken metric on both hosts",
        )
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    for rank in (0, 1):
        assert m[rank]["mem_total"] <= total and m[rank]["mem_used"] > 0
        assert m[rank]["net_rx"] >= 0 and "net_tx" in m[rank]
    failed = sorted((e.node, e.why) for e in got if isinstance(e, events.MetricFailed))
    assert failed == [
        (0, "its command exited with status 7"),
        (1, "its command exited with status 7"),
    ]


@sky.function
def passed_here(folder: str) -> bool:
    return Path(folder, f"passed-{os.getpid()}").exists()


def test_a_replacement_serves_only_once_its_health_check_passed(tmp_path: Path) -> None:
    """The node replacing a failed one gets no call before its check passes: a broadcast
    sent meanwhile waits for it, and runs after the check passed there."""
    sick, warm, known = tmp_path / "sick", tmp_path / "warm", tmp_path / "known"

    def check(info: Any) -> bool | str:
        me = str(os.getpid())
        if sick.exists() and sick.read_text() == me:
            raise RuntimeError("the disk is full")
        if known.exists() and me not in known.read_text().split() and not warm.exists():
            return "warming up"
        Path(tmp_path, f"passed-{me}").touch()
        return True

    got: list[events.Event] = []
    lock = threading.Lock()

    def on_event(e: events.Event) -> None:
        with lock:
            got.append(e)

    def warming() -> int:
        with lock:
            return sum(
                1 for e in got if isinstance(e, events.NodeHealthFailed) and e.why == "warming up"
            )

    options = sky.Options(
        health_checker=sky.HealthChecker(check, interval=0.1, consecutive_failures=5)
    )
    with sky.Compute(nodes=2, options=options, metrics=None) as pool:
        pool.subscribe(on_event=on_event)
        before = pid() @ pool
        known.write_text(" ".join(map(str, before)))
        sick.write_text(str(before[1]))
        wait_for(lambda: warming() >= 1, "the replacement's first check failing")
        fut = pool.submit_broadcast(passed_here(str(tmp_path)), nodes=[1])[0]
        wait_for(lambda: warming() >= 2, "its second check failing")
        assert not fut.done()  # node 1 does not serve yet
        warm.touch()
        assert fut.result(120) is True  # it ran once the check had passed there
        assert (pid() @ pool)[1] != before[1]
    kinds = [type(e).__name__ for e in got if getattr(e, "node", None) == 1]
    assert kinds.index("NodeReplaced") > kinds.index("NodeLost")
