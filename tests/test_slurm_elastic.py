"""Elastic pools on SLURM (the test cluster of ``_slurm.py``: slurmctld and 3 slurmd): a
one-node job per node added, ended per node released (``scontrol update`` cannot grow a
running job); inside an existing allocation, its nodes are taken and given back."""

from __future__ import annotations

import socket
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from _procs import wait_until
from _slurm import SlurmCluster, slurm_cluster_fixture  # noqa: F401
from test_slurm import _slurm_conf as _slurm_conf

import flotilla as sky


@sky.function
def slow_host(i: int) -> tuple[int, str]:
    time.sleep(0.05)
    return i, socket.gethostname()


def _jobs(cluster: SlurmCluster, pool_id: str) -> list[str]:
    """The pool's jobs in the queue, as "id name state reason" lines."""
    return [j for j in cluster.jobs() if j.split()[1] == f"flotilla-{pool_id}"]


def _until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` (which runs squeue: every 0.2 s) until true or ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_slurm_pool_born_empty_submits_a_job_per_node_and_scales_to_zero(
    slurm_cluster: SlurmCluster,
) -> None:
    """``Nodes(0, max=3, min=0)``: no job before the first call; a burst runs on at most 3
    one-node jobs, each on its own node; idle, every job ends (leaves the queue); the next
    call submits one again."""
    options = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0, start_timeout=120)
    nodes = sky.Nodes(0, max=3, min=0)
    with sky.Compute(provider=sky.Slurm(), nodes=nodes, options=options) as pool:
        pool_id = pool.pool_id
        assert pool.current_nodes() == 0 and _jobs(slurm_cluster, pool_id) == []
        out = pool.map(slow_host, range(100))
        assert [i for i, _ in out] == list(range(100))
        jobs = _jobs(slurm_cluster, pool_id)  # (idle for 1 s, one may be ending)
        assert 1 <= len(jobs) <= 3
        assert all(j.split()[2] in ("RUNNING", "COMPLETING") for j in jobs), jobs
        assert {h for _, h in out} <= {"n1", "n2", "n3"}
        hosts = [h for _, h in slow_host(0) @ pool]
        assert len(hosts) == len(set(hosts))  # a node per job
        assert wait_until(lambda: pool.current_nodes() == 0, timeout=120)
        assert _until(lambda: _jobs(slurm_cluster, pool_id) == [], timeout=60)
        assert (slow_host(1) >> pool)[0] == 1
        assert len(_jobs(slurm_cluster, pool_id)) == 1
    assert slurm_cluster.wait_queue_empty(30.0, name="flotilla-") == []


def test_an_elastic_pool_inside_an_allocation_grows_over_its_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Inside ``salloc --nodes=2``: ``Nodes(1, max=2)`` takes the job's second node on
    ``resize(2)`` and gives it back on ``resize(1)``, submitting no job of its own and
    leaving the allocation running."""
    script = tmp_path / "inside.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, socket, subprocess, time
            import flotilla as sky

            @sky.function
            def host():
                return socket.gethostname()

            def until(predicate):
                deadline = time.monotonic() + 120
                while not predicate() and time.monotonic() < deadline:
                    time.sleep(0.05)

            def queue():
                return subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True,
                                      text=True).stdout.split()

            options = sky.Options(autoscale_idle_timeout=600, autoscale_cooldown=0)
            with sky.Compute(provider=sky.Slurm(), nodes=sky.Nodes(1, max=2),
                             options=options) as pool:
                print("one", host() @ pool, flush=True)
                pool.resize(2)
                until(lambda: pool.current_nodes() == 2)
                print("two", host() @ pool, queue(), flush=True)
                pool.resize(1)
                until(lambda: pool.current_nodes() == 1)
                print("back", host() @ pool, flush=True)
            out = subprocess.run(["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%T"],
                                 capture_output=True, text=True).stdout.strip()
            print("after", out, flush=True)
            """
        )
    )
    proc = slurm_cluster.slurm(
        "salloc", "--nodes=2", "--job-name=outer", sys.executable, str(script)
    )
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line}
    assert lines["one"] == "one ['n1']", proc.stdout + proc.stderr
    assert lines["two"] == "two ['n1', 'n2'] ['outer']", proc.stdout
    assert lines["back"] == "back ['n1']", proc.stdout
    assert lines["after"] == "after RUNNING"
    assert slurm_cluster.wait_queue_empty(10.0) == []
