"""The Ray plugin: a Ray cluster over the pool's nodes, started and stopped with the pool.

Node 0 runs Ray's head (``ray start --head --block``), every other node a Ray worker node
joining it, each bound to the node's pool address (``--node-ip-address``: on a machine with
several interfaces, the one the pool uses, as the torch plugin's rule). The head's port
(Ray's GCS) comes from the head's block of ports found free when the pool started; every
other port is the kernel's choice of a free one (``0``) or a port bound free just before
(the client server and the dashboard agent, which Ray would otherwise put on fixed
defaults: 10001, 52365), so a port another process holds is never used. The head waits
until every node of the pool is alive in the cluster before the pool runs; tasks find it
through ``RAY_ADDRESS``. Ray's processes live as long as the node's first executor process
(see ``_daemons``); a group restart (a lost node replaced) starts the cluster again on the
pool's new nodes. With ``dashboard=True`` the dashboard listens on the head's pool address
at a port of its block; ``pool.ray_dashboard()`` forwards it to this machine through the
pool's own channel (``_client.forward``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from .._errors import ConfigurationError, check_number
from .._info import InstanceInfo
from ._daemons import (
    Daemon,
    EngineError,
    check_free,
    free_port,
    head_engine_port,
    head_forward,
    scratch_dir,
)
from ._engine import EnginePlugin
from ._env import environ, host_port
from ._net import node_ip, wait_listening
from ._versions import requirement

START_TIMEOUT = 300.0
"""Seconds a node waits for its Ray node to start, and the head for every node to join."""
START_ATTEMPTS = 3
"""Tries of a node's ``ray start`` that failed saying one of :data:`RETRIED`."""
SLOW_START = "timed out during startup"
"""What ``ray start`` says when its raylet did not register within Ray's 30 s."""
HEAD_RESTARTED = "WrongClusterID"
"""What a worker's ``ray start`` says when the head it joined was replaced under it: in a
group restart, a worker node may reach the last head's GCS (still listening until the
new head's start sweeps it away) and then find the new one at the same address."""
RETRIED = (SLOW_START, HEAD_RESTARTED)
"""Failures of ``ray start`` that another try mends (see :func:`start_node`)."""
STARTED = "Ray runtime started"
"""What ``ray start`` says when its node is up."""
WATCH = (STARTED, *RETRIED)
"""What a node's ``ray start`` output is watched for."""
MIN_OBJECT_STORE = 75 * 1024 * 1024
"""Ray refuses an object store smaller than this (bytes)."""
REFUSED_WITH = {"torch", "accelerate"}
"""Plugins that cannot share a pool with Ray's (see :meth:`RayPlugin.check_plugins`)."""

_WAIT_FOR_NODES = """
import sys, time, ray
address, wanted, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
deadline = time.monotonic() + timeout
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if len(alive) >= wanted:
        break
    if time.monotonic() > deadline:
        print(f"{len(alive)} of {wanted} nodes joined after {timeout:g} s: {alive}")
        sys.exit(3)
    time.sleep(0.1)
ray.shutdown()
"""


