"""The Dask plugin: a Dask scheduler on node 0 and a worker on every node, with the pool.

The scheduler listens on the head's address at a port of the head's block (free when the
pool started); each worker binds the node's pool address (``--host``: the torch plugin's
interface rule) on ports the kernel picks, with as many threads as the node has CPUs unless
said. The head waits until every worker has registered before the pool runs; tasks find
the scheduler through ``DASK_SCHEDULER_ADDRESS`` (``distributed.Client()`` with no
address reads it). From the client, ``pool.dask_client()`` reaches the scheduler through
the pool's own channel to node 0 (``_client.forward``: the shell its agent was started
with, ``ssh``, ``srun``, ``kubectl exec``...) or directly when the nodes are processes of
this machine: the scheduler's port is never opened to anyone else by flotilla.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigurationError, check_number
from .._info import InstanceInfo
from ._daemons import Daemon, EngineError, check_free, head_engine_port, head_forward, scratch_dir
from ._engine import EnginePlugin
from ._env import environ, host_port
from ._net import node_ip, wait_listening
from ._versions import requirement

START_TIMEOUT = 300.0
"""Seconds a worker waits for the scheduler, and the scheduler for every worker."""
CONNECT_TIMEOUT = 60.0
"""Seconds ``dask_client()`` gives its ``Client`` to connect (through the pool's channel:
an ``ssh``, ``srun`` or ``kubectl exec`` starting on a loaded machine)."""

LISTENING = "Scheduler at"
"""What Dask's scheduler says when it listens."""
REGISTERED = "Registered to"
"""What a Dask worker says when it joined the scheduler."""

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
        """Close the clients and forwards ``pool.dask_client()`` made when the pool closes."""
        from .._client.forward import closed_with

        return closed_with(pool)

    def worker_argv(self, info: InstanceInfo, scheduler: str, scratch: str) -> list[str]:
        threads = self.threads or len(os.sched_getaffinity(0))
        argv = [sys.executable, "-m", "distributed.cli.dask_worker", f"tcp://{scheduler}"]
        argv += ["--host", node_ip(info.addr), "--nthreads", str(threads), "--nworkers", "1"]
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
                argv += ["--host", node_ip(info.addr), "--port", str(port), "--no-dashboard"]
                head = Daemon("dask scheduler", argv, env, scratch + "-scheduler", [LISTENING])
                s.callback(head.stop)
                head.start()
                head.wait_for(lambda: head.said(LISTENING), START_TIMEOUT, "listening")
            elif not wait_listening(info.head_addr, port, START_TIMEOUT):
                raise EngineError(
                    f"dask worker {info.node}: the scheduler ({scheduler}) did not listen "
                    f"within {START_TIMEOUT:g} s"
                )
            argv = self.worker_argv(info, scheduler, scratch)
            worker = Daemon(f"dask worker {info.node}", argv, env, scratch, [REGISTERED])
            s.callback(worker.stop)
            worker.start()
            worker.wait_for(lambda: worker.said(REGISTERED), START_TIMEOUT, "registered")
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


def dask_client(pool: Any, **kwargs: Any) -> Any:
    """A ``distributed.Client`` connected to ``pool``'s Dask scheduler from this machine
    (see :meth:`flotilla.Compute.dask_client`)."""
    if not any(isinstance(p, DaskPlugin) for p in getattr(pool, "plugins", ())):
        raise ConfigurationError(
            "pool.dask_client() needs a pool with plugins.dask(): "
            "sky.Compute(..., plugins=[sky.plugins.dask()])"
        )
    from distributed import Client

    from .._client.forward import keep

    forward, at = head_forward(pool, "dask")
    address = f"tcp://{forward.address if forward else at}"
    try:
        client = Client(address, **{"timeout": CONNECT_TIMEOUT, **kwargs})  # type: ignore[no-untyped-call]
    except Exception as e:
        if forward is None:
            raise
        forward.close()
        raise EngineError(
            f"pool.dask_client(): the scheduler ({at} on node 0) did not "
            f"answer through the pool's channel ({forward.command[0]}): "
            f"{forward.said() or e}"
        ) from e
    except BaseException:
        if forward is not None:
            forward.close()
        raise
    keep(pool, *([forward] if forward else []), client)
    return client
