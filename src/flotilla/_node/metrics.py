"""A node's metrics, sampled by its agent (standard library only).

The client sends the metrics it wants in CONFIG (``config["metrics"]``: a list of specs,
see :func:`flotilla.metrics.specs`); the agent's :class:`Sampler` samples each at its own
interval and sends what it got as one METRICS frame per wake-up (JSON
``{"t": wall time, "v": {name: value}}``), never per call. Built-in metrics read the
kernel's files, no subprocess:

* ``cpu``: percent of the CPUs this node may use (0-100), ``cpus`` (that capacity in
  CPUs) and ``load`` (the 1-minute load average);
* ``mem``: percent used, ``mem_used`` and ``mem_total`` in bytes;
* ``disk``: percent of a path's filesystem used; ``net``: bytes received and sent;
* ``gpu_*``: per GPU utilisation, memory used and total (MB) and temperature, through
  NVML (``libnvidia-ml.so.1`` with ctypes), else ``nvidia-smi --query-gpu ...
  --format=csv`` run in the background; a node without either has no GPU values.

Where the usage is measured (``scope``):

* ``"tree"`` (providers whose nodes share one machine: local processes, containers): CPU
  and memory are those of the agent's own process tree, so node 1 burning a core shows
  on node 1 only;
* ``"host"`` (a machine of its own): the cgroup's usage where the cgroup has a limit (a
  SLURM job, a pod, a limited container), else the machine's (``/proc/stat``,
  ``/proc/meminfo``).

Capacities (``cpus``, ``mem_total``) are the cgroup's limits where there are any (v2:
``cpu.max``, ``memory.max``; v1: ``cpu.cfs_quota_us``, ``memory.limit_in_bytes``,
looked up from the process's cgroup to the top), not the host's.

A user metric is a shell command run in the background (its own session; the agent is
never blocked): its output is a number (``multi``: one per line, named ``name_0``,
``name_1``...). A command that fails, prints something else, or runs longer than twice
its interval (2 s at least, :data:`COMMAND_TIMEOUT` at most; then it is killed) is
reported once (``{"error": [name, why]}``) and not run again on this node.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable

from .._system import fastjson as json

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # (typeshed has no _signal: signal's names, its types)
    from typing import Any
else:
    import _signal  # signal.py's C module: the same calls and SIG* ints, without its enums

COMMAND_TIMEOUT = 10.0
"""Seconds a metric's command may run at most before it is killed and reported: twice its
interval, between 2 s and this."""
_CG = "/sys/fs/cgroup"
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_SMI_FIELDS = "utilization.gpu,memory.used,memory.total,temperature.gpu"
_GPU_KINDS = ("gpu_util", "gpu_mem_mb", "gpu_mem_total_mb", "gpu_temp")
NVML_LIBRARY = "libnvidia-ml.so.1"
LD_CACHE = "/etc/ld.so.cache"
"""The dynamic loader's cache: every library ``ldconfig`` found, by name."""
_MULTIARCH = getattr(sys.implementation, "_multiarch", "") or f"{os.uname().machine}-linux-gnu"
LIBRARY_DIRS = (
    *("/lib", "/usr/lib", "/lib64", "/usr/lib64", f"/lib/{_MULTIARCH}", f"/usr/lib/{_MULTIARCH}"),
    *(os.path.join(sys.base_prefix, "lib"), "/run/opengl-driver/lib"),
)
"""The folders a library name resolves in without ``LD_LIBRARY_PATH`` or the cache: the
loader's defaults (a distribution's or a multiarch one's), the interpreter's own ``lib``
(where a run path of its may point) and NixOS's driver folder."""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


