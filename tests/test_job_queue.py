"""The resource-aware job queue of a cluster: jobs declare accelerators (fractions too),
vCPUs and memory, run at once while their nodes have room, wait (FIFO) otherwise; a job
that can never fit is refused; CUDA_VISIBLE_DEVICES names the devices a job was given.
Real local clusters with a stand-in ``nvidia-smi`` on PATH (the nodes count its GPUs)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from _procs import wait_until
from test_cli import CLI
from test_cli import cli as cli  # the fixture
from test_node_gpus import stand_in_nvidia_smi

from flotilla.cli.ledger import Demand, Ledger
from flotilla.cli.state import NodeRecord

A100 = "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5b3e5c-0000-1111-2222-333344445555)\n"


def node(i: int, gpus: int, cpus: int = 8, memory: float = 32.0) -> NodeRecord:
    return NodeRecord(i, "127.0.0.1", "h", "/w", 1, gpus=gpus, cpus=cpus, memory_gb=memory)


# -- the ledger --------------------------------------------------------------------------------
def test_half_gpu_jobs_share_a_device_and_the_third_waits() -> None:
    ledger = Ledger([node(0, 1), node(1, 1)])
    half = Demand(gpus=0.5)
    a, b = ledger.take(half, 2), ledger.take(half, 2)
    assert a is not None and b is not None
    assert a.devices == b.devices == {0: [0], 1: [0]}  # both on device 0 of each node
    assert ledger.take(half, 2) is None  # no room left: it waits
    ledger.give_back(a)
    assert ledger.take(half, 2) is not None  # a's half is free again


def test_whole_devices_are_named_and_fractions_pack_tightly() -> None:
    ledger = Ledger([node(0, 2)])
    one = ledger.take(Demand(gpus=1), 1)
    other = ledger.take(Demand(gpus=1), 1)
    assert one is not None and other is not None
    assert (one.devices, other.devices) == ({0: [0]}, {0: [1]})
    ledger.give_back(one)
    quarter = ledger.take(Demand(gpus=0.25), 1)
    assert quarter is not None and quarter.devices == {0: [0]}
    again = ledger.take(Demand(gpus=0.5), 1)  # the partly used device, not a free one
    assert again is not None and again.devices == {0: [0]}
    assert ledger.take(Demand(gpus=1), 1) is None  # no wholly free device left


def test_cpus_and_memory_are_shared_out_and_undeclared_jobs_hold_nodes_whole() -> None:
    ledger = Ledger([node(0, 0, cpus=4, memory=16), node(1, 0, cpus=4, memory=16)])
    three = ledger.take(Demand(cpus=3), 1)
    assert three is not None and three.nodes == [0]
    two = ledger.take(Demand(cpus=2, memory=8), 1)
    assert two is not None and two.nodes == [1]  # node 0 has 1 vCPU left: the next node
    assert ledger.take(Demand(memory=9), 2) is None  # node 0 has room, node 1 8 GB left
    nine = ledger.take(Demand(memory=9), 1)
    assert nine is not None and nine.nodes == [0]
    ledger.give_back(nine)
    assert ledger.take(Demand(), 1) is None  # a job that declares nothing: a node alone
    ledger.give_back(two)
    whole = ledger.take(Demand(), 1)
    assert whole is not None and whole.nodes == [1] and whole.devices == {1: []}
    assert ledger.take(Demand(cpus=0.5), 2) is None  # node 1 is held whole


@pytest.mark.parametrize(
    ("demand", "count", "message"),
    [
        (Demand(gpus=0.5), 1, "cluster c's nodes have no GPU"),
        (Demand(gpus=2), 2, "needs 2 node(s) with A100:2 but only 1 of cluster c's nodes"),
        (Demand(), 3, "the job needs 3 nodes but cluster c has 2"),
    ],
)
def test_a_job_that_can_never_fit_is_refused_saying_why(
    demand: Demand, count: int, message: str
) -> None:
    ledger = Ledger([node(0, 2), node(1, 0)] if demand.gpus > 1 else [node(0, 0), node(1, 0)])
    assert message in ledger.refusal(demand, count, "c", "A100")
    assert ledger.refusal(Demand(cpus=8), 2, "c") == ""


def test_more_vcpus_or_memory_than_a_node_has_is_a_hint_the_job_holds_the_node() -> None:
    ledger = Ledger([node(0, 0, cpus=8, memory=32)])
    assert ledger.refusal(Demand(cpus=100_000, memory=640), 1, "c") == ""  # as launch warns
    big = ledger.take(Demand(cpus=100_000), 1)
    assert big is not None
    assert ledger.take(Demand(cpus=0.5), 1) is None  # it holds every vCPU
    ledger.give_back(big)
    assert ledger.take(Demand(cpus=8), 1) is not None


# -- a real cluster ----------------------------------------------------------------------------
@pytest.fixture
def gpu_cli(tmp_path: Path) -> Iterator[CLI]:
    runner = CLI(tmp_path / "home", tmp_path)
    runner.env["PATH"] = stand_in_nvidia_smi(tmp_path / "bin", A100)  # 1 GPU per node
    try:
        yield runner
    finally:
        runner.clean_up()


HALF = """\
    resources:
      accelerators: A100:0.5
    run: |
      echo "hello from job $FLOTILLA_JOB_ID"
      echo "job $FLOTILLA_JOB_ID rank $SKYPILOT_NODE_RANK devices $CUDA_VISIBLE_DEVICES" \
        >> $SHARED/started
      until [ -e $SHARED/go-$FLOTILLA_JOB_ID ]; do sleep 0.1; done
