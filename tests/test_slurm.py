"""The SLURM provider against a real SLURM cluster (slurmctld, 3 slurmd; see ``_slurm``).

Tests that need the cluster need root; they skip with the reason otherwise. Every SLURM
command (the provider's and the tests') reaches the test cluster through ``SLURM_CONF``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from _ddp import assert_ddp_averages
from _procs import Client, alive, all_pids, assert_all_gone, kill_quietly, wait_until
from _slurm import PARTITION, SHORT_PARTITION, SlurmCluster, slurm_cluster_fixture  # noqa: F401

import flotilla as sky
from flotilla._errors import ConfigurationError, ProvisionCause, ProvisionError
from flotilla._providers.base import Options, PoolSpec
from flotilla._providers.slurm import Slurm
from flotilla._providers.slurm.settings import parse_time


@pytest.fixture(autouse=True)
def _slurm_conf(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Point this process (and the clients it starts) at the test cluster."""
    if "slurm_cluster" in request.fixturenames:
        cluster: SlurmCluster = request.getfixturevalue("slurm_cluster")
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        for name in [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            monkeypatch.delenv(name)
    yield


@sky.function
def where() -> dict[str, object]:
    info = sky.instance_info()
    return {
        "node": info.node,
        "addr": info.addr,
        "head_addr": info.head_addr,
        "peers": [(p.node, p.addr) for p in info.peers],
        "hostname": socket.gethostname(),
        "job": os.environ.get("SLURM_JOB_ID"),
    }


def _pool_jobs(cluster: SlurmCluster) -> list[str]:
    return [j for j in cluster.jobs() if j.split()[1].startswith("flotilla-")]


def _client(cluster: SlurmCluster, tmp_path: Path, body: str, nodes: int = 2) -> Client:
    """A client script that opens a pool on the cluster in a ``with`` block, prints "ready",
    then runs ``body`` in the block."""
    script = f"""
        import sys, threading, time
        import flotilla as sky
        with sky.Compute(provider=sky.Slurm(), nodes={nodes}) as pool:
            print("ready", flush=True)
    """
    inner = textwrap.indent(textwrap.dedent(body), "    ")
    return Client(textwrap.dedent(script) + inner, tmp_path)


# -- pools ------------------------------------------------------------------------------------
def test_three_node_pool_ranks_hostnames_addresses(slurm_cluster: SlurmCluster) -> None:
    with sky.Compute(provider=Slurm(), nodes=3) as pool:
        infos = where() @ pool
        jobs = _pool_jobs(slurm_cluster)
        assert [j.split()[1] for j in jobs] == [f"flotilla-{pool.pool_id}"]
        assert jobs[0].split()[2] == "RUNNING"
    addrs = [slurm_cluster.node_addr(i) for i in (1, 2, 3)]
    assert [i["node"] for i in infos] == [0, 1, 2]
    assert [i["hostname"] for i in infos] == ["n1", "n2", "n3"]
    assert [i["addr"] for i in infos] == addrs
    for info in infos:
        assert info["peers"] == [(0, addrs[0]), (1, addrs[1]), (2, addrs[2])]
        assert info["head_addr"] == addrs[0]
        assert info["job"] == jobs[0].split()[0]  # the agents run as steps of the pool's job
    assert _pool_jobs(slurm_cluster) == []  # release waited until SLURM dropped the job


@sky.function
def echo(data: bytes) -> bytes:
    return data


def test_binary_data_passes_unchanged_over_srun(slurm_cluster: SlurmCluster) -> None:
    """srun relays the protocol byte for byte (the step's stdout is a raw pty under
    --unbuffered: no newline translation, no control characters eaten)."""
    data = os.urandom(3 << 20) + b"\r\n\n\x03\x04\x1a\x00" * 1000
    with sky.Compute(provider=Slurm(), nodes=2) as pool:
        assert echo(data) >> pool == data
        assert echo(b"\n") @ pool == [b"\n", b"\n"]


def test_job_is_gone_after_an_exception(slurm_cluster: SlurmCluster) -> None:
    with pytest.raises(ZeroDivisionError), sky.Compute(provider=Slurm(), nodes=2) as pool:
        assert len(_pool_jobs(slurm_cluster)) == 1
        _ = 1 / 0
    assert pool.pool_id
    assert _pool_jobs(slurm_cluster) == []


def test_short_partition_and_time(slurm_cluster: SlurmCluster) -> None:
    provider = Slurm(partition=SHORT_PARTITION, time="5:00")
    with sky.Compute(provider=provider, nodes=2) as pool:
        infos = where() @ pool
        job = infos[0]["job"]
        shown = slurm_cluster.slurm("scontrol", "-o", "show", "job", str(job)).stdout
    assert [i["hostname"] for i in infos] == ["n1", "n2"]
    assert f"Partition={SHORT_PARTITION}" in shown
    assert "TimeLimit=00:05:00" in shown
    assert f"JobName=flotilla-{pool.pool_id}" in shown


def test_resource_requests_become_cpus_per_task_and_mem(slurm_cluster: SlurmCluster) -> None:
    with sky.Compute(provider=Slurm(), nodes=2, vcpus=2, memory_gb=0.5) as pool:
        job = (where() >> pool)["job"]
        shown = slurm_cluster.slurm("scontrol", "-o", "show", "job", str(job)).stdout
    assert "MinCPUsNode=2" in shown
    assert "MinMemoryNode=512M" in shown


def test_ddp_gloo_across_three_nodes(slurm_cluster: SlurmCluster) -> None:
    pytest.importorskip("torch")
    with sky.Compute(provider=Slurm(), nodes=3, plugins=[sky.plugins.torch()]) as pool:
        assert_ddp_averages(pool, 3)
    assert _pool_jobs(slurm_cluster) == []


# -- no orphans -------------------------------------------------------------------------------
def test_ctrl_c_releases_the_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    client = _client(slurm_cluster, tmp_path, "threading.Event().wait()\n")
    try:
        client.expect(lambda line: line == "ready", timeout=60)
        assert len(_pool_jobs(slurm_cluster)) == 1
        client.signal(signal.SIGINT)
        assert client.wait(30) != 0
        assert "interrupted (Ctrl-C); the pool was closed" in client.stderr()
        assert _pool_jobs(slurm_cluster) == []  # gone by the time the client exited
    finally:
        client.kill()


def test_kill_9_releases_the_job_within_30_s(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    client = _client(slurm_cluster, tmp_path, "threading.Event().wait()\n")
    try:
        client.expect(lambda line: line == "ready", timeout=60)
        assert len(_pool_jobs(slurm_cluster)) == 1
        client.signal(signal.SIGKILL)
        assert client.wait() == -signal.SIGKILL
        assert wait_until(lambda: _pool_jobs(slurm_cluster) == [], timeout=30.0), (
            f"the killed client's job is still queued: {_pool_jobs(slurm_cluster)}"
        )
    finally:
        client.kill()


def _children_named(pid: int, name: str) -> list[int]:
    """The live child processes of ``pid`` whose program is ``name``."""
    found = []
    for child in all_pids():
        try:
            with open(f"/proc/{child}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == pid and comm == name and alive(child):
            found.append(child)
    return found


def test_kill_9_ends_the_pools_salloc(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The salloc holding a killed client's job does not outlive the client (issue 43: it
    stayed with parent PID 1 and spun once the controller was gone)."""
    client = _client(slurm_cluster, tmp_path, "threading.Event().wait()\n")
    try:
        client.expect(lambda line: line == "ready", timeout=60)
        sallocs = _children_named(client.proc.pid, "salloc")
        assert len(sallocs) == 1, f"the client runs no salloc: {sallocs}"
        client.signal(signal.SIGKILL)
        assert client.wait() == -signal.SIGKILL
        assert_all_gone(sallocs, timeout=60.0, what="the killed client's salloc")
        assert wait_until(lambda: _pool_jobs(slurm_cluster) == [], timeout=60.0), (
            f"the killed client's job is still queued: {_pool_jobs(slurm_cluster)}"
        )
    finally:
        client.kill()


@pytest.mark.timeout(300)  # a pool's start and up to 90 s for salloc, on a loaded machine
def test_kill_9_ends_a_salloc_that_would_not_end_by_itself(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A salloc that does not relinquish and exit once its holder ended (here: stopped when
    the client is killed; in issue 43 one in a few killed clients left a salloc spinning
    with parent PID 1) is ended by the holder's watchdog: its job cancelled, salloc killed."""
    client = _client(slurm_cluster, tmp_path, "threading.Event().wait()\n")
    sallocs: list[int] = []
    try:
        client.expect(lambda line: line == "ready", timeout=60)
        sallocs = _children_named(client.proc.pid, "salloc")
        assert len(sallocs) == 1, f"the client runs no salloc: {sallocs}"
        os.kill(sallocs[0], signal.SIGSTOP)
        client.signal(signal.SIGKILL)
        assert client.wait() == -signal.SIGKILL
        assert_all_gone(sallocs, timeout=90.0, what="the killed client's stuck salloc")
        assert wait_until(lambda: _pool_jobs(slurm_cluster) == [], timeout=60.0), (
            f"the killed client's job is still queued: {_pool_jobs(slurm_cluster)}"
        )
    finally:
        client.kill()
        kill_quietly(sallocs)
        for job in _pool_jobs(slurm_cluster):
            slurm_cluster.slurm("scancel", job.split()[0], check=False)


def test_ctrl_c_while_pending_cancels_the_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    with sky.Compute(provider=Slurm(), nodes=3):
        client = _client(slurm_cluster, tmp_path, "print('started', flush=True)\n", nodes=3)
        try:
            assert wait_until(lambda: "PENDING" in client.stderr(), timeout=30)
            assert len(_pool_jobs(slurm_cluster)) == 2
            client.signal(signal.SIGINT)
            assert client.wait(30) != 0
            assert wait_until(lambda: len(_pool_jobs(slurm_cluster)) == 1, timeout=30)
        finally:
            client.kill()


def test_kill_9_while_pending_cancels_the_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    with sky.Compute(provider=Slurm(), nodes=3):
        client = _client(slurm_cluster, tmp_path, "print('started', flush=True)\n", nodes=3)
        try:
            assert wait_until(lambda: "PENDING" in client.stderr(), timeout=30)
            client.signal(signal.SIGKILL)
            assert client.wait() == -signal.SIGKILL
            assert wait_until(lambda: len(_pool_jobs(slurm_cluster)) == 1, timeout=30), _pool_jobs(
                slurm_cluster
            )
        finally:
            client.kill()


# -- the queue --------------------------------------------------------------------------------
def test_second_pool_waits_in_the_queue_then_starts(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    first = sky.Compute(provider=Slurm(), nodes=2)
    first.open()
    try:
        body = """
            print("hosts", sorted(i["hostname"] for i in where() @ pool), flush=True)
            pool.close()
        """
        script = textwrap.dedent(
            """
            import socket
            import flotilla as sky

            @sky.function
            def where():
                return {"hostname": socket.gethostname()}

            pool = sky.Compute(provider=sky.Slurm(), nodes=2)
            pool.open()
            """
        ) + textwrap.dedent(body)
        client = Client(script, tmp_path)
        try:
            assert wait_until(lambda: "reason: Resources" in client.stderr(), timeout=30), (
                client.stderr()
            )
            line = next(x for x in client.stderr().splitlines() if "PENDING" in x)
            assert "flotilla-" in line and "waited" in line
            assert not client.lines
            first.close()  # frees two nodes: the waiting pool starts
            hosts = client.expect(lambda x: x.startswith("hosts"), timeout=60)
            assert hosts.count("'n") == 2
            assert client.wait(30) == 0
        finally:
            client.kill()
    finally:
        first.close()
    assert _pool_jobs(slurm_cluster) == []


def test_queue_timeout_cancels_the_waiting_job(slurm_cluster: SlurmCluster) -> None:
    with sky.Compute(provider=Slurm(), nodes=3):
        waiting = sky.Compute(provider=Slurm(queue_timeout=2), nodes=1)
        with pytest.raises(ProvisionError, match="did not start within queue_timeout=2 s"):
            waiting.open()
        assert len(_pool_jobs(slurm_cluster)) == 1
    assert _pool_jobs(slurm_cluster) == []


# -- inside an existing allocation ------------------------------------------------------------
def test_pool_inside_an_existing_allocation_leaves_it_running(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    script = tmp_path / "inside.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, socket, subprocess
            import flotilla as sky

            @sky.function
            def where():
                return socket.gethostname(), os.environ.get("SLURM_JOB_ID")

            with sky.Compute(provider=sky.Slurm(), nodes=2) as pool:
                print("nodes", where() @ pool, flush=True)
            out = subprocess.run(["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%T"],
                                 capture_output=True, text=True).stdout.strip()
            print("after", os.environ["SLURM_JOB_ID"], out, flush=True)
            """
        )
    )
    proc = slurm_cluster.slurm(
        "salloc", "--nodes=2", "--job-name=outer", sys.executable, str(script)
    )
    lines = proc.stdout.splitlines()
    nodes = next(x for x in lines if x.startswith("nodes"))
    after = next(x for x in lines if x.startswith("after")).split()
    assert after[2] == "RUNNING"  # the pool left the allocation it runs in alone
    assert f"('n1', '{after[1]}')" in nodes and f"('n2', '{after[1]}')" in nodes
    assert "Relinquishing job allocation" in proc.stderr  # salloc ended it, not flotilla
    assert slurm_cluster.wait_queue_empty(10.0) == []


def test_inside_an_allocation_more_nodes_than_it_has_is_refused(
    slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "999")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    with pytest.raises(ConfigurationError, match="inside SLURM job 999, which has 2"):
        sky.Compute(provider=Slurm(), nodes=3).open()


# -- bad input --------------------------------------------------------------------------------
def _refused(cluster: SlurmCluster, provider: Slurm, match: str, **kwargs: object) -> None:
    before = cluster.jobs()
    with pytest.raises(ConfigurationError, match=match):
        sky.Compute(provider=provider, **kwargs).open()  # type: ignore[arg-type]
    assert cluster.jobs() == before  # nothing was queued


def test_unknown_partition(slurm_cluster: SlurmCluster) -> None:
    _refused(
        slurm_cluster,
        Slurm(partition="gpu"),
        f"no partition 'gpu'.*one of {PARTITION}, {SHORT_PARTITION}",
        nodes=1,
    )


def test_more_nodes_than_the_partition_has(slurm_cluster: SlurmCluster) -> None:
    _refused(slurm_cluster, Slurm(), f"4 nodes but partition '{PARTITION}' has 3", nodes=4)
    _refused(
        slurm_cluster,
        Slurm(partition=SHORT_PARTITION),
        f"3 nodes but partition '{SHORT_PARTITION}' has 2",
        nodes=3,
    )


def test_time_over_the_partition_limit(slurm_cluster: SlurmCluster) -> None:
    _refused(
        slurm_cluster,
        Slurm(partition=SHORT_PARTITION, time="2:00:00"),
        "exceeds partition 'short'.s limit \\(01:00:00\\)",
        nodes=1,
    )


def test_gpu_type_the_partition_does_not_offer(slurm_cluster: SlurmCluster) -> None:
    _refused(
        slurm_cluster,
        Slurm(),
        "has no nodes with 8 A100 GPU.*offer: no GPUs.*Slurm\\(gres=",
        nodes=1,
        accelerator="A100:8",
    )


def test_slurm_commands_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigurationError, match=r"SLURM commands salloc, srun.* not on PATH"):
        sky.Compute(provider=Slurm(), nodes=1).open()


def test_invalid_arguments() -> None:
    assert parse_time("90") == 90 * 60
    assert parse_time("1:30") == 90
    assert parse_time("2:00:00") == 7200
    assert parse_time("1-2") == 86400 + 7200
    assert parse_time("1-0:0:5") == 86405
    for bad in ("UNLIMITED", "infinite", "2h", "1:2:3:4", "", "0", "-5"):
        with pytest.raises(ConfigurationError, match="time"):
            Slurm(time=bad)
    with pytest.raises(ConfigurationError, match=r"sbatch_args.*--nodes is set by flotilla"):
        Slurm(sbatch_args=["--nodes=4"])
    with pytest.raises(ConfigurationError, match="list of strings"):
        Slurm(sbatch_args="--exclusive")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="queue_timeout"):
        Slurm(queue_timeout=0)
    with pytest.raises(ConfigurationError, match="partition"):
        Slurm(partition="")


# -- node loss --------------------------------------------------------------------------------
def _spec(nodes: int) -> PoolSpec:
    return PoolSpec(f"t{os.getpid()}", nodes, None, None, (), Options())


def test_replace_is_a_new_one_node_job_without_the_lost_node(
    slurm_cluster: SlurmCluster,
) -> None:
    async def scenario() -> tuple[list[str], list[str], list[str]]:
        allocation = await Slurm().acquire(_spec(2))
        try:
            before = [m.host for m in allocation.machines]
            await allocation.replace(0, "lost in a test")
            after = [m.host for m in allocation.machines]
            return before, after, _pool_jobs(slurm_cluster)
        finally:
            await allocation.release()

    before, after, jobs = asyncio.run(scenario())
    assert before == ["n1", "n2"]
    assert after == ["n3", "n2"]  # the lost node is excluded from the new job
    assert len(jobs) == 2 and all(j.split()[2] == "RUNNING" for j in jobs)
    assert _pool_jobs(slurm_cluster) == []  # release ended both jobs


def test_a_node_slurm_marks_down_is_reported_lost(slurm_cluster: SlurmCluster) -> None:
    async def scenario() -> list[tuple[int, str]]:
        allocation = await Slurm().acquire(_spec(2))
        lost: list[tuple[int, str]] = []
        try:
            allocation.watch_interval = 0.05  # type: ignore[attr-defined]
            allocation.watch(lambda rank, reason: lost.append((rank, reason)))
            slurm_cluster.slurm(
                "scontrol", "update", "nodename=n2", "state=down", "reason=flotilla-test"
            )
            for _ in range(200):
                if lost:
                    break
                await asyncio.sleep(0.05)
            return lost
        finally:
            await allocation.release()
            slurm_cluster.slurm("scontrol", "update", "nodename=n2", "state=resume")

    lost = asyncio.run(scenario())
    slurm_cluster.wait_idle()
    assert lost and lost[0][0] == 1
    assert "SLURM marks node n2 DOWN" in lost[0][1] and "flotilla-test" in lost[0][1]
    assert _pool_jobs(slurm_cluster) == []


# -- agents srun cannot start ------------------------------------------------------------------
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshared"])
def test_srun_refusing_the_step_is_a_provision_error_with_its_cause(
    slurm_cluster: SlurmCluster, tmp_path: Path, shared: bool
) -> None:
    """The pool's job is cancelled (scancel) after it was granted and before the agents
    start: srun cannot create their steps, and says why."""
    provider = Slurm(shared_filesystem=shared, workdir=None if shared else str(tmp_path))

    async def scenario() -> tuple[str, str]:
        allocation = await provider.acquire(_spec(2))
        try:
            job = allocation.job.id  # type: ignore[attr-defined]
            slurm_cluster.slurm("scancel", job)
            assert wait_until(lambda: not _pool_jobs(slurm_cluster), timeout=30)
            with pytest.raises(ProvisionError) as caught:
                await allocation.start_agent(allocation.machines[1])
            assert caught.value.cause is ProvisionCause.LAUNCHER
            return job, str(caught.value)
        finally:
            await allocation.release()

    job, message = asyncio.run(scenario())
    first, *rest = message.splitlines()
    srun_says = [line for line in rest if line.startswith("srun: error:")]
    assert srun_says, message  # srun's own output follows the summary
    cause = srun_says[0].removeprefix("srun: error: ")
    assert first.startswith(f"n2: SLURM could not start the agent's step in job {job}: {cause};")
    assert "open the pool again" in first
    assert _pool_jobs(slurm_cluster) == []


def test_a_step_that_waits_is_given_up_after_start_timeout(slurm_cluster: SlurmCluster) -> None:
    """The pool's job is suspended: srun waits for the step to be allowed to start, and
    the pool gives up after start_timeout instead of waiting for ever."""
    provider = Slurm()
    spec = PoolSpec(f"t{os.getpid()}", 1, None, None, (), Options(start_timeout=2))

    async def scenario() -> tuple[str, str]:
        allocation = await provider.acquire(spec)
        job = allocation.job.id  # type: ignore[attr-defined]
        try:
            slurm_cluster.slurm("scontrol", "suspend", job)
            with pytest.raises(ProvisionError) as caught:
                await allocation.start_agent(allocation.machines[0])
            assert caught.value.cause is ProvisionCause.TIMEOUT
            return job, str(caught.value)
        finally:
            slurm_cluster.slurm("scontrol", "resume", job, check=False)
            await allocation.release()

    job, message = asyncio.run(scenario())
    assert message.startswith(f"n1: the agent's step in SLURM job {job} did not start within 2 s")
    assert "Options(start_timeout=...)" in message
    assert _pool_jobs(slurm_cluster) == []


# -- without a shared filesystem --------------------------------------------------------------
@sky.function
def flotilla_file() -> str:
    import flotilla

    return flotilla.__file__


def test_unshared_filesystem_ships_flotilla_to_the_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    provider = Slurm(shared_filesystem=False, workdir=str(tmp_path / "nodes"))
    assert not provider.shares_filesystem and provider.python == "python3"
    with sky.Compute(provider=provider, nodes=2) as pool:
        files = flotilla_file() @ pool
    assert all(f.startswith(str(tmp_path / "nodes" / "lib")) for f in files), files
    assert _pool_jobs(slurm_cluster) == []
