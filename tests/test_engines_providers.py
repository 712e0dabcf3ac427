"""Ray and Dask clusters (issue 41) on the providers other than SSH and Local: SLURM, AWS
(moto's EC2, instances that boot), Kubernetes (a real API server) and Vast.ai (its API's
stand-in), each with its lab (see ``_slurm``, ``_aws``, ``_k8s``, ``_vast``).

One 2-node pool per provider carries both engines (``plugins.ray()`` and
``plugins.dask()``), to keep the labs' cost down: in it a task sees a Ray cluster and a
Dask cluster of both nodes at their pool addresses, joined with no address;
``pool.dask_client()`` works from this machine through the pool's own channel (``ssh``,
``srun``, ``kubectl exec``); node 1's agent is killed and its replacement is in both
clusters; and once the pool is closed no engine process of the pool and no relay is left on
any node. The nodes run this interpreter, which has Ray and distributed (the Image's
requirements are met: nothing is installed; ``tests/test_engines.py`` installs them from
an index on the SSH lab).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from _aws import AwsLab, aws_lab_fixture, aws_shared_lab_fixture  # noqa: F401
from _k8s import K8sLab, k8s_lab_fixture  # noqa: F401 - the k8s_lab fixture
from _procs import wait_until
from _slurm import SlurmCluster, slurm_cluster_fixture  # noqa: F401 - the slurm_cluster fixture
from _vast import VastLab, vast_lab_fixture  # noqa: F401 - the vast_lab fixture

import flotilla as sky
from flotilla._client.forward import RELAY
from flotilla.plugins._daemons import MARKER_VAR

RAY = "2.60.0"
DISTRIBUTED = "2026.8.0"

pytestmark = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning"),
    pytest.mark.timeout(900),  # a pool's start, a replacement and a close, each with its deadline
]


@sky.function
def engines_view() -> dict[str, Any]:
    """Both clusters as a task sees them, joined with no address: Ray's alive nodes and the
    rank a task pinned to each (by its node IP resource) reads there; Dask's workers and a
    map's sum."""
    import logging

    import ray
    from distributed import Client

    ray.init(ignore_reinit_error=True, logging_level=logging.ERROR, log_to_driver=False)

    @ray.remote(num_cpus=0)
    def rank_here() -> int:
        return int(json.loads(os.environ["COMPUTE_POOL"])["node"])

    addrs = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])  # type: ignore[no-untyped-call]
    pinned = {a: ray.get(rank_here.options(resources={f"node:{a}": 0.001}).remote()) for a in addrs}
    ray.shutdown()
    with Client() as client:
        workers = sorted(w["host"] for w in client.scheduler_info()["workers"].values())
        total = client.submit(sum, client.map(lambda x: x * x, range(1000))).result()
    return {"ray": addrs, "pinned": pinned, "dask": workers, "sum": total}


def plugins() -> list[Any]:
    ray = sky.plugins.ray(version=RAY, num_cpus=1, object_store_memory=80 * 1024 * 1024)
    return [ray, sky.plugins.dask(version=DISTRIBUTED, threads=1)]


def leftovers(pool_id: str, relays: bool = True) -> list[str]:
    """Processes of this machine (every lab's nodes share its process table) that belong to
    the pool's engines (a daemon's marker and the pool's id in their environment), or (with
    ``relays``) that relay a forward (on a node or here)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if (f"{MARKER_VAR}=".encode() in env and pool_id.encode() in env) or (
                relays and RELAY.encode() in cmd
            ):
                shown = cmd.replace(b"\0", b" ")[:120].decode(errors="replace")
                out.append(f"{pid} {shown}")
    return out


def exercise(pool: sky.Compute, tunnel: str) -> None:
    """The engines on ``pool`` (2 nodes), before and after node 1 is replaced; then closes
    it and checks that nothing is left. ``tunnel``: the local command of the pool's
    channel (``ssh``, ``srun``, ``kubectl``)."""
    pool_id = pool.pool_id
    with pool:
        addrs = [n.proc.address for n in pool._nodes]
        view = engines_view() >> pool
        assert view["ray"] == sorted(addrs) and view["dask"] == sorted(addrs), (view, addrs)
        assert view["pinned"] == {a: rank for rank, a in enumerate(addrs)}
        assert view["sum"] == sum(x * x for x in range(1000))

        client = pool.dask_client()
        assert client.scheduler.address.startswith("tcp://127.0.0.1:")  # the forward's end
        assert len(client.scheduler_info()["workers"]) == 2
        assert client.submit(sum, client.map(lambda x: x + 1, range(1000))).result() == 500500
        assert any(tunnel in " ".join(r) for r in relays_here()), relays_here()

        lost = pool._nodes[1]
        os.kill(int(lost.hello_info["pid"]), signal.SIGKILL)
        assert wait_until(
            lambda: pool._nodes[1] is not lost and pool._nodes[1].state.value == "ready",
            timeout=300,
        ), "node 1 was not replaced"
        addrs = [n.proc.address for n in pool._nodes]
        view = engines_view() >> pool
        assert view["ray"] == sorted(addrs) and view["dask"] == sorted(addrs), (view, addrs)
        assert view["pinned"] == {a: rank for rank, a in enumerate(addrs)}
        again = pool.dask_client()  # the clusters formed again: a client of the new one
        assert len(again.scheduler_info()["workers"]) == 2
        assert leftovers(pool_id, relays=False)  # what the check below looks for, while it runs
    assert client.status == again.status == "closed"  # closed with the pool, forwards too
    assert wait_until(lambda: not leftovers(pool_id), timeout=60), leftovers(pool_id)


def relays_here() -> list[list[str]]:
    """The command lines of this process's children that carry a relay (the forwards')."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != os.getpid():
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            if any(RELAY in a for a in argv):
                out.append(argv)
    return out


# -- the providers ----------------------------------------------------------------------------


@pytest.fixture
def slurm_env(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    for name in [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        monkeypatch.delenv(name)
    yield


def test_ray_and_dask_on_slurm(slurm_env: None) -> None:
    exercise(sky.Compute(provider=sky.Slurm(), nodes=2, plugins=plugins()), "srun")


def test_ray_and_dask_on_aws(aws_lab: AwsLab) -> None:
    provider = aws_lab.provider(python=sys.executable)
    exercise(sky.Compute(provider=provider, nodes=2, plugins=plugins()), "ssh")


def test_ray_and_dask_on_kubernetes(k8s_lab: K8sLab) -> None:
    from flotilla._providers.k8s import Kubernetes

    provider = Kubernetes(
        kubeconfig=str(k8s_lab.kubeconfig), kubectl=k8s_lab.kubectl_path, python=sys.executable
    )
    exercise(sky.Compute(provider=provider, nodes=2, plugins=plugins()), "kubectl")


def test_ray_and_dask_on_vast(vast_lab: VastLab) -> None:
    vast_lab.add_machines(2, cluster_id=41)  # one physical cluster: the pool's overlay
    provider = sky.VastAI(python=sys.executable)
    pool = sky.Compute(provider=provider, accelerator="A100", nodes=2, plugins=plugins())
    exercise(pool, "ssh")
    assert vast_lab.live() == []