# -- cgroups ---------------------------------------------------------------------------
def _cgroup_dirs() -> list[str]:
    """This process's cgroup folders (v2's, or v1's memory and cpu), deepest first, up to
    the mount point."""
    out: list[str] = []
    for line in _read("/proc/self/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base = _CG if os.path.exists(f"{_CG}/cgroup.controllers") else f"{_CG}/unified"
        elif "memory" in controllers.split(","):
            base = f"{_CG}/memory"
        elif "cpu" in controllers.split(","):
            base = f"{_CG}/{controllers}"
            if not os.path.isdir(base):
                base = f"{_CG}/cpu"
        else:
            continue
        here = base + path.rstrip("/")
        while not os.path.isdir(here) and here != base:  # a namespace: the mount is ours
            here = os.path.dirname(here)
        while True:
            out.append(here)
            if here == base or len(here) <= len(base):
                break
            here = os.path.dirname(here)
    return out


def _number(text: str) -> float | None:
    try:
        return float(text.split()[0])
    except (IndexError, ValueError):
        return None


class Cgroup:
    """The limits (and where they are, the usage) of this process's cgroup."""

    def __init__(self) -> None:
        self.dirs = _cgroup_dirs()
        self.cpus: float | None = None  # the CPU limit, in CPUs
        self.mem: int | None = None  # the memory limit, bytes
        self.cpu_dir = ""  # where the CPU limit is (its usage is read there)
        self.mem_dir = ""
        for d in self.dirs:
            cpu = _read(f"{d}/cpu.max").split()
            quota: float | None = None
            if len(cpu) == 2 and cpu[0] != "max":
                quota = float(cpu[0]) / float(cpu[1])
            else:
                q, p = (
                    _number(_read(f"{d}/cpu.cfs_quota_us")),
                    _number(_read(f"{d}/cpu.cfs_period_us")),
                )
                if q is not None and p and q > 0:
                    quota = q / p
            if quota is not None and (self.cpus is None or quota < self.cpus):
                self.cpus, self.cpu_dir = quota, d
            mem = _number(_read(f"{d}/memory.max") or _read(f"{d}/memory.limit_in_bytes"))
            if mem is not None and mem < (1 << 60) and (self.mem is None or mem < self.mem):
                self.mem, self.mem_dir = int(mem), d

    def cpu_usage(self) -> float | None:
        """CPU seconds used by the limited cgroup so far."""
        for line in _read(f"{self.cpu_dir}/cpu.stat").splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
        v1 = _number(_read(f"{self.cpu_dir}/cpuacct.usage"))
        return v1 / 1e9 if v1 is not None else None

    def mem_usage(self) -> int | None:
        used = _number(
            _read(f"{self.mem_dir}/memory.current")
            or _read(f"{self.mem_dir}/memory.usage_in_bytes")
        )
        if used is None:
            return None
        for line in _read(f"{self.mem_dir}/memory.stat").splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):  # page cache it can drop
                used -= float(value)
                break
        return max(0, int(used))


# -- process trees ---------------------------------------------------------------------
def tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            todo += [int(c) for c in _read(f"/proc/{pid}/task/{tid}/children").split()]
    return out


def _proc_times(pid: int) -> tuple[int, int] | None:
    """(start time, CPU ticks used) of a process."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 20:
        return None
    return int(fields[19]), int(fields[11]) + int(fields[12])


def _on_path(command: str) -> bool:
    """Whether ``command`` is an executable file in a folder of ``PATH`` (what
    ``shutil.which`` answers, without importing ``shutil`` and its compression modules:
    ~1 ms of a node's start, whose first sample looks for ``nvidia-smi``)."""
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", command)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return True
    return False


def _rss(pid: int) -> int:
    statm = _read(f"/proc/{pid}/statm").split()
    return int(statm[1]) * _PAGE if len(statm) > 1 else 0


# -- GPUs ------------------------------------------------------------------------------
class NVML:
    """The GPUs through NVML (``libnvidia-ml.so.1``, as nvidia-smi reads them)."""

    def __init__(self, lib: Any) -> None:
        import ctypes

        class Util(ctypes.Structure):
            _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]

        class Mem(ctypes.Structure):
            _fields_ = [
                ("total", ctypes.c_ulonglong),
                ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong),
            ]

        self.lib = lib
        self.structs = (Util, Mem)

    @classmethod
    def load(cls) -> NVML | None:
        """NVML, where its library loads and initialises; else None. The library is looked
        for where the loader would find it (:func:`may_load`), then with ``_ctypes.dlopen``:
        a node without it (most) imports neither ``_ctypes`` (~0.7 ms of a node's start,
        whose first sample looks, with the failed ``dlopen``) nor ``ctypes`` (~1.5 ms).
        Where it is, it stays loaded (not closed and loaded again: ``CDLL`` then finds it
        there)."""
        if not may_load(NVML_LIBRARY):
            return None
        try:
            import _ctypes

            _ctypes.dlopen(NVML_LIBRARY)
        except (ImportError, OSError):
            return None
        import ctypes

        try:
            lib = ctypes.CDLL(NVML_LIBRARY)
            init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
            if init() != 0:
                return None
        except (OSError, AttributeError):
            return None
        return cls(lib)

    def sample(self) -> list[dict[str, float]]:
        import ctypes

        Util, Mem = self.structs
        lib = self.lib
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        out = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                continue
            values: dict[str, float] = {}
            util, mem, temp = Util(), Mem(), ctypes.c_uint(0)
            if lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) == 0:
                values["gpu_util"] = float(util.gpu)
            if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) == 0:
                values["gpu_mem_mb"] = mem.used / (1 << 20)
                values["gpu_mem_total_mb"] = mem.total / (1 << 20)
            if lib.nvmlDeviceGetTemperature(handle, 0, ctypes.byref(temp)) == 0:
                values["gpu_temp"] = float(temp.value)
            out.append(values)
        return out