"""


@pytest.mark.timeout(240)
def test_four_half_gpu_jobs_on_two_nodes_two_run_two_queue_then_run(
    gpu_cli: CLI, tmp_path: Path
) -> None:
    cli = gpu_cli
    shared = tmp_path / "shared"
    shared.mkdir()
    started = shared / "started"
    cli.ok("launch", "echo up", "-c", "gq", "--nodes", "2")
    rec = cli.record("gq")
    assert rec is not None and [n.gpus for n in rec.nodes] == [1, 1]
    task = cli.task("half.yaml", HALF)
    for _ in range(4):  # jobs 2..5 (1 was launch's)
        cli.ok("exec", "gq", "-d", "--env", f"SHARED={shared}", task)

    def lines() -> list[str]:
        return started.read_text().splitlines() if started.exists() else []

    def jobs_started() -> set[str]:
        return {line.split()[1] for line in lines()}

    def statuses() -> dict[str, tuple[str, str]]:
        rows = cli.ok("queue", "gq").stdout.splitlines()
        assert rows[0].split()[-1] == "RESOURCES"
        return {r.split()[0]: (r.split()[2], r.split()[-1]) for r in rows[1:]}

    assert wait_until(lambda: len(lines()) == 4, 90), lines()  # 2 jobs x 2 nodes
    assert jobs_started() == {"2", "3"}
    queue = statuses()
    assert queue["2"] == queue["3"] == ("RUNNING", "A100:0.5")
    assert queue["4"] == queue["5"] == ("PENDING", "A100:0.5")  # no room: they wait
    assert all(line.endswith("devices 0") for line in lines())  # both share device 0

    done = cli.ok("cancel", "gq", "2")  # frees its room at once: job 4 starts
    assert "CANCELLED" in done.stderr
    assert wait_until(lambda: "4" in jobs_started(), 60), lines()
    queue = statuses()
    assert (queue["3"][0], queue["4"][0], queue["5"][0]) == ("RUNNING", "RUNNING", "PENDING")
    (shared / "go-3").touch()  # job 3 ends: job 5 starts
    assert wait_until(lambda: "5" in jobs_started(), 60), lines()
    (shared / "go-4").touch()
    (shared / "go-5").touch()
    assert wait_until(
        lambda: (
            [s for s, _ in statuses().values()]
            == ["SUCCEEDED", "CANCELLED", "SUCCEEDED", "SUCCEEDED", "SUCCEEDED"]
        ),
        60,
    ), statuses()
    assert len(lines()) == 8 and all(line.endswith("devices 0") for line in lines())
    for job in ("3", "4"):  # jobs that ran at once on the same nodes: each its own lines
        logs = cli.ok("logs", "gq", job).stdout
        assert logs.count(f"hello from job {job}") == 2, logs
        assert "hello from job" not in logs.replace(f"hello from job {job}", ""), logs

    too_big = cli("exec", "gq", "--gpus", "A100:2", "echo never")  # refused: never queued
    assert too_big.returncode == 2, too_big.stderr
    assert "2 GPU(s) per node but this machine has 1" in too_big.stderr
    assert len(statuses()) == 5


@pytest.mark.timeout(120)
def test_gpus_on_a_cluster_without_gpus_is_a_clear_error(cli: CLI) -> None:
    if shutil.which("nvidia-smi", path=cli.env["PATH"]) or Path("/dev/nvidia0").exists():
        pytest.skip("this machine has GPUs")
    cli.ok("launch", "echo up", "-c", "plain")
    done = cli("exec", "plain", "--gpus", "A100:0.5", "echo never")
    assert done.returncode == 2, done.stderr
    # the local provider's own check speaks first (every node is this machine); on other
    # providers the queue's refusal does (test_a_job_that_can_never_fit_is_refused_saying_why)
    assert "A100:0.5 needs 1 GPU(s) per node but this machine has 0" in done.stderr
    queue = cli.ok("queue", "plain").stdout.splitlines()
    assert len(queue) == 2  # only launch's job: nothing was queued
    bad = cli("exec", "plain", "--gpus", "A100:zero", "echo never")
    assert bad.returncode == 2 and "--gpus 'A100:zero'" in bad.stderr
