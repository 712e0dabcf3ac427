"""The Dask plugin: a Dask scheduler on node 0 and a worker on every node, with the pool.

The scheduler listens on the head's address at a port of the head's block (free when the
pool started); each worker binds the node's pool address (``--host``: the torch plugin's
interface rule) on ports the kernel picks, with as many threads as the node has CPUs unless
said. The head waits until every worker has registered before the pool runs; tasks find
the scheduler through ``DASK_SCHEDULER_ADDRESS`` (``distributed.Client()`` with no
address reads it). From the client, ``pool.dask_client()`` reaches the scheduler through
an SSH tunnel to node 0 (providers reached over SSH) or directly when the nodes are on this
machine: the scheduler's port is never opened to anyone else by flotilla.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigurationError, check_number
from .._info import InstanceInfo
from ._daemons import Daemon, EngineError, check_free, head_engine_port, scratch_dir
from ._engine import EnginePlugin
from ._env import environ, host_port
from ._net import wait_listening
from ._versions import requirement

START_TIMEOUT = 300.0
"""Seconds a worker waits for the scheduler, and the scheduler for every worker."""
TUNNEL_TIMEOUT = 30.0
"""Seconds ``dask_client()`` waits for its SSH tunnel to listen."""

_WAIT_FOR_WORKERS = """
import sys
from distributed import Client
address, wanted, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with Client(address, timeout=timeout) as client:
    client.wait_for_workers(wanted, timeout=timeout)
