"""Which metrics every node samples: Skyward's ``sky.metrics`` (same names, same factories).

    import flotilla as sky

    sky.Compute(nodes=4)                                  # the Default(): CPU, memory, GPU...
    sky.Compute(metrics=[sky.metrics.CPU(interval=0.5), sky.metrics.Disk("/data")])
    sky.Compute(metrics=None)                             # none at all
    sky.Image(metrics=[...])                              # or on the Image, as in Skyward
    sky.metrics.Metric("open_fds", "ls /proc/self/fd | wc -l", interval=5)  # your own

The factories' metrics are sampled by the node's agent itself from the kernel's files (no
process is started; their ``command`` is Skyward's shell form, kept for reading); a
:class:`Metric` of your own runs its shell command on the node at its interval, in the
background, and its output (a number; with ``multi``, one per line) is the value. What
each metric emits, in ``pool.metrics()`` and the events:

=====================  ==================================================================
``CPU()``              ``cpu`` (percent of the CPUs the node may use), ``cpus`` (those
                       CPUs: a cgroup's limit, e.g. 0.5), ``load`` (1-minute load)
``Memory()``           ``mem`` (percent), ``mem_used``, ``mem_total`` (bytes; the total is
                       a cgroup's limit where there is one)
``MemoryUsed()``       ``mem_used_mb``; ``MemoryTotal()``: ``mem_total_mb``
``GPU()``              ``gpu_util_0``, ``gpu_util_1``... (percent); ``GPU(index=1)``: one GPU
``GPUMemory()``        ``gpu_mem_mb_N``; ``GPUMemoryTotal()``: ``gpu_mem_total_mb_N``
``GPUTemp()``          ``gpu_temp_N`` (Celsius)
``Disk(path)``         ``disk_<path>`` (percent of its filesystem used; ``disk_root``)
``Network()``          ``net_rx``, ``net_tx`` (bytes since boot, every interface but lo);
                       ``NetworkRx(iface)``/``NetworkTx(iface)``: ``net_rx_<iface>``...
=====================  ==================================================================

Where the nodes of a pool share one machine (the local and container providers), CPU and
memory are those of the node's own processes; elsewhere, the machine's, or its cgroup's
(a SLURM job, a pod). GPU values come from NVML, else ``nvidia-smi``; a node without GPUs
has none. A command that fails, hangs (10 s) or prints something other than a number is
reported once per node (``events.MetricFailed``, and a console line) and not run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from ._errors import ConfigurationError, check_number

__all__ = [
    "CPU",
    "GPU",
    "Custom",
    "Default",
    "Disk",
    "GPUMemory",
    "GPUMemoryTotal",
    "GPUTemp",
    "Memory",
    "MemoryTotal",
    "MemoryUsed",
    "Metric",
    "MetricsConfig",
    "Network",
    "NetworkRx",
    "NetworkTx",
]


@dataclass(frozen=True, slots=True)
class Metric:
    """A metric sampled on every node (Skyward's).

    Attributes:
        name: its key in ``pool.metrics()`` and the events.
        command: a shell command printing a number (run on the node at each interval).
        interval: seconds between samples (default 2).
        multi: the command prints a number per line (per GPU, per core...): each is
            ``name_0``, ``name_1``...
    """

    name: str
    command: str
    interval: float = 2
    multi: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigurationError(f"Metric.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.command, str) or not self.command.strip():
            raise ConfigurationError(
                f"Metric {self.name!r}: command must be a shell command printing a number, "
                f"got {self.command!r}"
            )
        check_number(
            self.interval,
            f"Metric {self.name!r}: interval must be a positive number of seconds, "
            f"got {self.interval!r}",
            above=0,
        )


MetricsConfig: TypeAlias = "tuple[Metric, ...] | list[Metric] | None"
"""``Compute(metrics=...)`` / ``Image(metrics=...)``: the metrics, or None for none."""

_BUILTIN: dict[tuple[str, str, bool], dict[str, Any]] = {}
"""The factories' metrics by (name, command, multi), whatever their interval: what the
agent samples itself instead of running the command."""


def _builtin(metric: Metric, kind: str, **extra: Any) -> Metric:
    _BUILTIN[(metric.name, metric.command, metric.multi)] = {"kind": kind, **extra}
    return metric


def CPU(interval: float = 2) -> Metric:
    """CPU use in percent (``cpu``), the CPUs available (``cpus``) and the load."""
    return _builtin(
        Metric(
            "cpu",
            "top -bn2 -d0.1 | awk '/^%Cpu/{cpu=100-$8} END{printf \"%.1f\",cpu}'",
            interval,
        ),
        "cpu",
    )


def Memory(interval: float = 2) -> Metric:
    """Memory used in percent (``mem``), and ``mem_used``/``mem_total`` in bytes."""
    return _builtin(
        Metric("mem", "free | awk '/^Mem:/ {printf \"%.1f\", $3/$2*100}'", interval), "mem"
    )


def MemoryUsed(interval: float = 2) -> Metric:
    """Memory used in MB (``mem_used_mb``)."""
    return _builtin(
        Metric("mem_used_mb", "free | awk '/^Mem:/ {printf \"%d\", $3/1024}'", interval),
        "mem_used_mb",
    )


def MemoryTotal() -> Metric:
    """The node's memory in MB (``mem_total_mb``), every 60 s."""
    return _builtin(
        Metric("mem_total_mb", "free | awk '/^Mem:/ {printf \"%d\", $2/1024}'", 60.0),
        "mem_total_mb",
    )


def _gpu(name: str, query: str, index: int | None, interval: float) -> Metric:
    check_number(
        index,
        f"a GPU index is a number from 0, got {index!r}",
        whole=True,
        at_least=0,
        or_none=True,
    )
    command = (
        f"nvidia-smi {f'-i {index} ' if index is not None else ''}"
        f"--query-gpu={query} --format=csv,noheader,nounits 2>&1 | tr -d ' ' "
        "| grep -xE '[0-9]+\\.?[0-9]*'"
    )
    if index is not None:
        return _builtin(Metric(f"{name}_{index}", command, interval), name, index=index)
    return _builtin(Metric(name, command, interval, multi=True), name, index=None)


def GPU(index: int | None = None, interval: float = 3) -> Metric:
    """GPU utilisation in percent, per GPU (``gpu_util_N``)."""
    return _gpu("gpu_util", "utilization.gpu", index, interval)


def GPUMemory(index: int | None = None, interval: float = 3) -> Metric:
    """GPU memory used in MB, per GPU (``gpu_mem_mb_N``)."""
    return _gpu("gpu_mem_mb", "memory.used", index, interval)


def GPUMemoryTotal(index: int | None = None) -> Metric:
    """GPU memory in MB, per GPU (``gpu_mem_total_mb_N``), every 60 s."""
    return _gpu("gpu_mem_total_mb", "memory.total", index, 60.0)


def GPUTemp(index: int | None = None, interval: float = 3) -> Metric:
    """GPU temperature in Celsius, per GPU (``gpu_temp_N``)."""
    return _gpu("gpu_temp", "temperature.gpu", index, interval)


def Disk(path: str = "/", interval: float = 5.0) -> Metric:
    """Percent of ``path``'s filesystem used (``disk_<path>``: ``disk_root`` for /)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise ConfigurationError(f"Disk(path): an absolute path on the node, got {path!r}")
    safe = path.replace("/", "_").strip("_") or "root"
    command = f"df {path} 2>/dev/null | tail -1 | awk '{{print $5}}' | tr -d '%'"
    return _builtin(Metric(f"disk_{safe}", command, interval), "disk", path=path)


def Network(interval: float = 3) -> Metric:
    """Bytes received and sent since boot, every interface but lo (``net_rx``, ``net_tx``)."""
    return _builtin(Metric("net", "cat /proc/net/dev", interval), "net", interface="")


def NetworkRx(interface: str = "eth0", interval: float = 3) -> Metric:
    """Bytes received on ``interface`` (``net_rx_<interface>``; ``net_tx_`` with it)."""
    return _interface_bytes("rx", interface, interval)


def NetworkTx(interface: str = "eth0", interval: float = 3) -> Metric:
    """Bytes sent on ``interface`` (``net_tx_<interface>``; ``net_rx_`` with it)."""
    return _interface_bytes("tx", interface, interval)


def _interface_bytes(way: str, interface: str, interval: float) -> Metric:
    """``net_rx_<interface>`` or ``net_tx_<interface>`` (``way``): the bytes of the
    interface's counter."""
    return _builtin(
        Metric(
            f"net_{way}_{interface}",
            f"cat /sys/class/net/{interface}/statistics/{way}_bytes 2>/dev/null",
            interval,
        ),
        "net",
        interface=interface,
    )


def Custom(name: str, command: str, interval: float = 3) -> Metric:
    """A metric of your own: ``command`` prints a number on the node."""
    return Metric(name=name, command=command, interval=interval)


def Default(
    *, cpu_interval: float = 2, memory_interval: float = 2, gpu_interval: float = 3
) -> tuple[Metric, ...]:
    """What a pool samples when nothing says otherwise: CPU (and load), memory, the GPUs
    (when the node has any), the root filesystem and the network."""
    return (
        CPU(cpu_interval),
        Memory(memory_interval),
        GPU(interval=gpu_interval),
        GPUMemory(interval=gpu_interval),
        GPUMemoryTotal(),
        GPUTemp(interval=gpu_interval),
        Disk("/", interval=max(5.0, cpu_interval)),
        Network(interval=max(3.0, cpu_interval)),
    )


class _Unset:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Unset()
"""``metrics=`` not given: :func:`Default`, unless the Image says otherwise."""


def resolve(*choices: Any) -> tuple[Metric, ...]:
    """The metrics of a pool: the first of ``choices`` that was given (``Compute``'s,
    then its ``Image``'s), else :func:`Default`; checked (ConfigurationError)."""
    for choice in choices:
        if choice is DEFAULT:
            continue
        if choice is None:
            return ()
        if isinstance(choice, Metric):
            choice = (choice,)
        try:
            metrics = tuple(choice)
        except TypeError:
            raise ConfigurationError(
                f"metrics must be a list of flotilla.metrics.Metric (or None), got {choice!r}"
            ) from None
        for m in metrics:
            if not isinstance(m, Metric):
                raise ConfigurationError(
                    f"metrics must be flotilla.metrics.Metric values (sky.metrics.CPU(), "
                    f"Metric(name, command)...), got {m!r}"
                )
        return metrics
    return Default()


def specs(metrics: tuple[Metric, ...]) -> list[dict[str, Any]]:
    """The metrics as the agent takes them in CONFIG (``_node/metrics.py``)."""
    out = []
    seen: set[str] = set()
    for m in metrics:
        if m.name in seen:
            continue
        seen.add(m.name)
        spec: dict[str, Any] = {"name": m.name, "interval": float(m.interval)}
        builtin = _BUILTIN.get((m.name, m.command, m.multi))
        if builtin is not None:
            spec.update(builtin)
        else:
            spec.update(kind="command", command=m.command, multi=bool(m.multi))
        out.append(spec)
    return out