def may_load(name: str) -> bool:
    """Whether ``dlopen(name)`` may find the library ``name`` (a file name, no folder): it
    is in a folder of ``LD_LIBRARY_PATH``, the loader's cache (:data:`LD_CACHE`) names it,
    or it is in one of :data:`LIBRARY_DIRS`. These are where the loader looks (but for the
    run paths of libraries other than the interpreter's, and the ``glibc-hwcaps``
    subfolders, where no driver puts NVML), so a "no" is exact, and a wrong "may" costs
    only the ``dlopen``. ~0.05 ms: a few ``stat`` calls and one read of the cache."""
    path = os.environ.get("LD_LIBRARY_PATH", "").replace(";", ":").split(":")
    if any(os.path.exists(os.path.join(d, name)) for d in (*[d for d in path if d], *LIBRARY_DIRS)):
        return True
    try:
        with open(LD_CACHE, "rb") as f:
            return name.encode() in f.read()
    except OSError:
        return False


def parse_smi(text: str) -> list[dict[str, float]]:
    """``nvidia-smi --query-gpu=utilization.gpu,memory.used,memory.total,temperature.gpu
    --format=csv,noheader,nounits``'s output: a line per GPU; "[N/A]" fields are left
    out. ValueError when a line is not that."""
    out = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(_GPU_KINDS):
            raise ValueError(f"not a GPU line: {line[:80]!r}")
        values = {}
        for kind, cell in zip(_GPU_KINDS, cells, strict=True):
            if cell.strip("[]").upper() in ("N/A", "NOT SUPPORTED", "UNKNOWN ERROR"):
                continue
            values[kind] = float(cell)
        out.append(values)
    return out


# -- the sampler -----------------------------------------------------------------------
class _Command:
    """A shell command run in the background for one metric (or the GPUs' nvidia-smi)."""

    def __init__(self, command: str, now: float, timeout: float) -> None:
        import subprocess  # (only for a command's metric: not at every agent's start)

        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.out = bytearray()
        self.deadline = now + timeout
        self.timeout = timeout
        self.eof = False

    def read(self) -> None:
        try:
            while True:
                data = os.read(self.fd, 65536)
                if not data:
                    self.eof = True
                    return
                self.out += data
                if len(self.out) > 65536:  # garbage: more than any number
                    self.eof = True
                    return
        except BlockingIOError:
            return
        except OSError:
            self.eof = True

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, _signal.SIGKILL)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.proc.wait()

    def close(self) -> None:
        """Close its output and reap it; one still running after closing its output (a
        moment's grace) is killed, and its status taken as success (it said its value)."""
        import subprocess

        assert self.proc.stdout is not None
        self.proc.stdout.close()
        try:
            self.proc.wait(0.05)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, _signal.SIGKILL)
            self.proc.wait()
            self.proc.returncode = 0