"""


@dataclass(frozen=True)
class DaskPlugin(EnginePlugin):
    """See :func:`flotilla.plugins.dask`."""

    version: str = "latest"
    threads: int | None = None
    memory_limit: str = "auto"

    name = "dask"

    def __post_init__(self) -> None:
        check_number(
            self.threads,
            "plugins.dask(threads=...) must be a positive whole number of threads per "
            f"worker (or None: the node's CPUs), got {self.threads!r}",
            whole=True,
            at_least=1,
            or_none=True,
        )
        if not isinstance(self.memory_limit, str) or not self.memory_limit.strip():
            raise ConfigurationError(
                "plugins.dask(memory_limit=...) must be Dask's memory limit as a string "
                f"('auto', '4GiB', '0' for none), got {self.memory_limit!r}"
            )
        self.requirement()

    def requirement(self) -> str:
        return requirement("distributed", self.version, "version")

    def around_pool(self, pool: Any) -> AbstractContextManager[None]:
        """Close the clients and tunnels ``pool.dask_client()`` made when the pool closes."""
        return _clients_of(pool)

    def worker_argv(self, info: InstanceInfo, scheduler: str, scratch: str) -> list[str]:
        threads = self.threads or len(os.sched_getaffinity(0))
        argv = [sys.executable, "-m", "distributed.cli.dask_worker", f"tcp://{scheduler}"]
        argv += ["--host", info.addr, "--nthreads", str(threads), "--nworkers", "1"]
        argv += ["--no-dashboard", "--local-directory", scratch]
        argv += ["--memory-limit", self.memory_limit, "--name", f"node-{info.node}"]
        return argv

    @contextmanager
    def _node(self, info: InstanceInfo) -> Iterator[None]:
        port = head_engine_port("dask", info.head_port)
        scheduler = host_port(info.head_addr, port)
        with environ({"DASK_SCHEDULER_ADDRESS": f"tcp://{scheduler}"}), contextlib.ExitStack() as s:
            if info.local_rank != 0 or info.worker != 0:  # one worker a node: its first process
                yield
                return
            scratch = scratch_dir("dask", info.pool_id, info.node)
            env = dict(os.environ)
            if info.node == 0:
                check_free(info.addr, port, "dask scheduler")
                argv = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
                argv += ["--host", info.addr, "--port", str(port), "--no-dashboard"]
                head = Daemon("dask scheduler", argv, env, scratch + "-scheduler")
                s.callback(head.stop)
                head.start()
                head.wait_for(lambda: head.said("Scheduler at"), START_TIMEOUT, "listening")
            elif not wait_listening(info.head_addr, port, START_TIMEOUT):
                raise EngineError(
                    f"dask worker {info.node}: the scheduler ({scheduler}) did not listen "
                    f"within {START_TIMEOUT:g} s"
                )
            worker = Daemon(
                f"dask worker {info.node}", self.worker_argv(info, scheduler, scratch), env, scratch
            )
            s.callback(worker.stop)
            worker.start()
            worker.wait_for(lambda: worker.said("Registered to"), START_TIMEOUT, "registered")
            if info.node == 0:
                argv = [sys.executable, "-c", _WAIT_FOR_WORKERS, f"tcp://{scheduler}"]
                argv += [str(info.total_nodes), str(START_TIMEOUT)]
                done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
                if done.returncode != 0:
                    said = (done.stdout + done.stderr).strip().splitlines()[-3:]
                    raise head.failure("not every worker registered: " + " | ".join(said))
                print(
                    f"dask: scheduler at tcp://{scheduler} (DASK_SCHEDULER_ADDRESS), "
                    f"{info.total_nodes} worker(s)",
                    file=sys.stderr,
                    flush=True,
                )
            yield


# -- the client side: pool.dask_client() ----------------------------------------------------

_open: dict[int, list[Any]] = {}  # id(pool) -> what dask_client() opened for it (closed last)
_open_lock = threading.Lock()


@contextmanager
def _clients_of(pool: Any) -> Iterator[None]:
    try:
        yield
    finally:
        with _open_lock:
            opened = _open.pop(id(pool), [])
        for thing in reversed(opened):
            with contextlib.suppress(Exception):
                if isinstance(thing, subprocess.Popen):
                    thing.terminate()
                    thing.wait(5)
                else:
                    thing.close()


def dask_client(pool: Any, **kwargs: Any) -> Any:
    """A ``distributed.Client`` connected to ``pool``'s Dask scheduler from this machine
    (see :meth:`flotilla.Compute.dask_client`)."""
    if not any(isinstance(p, DaskPlugin) for p in getattr(pool, "plugins", ())):
        raise ConfigurationError(
            "pool.dask_client() needs a pool with plugins.dask(): "
            "sky.Compute(..., plugins=[sky.plugins.dask()])"
        )
    from distributed import Client

    head = pool._nodes[0]
    port = head_engine_port("dask", int(pool._bringup.head_port))
    alloc = pool._allocation
    shell = getattr(alloc, "shell", None)
    opened: list[Any] = []
    if shell is not None and hasattr(shell, "ssh_argv"):  # reached over SSH: a tunnel
        local = _free_local_port()
        tunnel = _ssh_tunnel(shell, alloc.machines[0], local, head.proc.address, port)
        opened.append(tunnel)
        address = f"tcp://127.0.0.1:{local}"
    elif _is_this_machine(head.proc.address):
        address = f"tcp://{host_port(head.proc.address, port)}"
    else:
        raise ConfigurationError(
            f"pool.dask_client() reaches the scheduler through SSH or on this machine; the "
            f"{getattr(pool.provider, 'name', 'provider')!r} provider's nodes are neither: "
            "drive Dask from a task instead (distributed.Client() there finds the scheduler)"
        )
    try:
        client = Client(address, **{"timeout": TUNNEL_TIMEOUT, **kwargs})  # type: ignore[no-untyped-call]
    except BaseException:
        for thing in opened:
            thing.terminate()
        raise
    opened.append(client)
    with _open_lock:
        _open.setdefault(id(pool), []).extend(opened)
    return client


def _free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _is_this_machine(addr: str) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _ssh_tunnel(shell: Any, machine: Any, local: int, addr: str, port: int) -> Any:
    """``ssh -N -L 127.0.0.1:local:addr:port`` to ``machine`` with the provider's key and
    pinned host keys; returned once the local end accepts connections."""
    argv = shell.ssh_argv(shell.target(machine), "", "-N", "-L", f"127.0.0.1:{local}:{addr}:{port}")
    host, options = argv[-2], argv[:-3]  # ssh_argv ends "-- host command": no command here
    options = [a.replace("ClearAllForwardings=yes", "ClearAllForwardings=no") for a in options]
    argv = [*options, "-o", "ExitOnForwardFailure=yes", "--", host]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + TUNNEL_TIMEOUT
    while not wait_listening("127.0.0.1", local, 0.05):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            err = (proc.communicate()[1] or b"").decode(errors="replace").strip()
            raise EngineError(f"the SSH tunnel to the Dask scheduler did not open: {err}")
    return proc