@dataclass(frozen=True)
class RayPlugin(EnginePlugin):
    """See :func:`flotilla.plugins.ray`."""

    version: str = "latest"
    dashboard: bool = False
    object_store_memory: int | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    resources: Mapping[str, float] = field(default_factory=dict)

    name = "ray"

    def __post_init__(self) -> None:
        for what in ("num_cpus", "num_gpus"):
            value = getattr(self, what)
            check_number(
                value,
                f"plugins.ray({what}=...) must be a whole number of at least 0 "
                f"(or None: what Ray detects on each node), got {value!r}",
                whole=True,
                at_least=0,
                or_none=True,
            )
        memory = self.object_store_memory
        check_number(
            memory,
            "plugins.ray(object_store_memory=...) is in bytes and Ray needs at least "
            f"{MIN_OBJECT_STORE} (75 MiB), got {memory!r}",
            whole=True,
            at_least=MIN_OBJECT_STORE,
            or_none=True,
        )
        if not isinstance(self.resources, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in self.resources.items()
        ):
            raise ConfigurationError(
                "plugins.ray(resources=...) must be a dict of resource name -> amount per "
                f"node, e.g. {{'disk': 1}}, got {self.resources!r}"
            )
        object.__setattr__(self, "resources", dict(self.resources))
        self.requirement()  # a bad version is an error now, not on the nodes

    def requirement(self) -> str:
        """``ray`` (``ray[default]`` with the dashboard, which needs its extras)."""
        return requirement("ray[default]" if self.dashboard else "ray", self.version, "version")

    def around_pool(self, pool: Any) -> AbstractContextManager[None]:
        """Close the forwards ``pool.ray_dashboard()`` made when the pool closes."""
        from .._client.forward import closed_with

        return closed_with(pool)

    def check_plugins(self, plugins: tuple[Any, ...]) -> None:
        """Refuse torch() and accelerate() in the same pool, before anything starts."""
        others = sorted({getattr(p, "name", "") for p in plugins} & REFUSED_WITH)
        if others:
            raise ConfigurationError(
                f"plugins.ray() and plugins.{others[0]}() cannot share a pool: "
                f"{others[0]}() makes every executor process a rank of one torch process "
                "group holding the node's accelerators, while Ray schedules its own workers "
                "on them. For distributed torch on Ray, use Ray Train "
                "(ray.train.torch.TorchTrainer) in a pool with plugins.ray() alone; for "
                f"torch.distributed without Ray, plugins.{others[0]}() alone"
            )

    def start_argv(self, info: InstanceInfo, gcs_port: int, scratch: str) -> list[str]:
        """The ``ray start`` command of this node (head on node 0)."""
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block"]
        ip = node_ip(info.addr)  # the pool's address: the interface that carries it
        argv += [f"--node-ip-address={ip}", f"--temp-dir={scratch}"]
        argv += ["--disable-usage-stats", "--min-worker-port=0", "--max-worker-port=0"]
        argv += [f"--dashboard-agent-listen-port={free_port(info.addr)}"]
        if info.node == 0:
            argv += ["--head", f"--port={gcs_port}"]
            if importlib.util.find_spec("grpc") is not None:  # Ray's test for ray[client]:
                # without it no client server starts; with it, not on its default 10001
                argv += [f"--ray-client-server-port={free_port(info.addr)}"]
            if self.dashboard:  # on the pool's address, at a port of the head's block
                port = head_engine_port("ray-dashboard", info.head_port)
                argv += ["--include-dashboard=true", f"--dashboard-host={ip}"]
                argv += [f"--dashboard-port={port}"]
            else:
                argv += ["--include-dashboard=false"]
        else:
            argv += [f"--address={host_port(info.head_addr, gcs_port)}"]
        if self.num_cpus is not None:
            argv += [f"--num-cpus={self.num_cpus}"]
        if self.num_gpus is not None:
            argv += [f"--num-gpus={self.num_gpus}"]
        if self.object_store_memory is not None:
            argv += [f"--object-store-memory={self.object_store_memory}"]
        if self.resources:
            argv += [f"--resources={json.dumps(self.resources)}"]
        return argv

    @contextmanager
    def _node(self, info: InstanceInfo) -> Iterator[None]:
        gcs_port = head_engine_port("ray", info.head_port)
        address = host_port(info.head_addr, gcs_port)
        with environ({"RAY_ADDRESS": address}):
            if info.local_rank != 0 or info.worker != 0:  # one Ray node a node: its first process
                yield
                return
            scratch = scratch_dir("ray", info.pool_id, info.node)
            role = "ray head" if info.node == 0 else f"ray worker node {info.node}"
            if info.node == 0:
                check_free(info.addr, gcs_port, "ray head (GCS)")
                if self.dashboard:
                    port = head_engine_port("ray-dashboard", info.head_port)
                    check_free(info.addr, port, "ray dashboard")
            elif not wait_listening(info.head_addr, gcs_port, START_TIMEOUT):
                raise EngineError(
                    f"{role}: the head ({address}) did not listen within {START_TIMEOUT:g} s"
                )
            env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
            daemon = start_node(
                lambda: Daemon(role, self.start_argv(info, gcs_port, scratch), env, scratch, WATCH)
            )
            try:
                if info.node == 0:
                    self._wait_for_nodes(daemon, address, info.total_nodes)
                    board = head_engine_port("ray-dashboard", info.head_port)
                    board_at = host_port(info.addr, board)
                    print(
                        f"ray: cluster of {info.total_nodes} node(s) up, head at {address} "
                        f"(RAY_ADDRESS), temp dir {scratch} on each node"
                        + (
                            f", dashboard at http://{board_at} (pool.ray_dashboard())"
                            if self.dashboard
                            else ""
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
                yield
            finally:
                daemon.stop()

    def _wait_for_nodes(self, daemon: Daemon, address: str, nodes: int) -> None:
        import subprocess

        argv = [sys.executable, "-c", _WAIT_FOR_NODES, address, str(nodes), str(START_TIMEOUT)]
        done = subprocess.run(argv, capture_output=True, text=True, env=daemon.env, check=False)
        if done.returncode != 0:
            said = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise daemon.failure(
                "the cluster did not gather every node of the pool: " + " | ".join(said)
            )


def start_node(make: Callable[[], Daemon]) -> Daemon:
    """Start a node's ``ray start`` (``make()``'s daemon) and wait until Ray says it is up;
    return that daemon (the caller stops it). When it failed saying one of
    :data:`RETRIED`, it is stopped and a new one tried, up to :data:`START_ATTEMPTS` in
    all; a daemon that failed is stopped here before its error is raised."""
    for attempt in range(1, START_ATTEMPTS + 1):
        daemon = make()
        daemon.start()
        try:
            daemon.wait_for(partial(daemon.said, STARTED), START_TIMEOUT, "up")
            return daemon
        except BaseException as e:
            daemon.stop()
            # Ray gives a raylet 30 s to register (hard-coded): on a loaded machine it may
            # not; a worker that joined a head replaced since joins the new one next time
            retried = isinstance(e, EngineError) and any(daemon.said(s) for s in RETRIED)
            if attempt == START_ATTEMPTS or not retried:
                raise
    raise AssertionError("START_ATTEMPTS is at least 1")


def dashboard_url(pool: Any) -> str:
    """The URL of ``pool``'s Ray dashboard on this machine (see
    :meth:`flotilla.Compute.ray_dashboard`)."""
    plugin = next((p for p in getattr(pool, "plugins", ()) if isinstance(p, RayPlugin)), None)
    if plugin is None or not plugin.dashboard:
        raise ConfigurationError(
            "pool.ray_dashboard() needs a pool with Ray's dashboard: "
            "sky.Compute(..., plugins=[sky.plugins.ray(dashboard=True)])"
        )
    from .._client.forward import keep

    forward, at = head_forward(pool, "ray-dashboard")
    if forward is None:
        return f"http://{at}"
    keep(pool, forward)
    return f"http://{forward.address}"
