"""The systems under test: flotilla, its peers and the raw-pipe floor.

Every system has the same shape, so that one driver (``trial.py``) measures them all:

* ``start()`` / ``first()`` / ``stop()``: bring up 4 workers, wait for the first no-op
  result, tear everything down (a cold start is these three on a stopwatch);
* ``round_trip()``, ``many(n)``, ``broadcast(arr)``, ``node_pids()``: the warm operations;
  a system that lacks one leaves it out of ``measures``.

Imports of the system's library happen in ``__init__``, before any clock starts.
"""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar

import tasks

NODES = 4
BENCH_DIR = Path(__file__).resolve().parent


class System:
    """Base class; see the module docstring."""

    name: ClassVar[str]
    # metric -> how the operation is written, for the report
    measures: ClassVar[dict[str, str]] = {}
    # what the processes of one node are, in the order node_pids() returns them
    node_processes: ClassVar[tuple[str, ...]] = ()

    def start(self) -> None:
        raise NotImplementedError

    def first(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def round_trip(self) -> None:
        raise NotImplementedError

    def many(self, n: int) -> None:
        raise NotImplementedError

    def broadcast(self, arr: Any) -> list[float]:
        raise NotImplementedError

    def node_pids(self) -> list[list[int]]:
        raise NotImplementedError


class Flotilla(System):
    name = "flotilla"
    measures = {
        "cold_start": "`with Compute(nodes=4) as pool: noop() @ pool`",
        "round_trip": "`noop() >> pool`",
        "throughput": "`gather(*calls) >> pool`",
        "broadcast": "`total(arr) @ pool` (shared memory)",
        "memory": "agent + executor",
    }
    node_processes = ("executor", "agent")

    def __init__(self) -> None:
        import flotilla as sky

        self.sky = sky
        self.compute = sky.Compute  # imports the pool's modules now, not on the clock
        self.noop = sky.function(tasks.noop)
        self.total = sky.function(tasks.total)
        self.whoami = sky.function(tasks.whoami)

    def start(self) -> None:
        self.pool = self.compute(nodes=NODES).__enter__()

    def first(self) -> None:
        self.noop() @ self.pool

    def stop(self) -> None:
        self.pool.__exit__(None, None, None)

    def round_trip(self) -> None:
        self.noop() >> self.pool

    def many(self, n: int) -> None:
        results = self.sky.gather(*[self.noop(i) for i in range(n)]) >> self.pool
        _check(len(results) == n, f"{len(results)} results for {n} calls")

    def broadcast(self, arr: Any) -> list[float]:
        return self.total(arr) @ self.pool

    def node_pids(self) -> list[list[int]]:
        return [list(pids) for pids in self.whoami() @ self.pool]


class Ray(System):
    name = "Ray"
    measures = {
        "cold_start": "`ray.init(num_cpus=4)` → 4 no-op tasks done",
        "round_trip": "`ray.get(f.remote())`",
        "throughput": "`ray.get([f.remote() ...])`",
        "broadcast": "`ray.put(arr)` + 4 tasks",
        "memory": "one worker process (raylet, GCS: per machine, not counted)",
    }
    node_processes = ("worker",)

    def __init__(self) -> None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray

        self.ray: Any = ray  # untyped use: its stubs do not know default arguments
        self.noop = self.ray.remote(tasks.noop)
        self.total = self.ray.remote(tasks.total)
        self.whoami = self.ray.remote(tasks.whoami)

    def start(self) -> None:
        self.ray.init(num_cpus=NODES, include_dashboard=False)

    def first(self) -> None:
        self.ray.get([self.noop.remote() for _ in range(NODES)])

    def stop(self) -> None:
        self.ray.shutdown()

    def round_trip(self) -> None:
        self.ray.get(self.noop.remote())

    def many(self, n: int) -> None:
        results = self.ray.get([self.noop.remote(i) for i in range(n)])
        _check(len(results) == n, f"{len(results)} results for {n} calls")

    def broadcast(self, arr: Any) -> list[float]:
        ref = self.ray.put(arr)
        return list(self.ray.get([self.total.remote(ref) for _ in range(NODES)]))

    def node_pids(self) -> list[list[int]]:
        # tasks that overlap in time land on different workers
        found = self.ray.get([self.whoami.remote(0.3) for _ in range(NODES)])
        return [[pid] for pid in sorted({pid for pid, _ in found})]


class Dask(System):
    name = "Dask"
    measures = {
        "cold_start": "`LocalCluster(4)` + `Client` → `client.run(noop)`",
        "round_trip": "`client.submit(f, pure=False).result()`",
        "throughput": "`client.gather(client.map(f, ...))`",
        "broadcast": "`scatter(arr, broadcast=True)` + 4 tasks",
        "memory": "one worker process (scheduler and nannies live in the client process)",
    }
    node_processes = ("worker",)

    def __init__(self) -> None:
        import logging

        import distributed

        self.distributed: Any = distributed  # partly untyped
        self.quiet = logging.ERROR

    def start(self) -> None:
        self.cluster = self.distributed.LocalCluster(
            n_workers=NODES,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=self.quiet,
        )
        self.client = self.distributed.Client(self.cluster)

    def first(self) -> None:
        self.client.run(tasks.noop)

    def stop(self) -> None:
        self.client.close()
        self.cluster.close()

    def round_trip(self) -> None:
        self.client.submit(tasks.noop, pure=False).result()

    def many(self, n: int) -> None:
        results = self.client.gather(self.client.map(tasks.noop, range(n), pure=False))
        _check(len(results) == n, f"{len(results)} results for {n} calls")

    def broadcast(self, arr: Any) -> list[float]:
        data = self.client.scatter(arr, broadcast=True, hash=False)
        workers = list(self.client.scheduler_info()["workers"])
        futures = [self.client.submit(tasks.total, data, workers=[w], pure=False) for w in workers]
        return list(self.client.gather(futures))

    def node_pids(self) -> list[list[int]]:
        return [[pid] for pid, _ in self.client.run(tasks.whoami).values()]


class Multiprocessing(System):
    name = "multiprocessing"
    measures = {
        "cold_start": "spawn `Pool(4)` → `map(noop)`",
        "round_trip": "`Pool.apply(noop)`",
        "throughput": "`ProcessPoolExecutor(4)`: submit + result",
        "broadcast": "`Pool.map(total, [arr] * 4)` (pickled through pipes)",
        "memory": "one pool worker",
    }
    node_processes = ("worker",)

    def __init__(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.ctx = multiprocessing.get_context("spawn")
        self.executor_class = ProcessPoolExecutor
        self.executor: ProcessPoolExecutor | None = None

    def start(self) -> None:
        self.pool = self.ctx.Pool(NODES)

    def first(self) -> None:
        self.pool.map(tasks.noop, range(NODES), chunksize=1)

    def stop(self) -> None:
        self.pool.close()
        self.pool.join()
        if self.executor is not None:
            self.executor.shutdown()

    def round_trip(self) -> None:
        self.pool.apply(tasks.noop)

    def many(self, n: int) -> None:
        if self.executor is None:
            self.executor = self.executor_class(NODES, mp_context=self.ctx)
        futures = [self.executor.submit(tasks.noop, i) for i in range(n)]
        results = [f.result() for f in futures]
        _check(len(results) == n, f"{len(results)} results for {n} calls")

    def broadcast(self, arr: Any) -> list[float]:
        return self.pool.map(tasks.total, [arr] * NODES, chunksize=1)

    def node_pids(self) -> list[list[int]]:
        found = self.pool.map(tasks.whoami, [0.3] * NODES, chunksize=1)
        return [[pid] for pid in sorted({pid for pid, _ in found})]


_ECHO = """
import os
while data := os.read(0, 65536):
    os.write(1, data)
"""

_SUM = """
import os, struct, sys
import numpy as np
stdin = sys.stdin.buffer.raw
def fill(view):
    got = 0
    while got < len(view):
        n = stdin.readinto(view[got:])
        if not n:
            sys.exit(0)
        got += n
head, buf = bytearray(8), bytearray()
while True:
    fill(memoryview(head))
    (size,) = struct.unpack("<Q", head)
    if len(buf) != size:
        buf = bytearray(size)
    fill(memoryview(buf))
    os.write(1, struct.pack("<d", float(np.frombuffer(buf).sum())))
"""


class RawPipe(System):
    """The floor: plain pipes between this process and its children, no framework."""

    name = "raw pipes (floor)"
    measures = {
        "round_trip": "16-byte ping-pong with a child (`os.write` / `os.read`)",
        "broadcast": "100 MB written to 4 children's stdin, each replies its sum",
    }
    # CPUs for (this process, the echo child); None: wherever the kernel puts them
    pinned: ClassVar[tuple[int, int] | None] = None

    def start(self) -> None:
        self.echo = _child(_ECHO)
        self.summers = [_child(_SUM) for _ in range(NODES)] if "broadcast" in self.measures else []
        if self.pinned is not None:
            os.sched_setaffinity(0, {self.pinned[0]})
            os.sched_setaffinity(self.echo.pid, {self.pinned[1]})

    def first(self) -> None:
        self.round_trip()

    def stop(self) -> None:
        for proc in [self.echo, *self.summers]:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(5)
            assert proc.stdout is not None
            proc.stdout.close()

    def round_trip(self) -> None:
        out, back = _fds(self.echo)
        os.write(out, b"0123456789abcdef")
        got = 0
        while got < 16:
            got += len(os.read(back, 64))

    def broadcast(self, arr: Any) -> list[float]:
        data = memoryview(arr).cast("B")
        for proc in self.summers:
            out, _ = _fds(proc)
            _write_all(out, struct.pack("<Q", data.nbytes))
            _write_all(out, data)
        return [_read_float(_fds(proc)[1]) for proc in self.summers]


class RawPipeAcrossCpus(RawPipe):
    """The ping-pong with the two processes pinned to different CPUs (for orientation)."""

    name = "raw pipes, pinned to 2 CPUs"
    measures = {"round_trip": "the same ping-pong, parent on CPU 0 and child on CPU 1"}
    pinned = (0, 1)


_RELAY = f"""
import os, select, subprocess, sys
echo = subprocess.Popen([sys.executable, "-c", {_ECHO!r}], stdin=-1, stdout=-1, bufsize=0)
to_echo, from_echo = echo.stdin.fileno(), echo.stdout.fileno()
poller = select.epoll()
poller.register(0, select.EPOLLIN)
poller.register(from_echo, select.EPOLLIN)
while True:
    for fd, _ in poller.poll():
        data = os.read(fd, 65536)
        if not data:
            sys.exit(0)
        os.write(to_echo if fd == 0 else 1, data)
"""


class RelayedPipe(RawPipe):
    """The ping-pong along flotilla's path, with nothing else: the architecture's floor.

    The message goes through a middle process (as through an agent) to an echo process
    (as to an executor) and back; the reply is read by an asyncio loop in another thread,
    which wakes the caller through a Future (as flotilla's client does).
    """

    name = "raw pipes, relayed like flotilla"
    measures = {
        "round_trip": "the ping-pong through a relay process, "
        "the reply read by an asyncio loop thread"
    }

    def start(self) -> None:
        self.echo = _child(_RELAY)
        self.summers = []
        self.waiting: Future[None] = Future()
        self.got = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.loop.call_soon_threadsafe(self.loop.add_reader, _fds(self.echo)[1], self._readable)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.remove_reader, _fds(self.echo)[1])
        self.loop.call_soon_threadsafe(self.loop.stop)
        super().stop()

    def _readable(self) -> None:
        self.got += len(os.read(_fds(self.echo)[1], 64))
        if self.got >= 16:
            self.waiting.set_result(None)

    def round_trip(self) -> None:
        self.waiting, self.got = Future(), 0
        os.write(_fds(self.echo)[0], b"0123456789abcdef")
        self.waiting.result()


class Torchrun(System):
    """Cold start only: ``torchrun`` with 4 processes, until rank 0 is past a barrier."""

    name = "torchrun"
    measures = {"cold_start": "`torchrun --nproc-per-node=4` → first `barrier()` done"}

    def start(self) -> None:
        torchrun = Path(sys.executable).with_name("torchrun")
        script = BENCH_DIR / "torch_barrier.py"
        self.proc = subprocess.Popen(
            [str(torchrun), "--standalone", f"--nproc-per-node={NODES}", str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=BENCH_DIR,
        )

    def first(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        _check(line.strip() == b"barrier", f"torchrun printed {line!r}, not 'barrier'")

    def stop(self) -> None:
        _check(self.proc.wait(60) == 0, f"torchrun exited with {self.proc.returncode}")
        assert self.proc.stdout is not None
        self.proc.stdout.close()


SYSTEMS: dict[str, type[System]] = {
    cls.name: cls
    for cls in (
        Flotilla,
        Ray,
        Dask,
        Multiprocessing,
        RawPipe,
        RawPipeAcrossCpus,
        RelayedPipe,
        Torchrun,
    )
}


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"wrong result: {what}")


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )


def _fds(proc: subprocess.Popen[bytes]) -> tuple[int, int]:
    assert proc.stdin is not None and proc.stdout is not None
    return proc.stdin.fileno(), proc.stdout.fileno()


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view) :]


def _read_float(fd: int) -> float:
    data = b""
    while len(data) < 8:
        chunk = os.read(fd, 8 - len(data))
        _check(bool(chunk), "a pipe child exited without replying")
        data += chunk
    value: float = struct.unpack("<d", data)[0]
    return value