class Sampler:
    """Samples a node's metrics at their intervals (see the module docstring).

    Args:
        specs: the metrics (``flotilla.metrics.specs``).
        scope: ``"tree"`` or ``"host"``.
        send: sends one METRICS body (a dict) to the client.
        watch: ``watch(fd, callback)`` calls ``callback`` when ``fd`` can be read;
            ``watch(fd, None)`` stops.
        root: the process whose tree is the node (the agent).
    """

    def __init__(
        self,
        specs: list[dict[str, Any]],
        scope: str,
        send: Callable[[dict[str, Any]], None],
        watch: Callable[[int, Callable[[], None] | None], None],
        root: int,
    ) -> None:
        self.specs = [dict(s) for s in specs]
        self.scope = scope
        self.send = send
        self.watch = watch
        self.root = root
        now = time.monotonic()
        for s in self.specs:
            s["due"] = now  # a first sample at once (the CPU's a little later: a delta)
            s["interval"] = max(0.1, float(s.get("interval") or 2.0))
            if s["kind"] == "cpu":
                s["due"] = now + min(1.0, s["interval"])
        self.cgroup = Cgroup()
        self.cpus = self.cgroup.cpus or float(len(os.sched_getaffinity(0)))
        self.cpus_host = float(os.cpu_count() or 1)
        self._cpu_prev: tuple[float, Any] | None = None
        self._cpu_last: dict[str, float] = {}
        self._nvml: NVML | bool | None = False  # False: not looked for yet
        self._running: dict[str, _Command] = {}  # by metric name (or "gpu")
        self._gpu_waiting: list[dict[str, Any]] = []
        self._cpu("init")
        self.due = 0.0
        self._next()

    # -- the agent's loop ------------------------------------------------------------
    def _next(self) -> None:
        """When :meth:`tick` is next wanted (the agent checks ``due``, nothing more)."""
        wake = float("inf")
        for s in self.specs:
            wake = min(wake, s["due"])
        for c in self._running.values():
            wake = min(wake, c.deadline)
        self.due = wake

    def tick(self, now: float) -> None:
        values: dict[str, float] = {}
        for s in self.specs:
            if now < s["due"]:
                continue
            s["due"] = now + s["interval"]
            try:
                self._sample(s, now, values)
            except Exception as e:  # a built-in's surprise: said once, never again
                self._fail(s, f"{type(e).__name__}: {e}")
        for key, c in list(self._running.items()):
            if now >= c.deadline:
                self.watch(c.fd, None)  # before its descriptor closes
                c.kill()
                del self._running[key]
                self._finished(key, None, f"its command ran longer than {c.timeout:g} s (killed)")
        if values:
            self.send({"t": time.time(), "v": values})
        self.specs = [s for s in self.specs if not s.get("off")]
        self._next()

    def close(self) -> None:
        for c in self._running.values():
            self.watch(c.fd, None)
            c.kill()
        self._running.clear()

    # -- sampling --------------------------------------------------------------------
    def _sample(self, s: dict[str, Any], now: float, values: dict[str, float]) -> None:
        kind = s["kind"]
        if kind == "cpu":
            values.update(self._cpu(s["name"]))
        elif kind in ("mem", "mem_used_mb", "mem_total_mb"):
            used, total = self._memory()
            if kind == "mem":
                values["mem"] = round(100.0 * used / total, 1) if total else 0.0
                values["mem_used"] = float(used)
                values["mem_total"] = float(total)
            else:
                values[s["name"]] = float((used if kind == "mem_used_mb" else total) >> 20)
        elif kind == "disk":
            st = os.statvfs(s["path"])
            total = st.f_blocks * st.f_frsize
            free = st.f_bavail * st.f_frsize
            values[s["name"]] = round(100.0 * (total - free) / total, 1) if total else 0.0
        elif kind == "net":
            rx = tx = 0
            for line in _read("/proc/net/dev").splitlines()[2:]:
                iface, _, rest = line.partition(":")
                iface = iface.strip()
                if iface == "lo" or (s.get("interface") and iface != s["interface"]):
                    continue
                cells = rest.split()
                rx, tx = rx + int(cells[0]), tx + int(cells[8])
            suffix = f"_{s['interface']}" if s.get("interface") else ""
            values[f"net_rx{suffix}"], values[f"net_tx{suffix}"] = float(rx), float(tx)
        elif kind in _GPU_KINDS:
            self._gpus(s, now, values)
        elif kind == "command" and s["name"] not in self._running:
            self._start(s["name"], s["command"], now, s["interval"])

    def _cpu(self, name: str) -> dict[str, float]:
        now = time.monotonic()
        if self.scope == "tree":
            used: Any = {}
            for pid in tree(self.root):
                t = _proc_times(pid)
                if t is not None:
                    used[(pid, t[0])] = t[1] / _TICK
        elif self.cgroup.cpu_dir:
            used = self.cgroup.cpu_usage()
        else:
            cells = [int(c) for c in _read("/proc/stat").split("\n", 1)[0].split()[1:]]
            idle = cells[3] + (cells[4] if len(cells) > 4 else 0)
            used = (sum(cells[:8]) - idle) / _TICK
        prev, self._cpu_prev = self._cpu_prev, (now, used)
        out = {"cpus": round(self.cpus, 2), "load": round(os.getloadavg()[0], 2)}
        if prev is None or used is None or now <= prev[0]:
            return out
        dt = now - prev[0]
        if isinstance(used, dict):
            before = prev[1]
            busy = sum(v - before.get(k, 0.0) for k, v in used.items())
            capacity = self.cpus
        else:
            busy = used - prev[1]
            capacity = self.cpus if self.cgroup.cpu_dir else self.cpus_host
        out["cpu"] = round(max(0.0, min(100.0, 100.0 * busy / dt / capacity)), 1)
        return out

    def _memory(self) -> tuple[int, int]:
        info: dict[str, int] = {}
        for line in _read("/proc/meminfo").splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                info[key] = int(rest.split()[0]) * 1024
        total = self.cgroup.mem or info.get("MemTotal", 0)
        if self.scope == "tree":
            used = sum(_rss(pid) for pid in tree(self.root))
        elif self.cgroup.mem_dir:
            used = self.cgroup.mem_usage() or 0
        else:
            used = info.get("MemTotal", 0) - info.get("MemAvailable", 0)
        return used, total

    def _gpus(self, s: dict[str, Any], now: float, values: dict[str, float]) -> None:
        if self._nvml is False:
            self._nvml = NVML.load()
            if self._nvml is None and not _on_path("nvidia-smi"):
                self._nvml = True  # no GPU here: no GPU values, nothing to report
        if self._nvml is True:
            s["off"] = True
            return
        if isinstance(self._nvml, NVML):
            self._put_gpus(s, self._nvml.sample(), values)
            return
        self._gpu_waiting.append(s)
        if "gpu" not in self._running:
            self._start(
                "gpu",
                f"nvidia-smi --query-gpu={_SMI_FIELDS} --format=csv,noheader,nounits",
                now,
                s["interval"],
            )

    @staticmethod
    def _put_gpus(
        s: dict[str, Any], gpus: list[dict[str, float]], values: dict[str, float]
    ) -> None:
        index = s.get("index")
        for i, gpu in enumerate(gpus):
            if (index is None or index == i) and s["kind"] in gpu:
                values[f"{s['kind']}_{i}"] = gpu[s["kind"]]

    # -- commands --------------------------------------------------------------------
    def _start(self, key: str, command: str, now: float, interval: float) -> None:
        try:
            c = _Command(command, now, min(COMMAND_TIMEOUT, max(2.0, 2 * interval)))
        except OSError as e:
            self._finished(key, None, f"its command could not start: {e}")
            return
        self._running[key] = c
        self.due = min(self.due, c.deadline)

        def readable() -> None:
            c.read()
            if c.eof:
                self.watch(c.fd, None)
                c.close()
                self._running.pop(key, None)
                status = c.proc.returncode
                if status not in (0, None):
                    self._finished(key, None, f"its command exited with status {status}")
                else:
                    self._finished(key, bytes(c.out), "")

        self.watch(c.fd, readable)

    def _finished(self, key: str, out: bytes | None, why: str) -> None:
        values: dict[str, float] = {}
        if key == "gpu":
            waiting, self._gpu_waiting = self._gpu_waiting, []
            if out is not None:
                try:
                    gpus = parse_smi(out.decode(errors="replace"))
                except ValueError as e:
                    why = f"nvidia-smi printed something else than GPU values ({e})"
                else:
                    for s in waiting:
                        self._put_gpus(s, gpus, values)
            if why:
                for s in waiting:
                    self._fail(s, why)
        else:
            spec = next((x for x in self.specs if x["name"] == key), None)
            if spec is None:
                return
            if out is not None:
                try:
                    values.update(_parse(spec, out))
                except ValueError as e:
                    why = str(e)
            if why:
                self._fail(spec, why)
        if values:
            self.send({"t": time.time(), "v": values})

    def _fail(self, s: dict[str, Any], why: str) -> None:
        if s.get("off"):
            return
        s["off"] = True
        if s["kind"] in _GPU_KINDS:  # the GPU query failed: every GPU metric stops
            for other in self.specs:
                if other["kind"] in _GPU_KINDS:
                    other["off"] = True
            self.send({"t": time.time(), "error": ["gpu", why]})
            return
        self.send({"t": time.time(), "error": [s["name"], why]})


def _parse(s: dict[str, Any], out: bytes) -> dict[str, float]:
    """A command's output as values: a number (``multi``: a number per line)."""
    lines = [line.strip() for line in out.decode(errors="replace").strip().splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        raise ValueError("its command printed nothing (a number was expected)")
    try:
        numbers = [float(line.rstrip("%")) for line in lines]
    except ValueError:
        raise ValueError(f"its command printed {lines[0][:60]!r}, not a number") from None
    if s.get("multi"):
        return {f"{s['name']}_{i}": v for i, v in enumerate(numbers)}
    if len(numbers) > 1:
        raise ValueError(
            f"its command printed {len(numbers)} lines (one number expected; multi=True "
            "names each line's value name_0, name_1...)"
        )
    return {s["name"]: numbers[0]}


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
