"""Elastic pools on the GPU markets RunPod, Lambda Cloud, GCP and Verda (their stand-ins,
``_runpod.py``, ``_lambda.py``, ``_gcp.py``, ``_verda.py``: instances that boot as namespace
hosts): an instance is made per node added and ended per node released
(``cloud.allocation``'s ``InstanceAllocation``); a pool born empty makes nothing before its
first call. The instances are counted in the stand-ins. One lab per market for the whole
module, its environment (credentials, API address) in ``os.environ`` only while a test of
that market runs."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _gcp import GcpLab
from _hosts import lab_unavailable
from _lambda import LambdaLab
from _procs import wait_until
from _runpod import RunPodLab
from _verda import VerdaLab

import flotilla as sky

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

OPTIONS = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0, start_timeout=120)
A100 = ("NVIDIA A100 80GB PCIe", "A100 PCIe", 80)
GCP_ZONES = ("us-central1-a", "us-central1-b", "us-central1-c")


@sky.function
def slow_addr(i: int) -> tuple[int, str]:
    time.sleep(0.05)
    return i, sky.instance_info().addr


@dataclass
class Market:
    """One market's lab, as these tests use it: the lab (its ``environment()``), its
    provider, the pool's instances alive in the stand-in, every instance it ever made, and
    room for ``n`` more instances."""

    lab: Any
    provider: Callable[[], Any]
    live: Callable[[str], int]
    made: Callable[[], int]
    room: Callable[[int], None]


@contextlib.contextmanager
def _lab(cls: type[Any]) -> Iterator[Any]:
    """A new lab of ``cls``, started (its environment not applied: see ``market``) and
    closed at the end; skips when none can run."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    lab = cls().started()
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def runpod_market() -> Iterator[Market]:
    with _lab(RunPodLab) as lab:
        gpu = lab.add_gpu(*A100, secure_price=1.5)

        def room(n: int) -> None:
            with lab._lock:
                gpu.stock = {"US-TX-3": n}

        yield Market(
            lab,
            lambda: sky.RunPod(),
            lambda pool: len(lab.live(f"flotilla:{pool}:")),
            lambda: len(lab.creates),
            room,
        )


@pytest.fixture(scope="module")
def lambda_market() -> Iterator[Market]:
    with _lab(LambdaLab) as lab:
        kind = lab.add_type("gpu_1x_a100", "A100 (80 GB PCIe)", 1, 129)

        def room(n: int) -> None:  # (us-west-1 has room, but not where the nodes are)
            with lab._lock:
                kind.capacity = {"us-east-1": n, "us-west-1": 8}

        yield Market(
            lab,
            lambda: sky.LambdaCloud(ssh_user="root"),
            lambda pool: len(lab.live(f"flotilla:{pool}:")),
            lambda: len(lab.launches),
            room,
        )


@pytest.fixture(scope="module")
def gcp_market() -> Iterator[Market]:
    pytest.importorskip("google.cloud.compute_v1")
    with _lab(GcpLab) as lab:

        def room(n: int) -> None:
            with lab._lock:
                lab.capacity.update({z: n if z == GCP_ZONES[0] else 0 for z in GCP_ZONES})

        yield Market(
            lab,
            lambda: sky.GCP(ssh_user="root", python=sys.executable),
            lambda pool: len(lab.live(pool)),
            lab.inserts,
            room,
        )


@pytest.fixture(scope="module")
def verda_market() -> Iterator[Market]:
    with _lab(VerdaLab) as lab:
        kind = lab.add_type("1A100.22V", "A100 SXM4 80GB", 1, 1.29)

        def room(n: int) -> None:  # (FIN-03 has room, but not where the nodes are)
            with lab._lock:
                kind.capacity = {"FIN-01": n, "FIN-03": 8}

        yield Market(
            lab,
            lambda: sky.Verda(),
            lambda pool: len(lab.live(f"flotilla:{pool}:")),
            lambda: len(lab.creates),
            room,
        )


MARKETS = ["runpod", "lambda", "gcp", "verda"]


@pytest.fixture(params=MARKETS)
def market(request: pytest.FixtureRequest) -> Iterator[Market]:
    """The market of this run of a test, its lab's environment applied while it runs."""
    chosen: Market = request.getfixturevalue(f"{request.param}_market")
    with chosen.lab.environment():
        yield chosen


def test_a_pool_born_empty_grows_with_a_burst_and_scales_to_zero(market: Market) -> None:
    """``Nodes(0, max=3, min=0)``: no instance before the first call (lazy start); a
    burst of 30 calls makes the pool head for 3 nodes and makes 3 instances; idle, every
    instance is ended by the client (none left in the market, the pool's bill 0)."""
    market.room(3)
    before = market.made()
    with sky.Compute(
        provider=market.provider(),
        accelerator="A100",
        nodes=sky.Nodes(0, max=3, min=0),
        options=OPTIONS,
    ) as pool:
        assert pool.current_nodes() == 0
        assert market.live(pool.pool_id) == 0 and market.made() == before
        out = pool.map(slow_addr, range(30))
        assert [i for i, _ in out] == list(range(30))
        elastic = pool._elastic
        assert elastic is not None and any(" 0 -> 3 node(s)" in d for d in elastic.decisions)
        assert market.made() - before == 3
        assert wait_until(lambda: pool.current_nodes() == 0, timeout=120)
        assert wait_until(lambda: market.live(pool.pool_id) == 0, timeout=120)
        allocation: Any = pool._allocation
        assert wait_until(lambda: allocation.hourly == 0, timeout=60)  # the bill stops
    assert market.made() - before == 3


def test_a_grow_step_without_capacity_keeps_the_pool_working(
    market: Market, capfd: pytest.CaptureFixture[str]
) -> None:
    """``Nodes(1, max=3)`` where the market has room for one instance (Lambda, Verda: in
    the region or location of the pool's node; another region's room would be another
    private network):
    the burst's grow step meets a capacity error; the pool says so and runs every call on
    its one node.
    Once there is room, ``resize(2)`` adds an instance and ``resize(1)`` ends it again,
    keeping rank 0's."""
    market.room(1)
    with sky.Compute(
        provider=market.provider(),
        accelerator="A100",
        nodes=sky.Nodes(1, max=3),
        options=sky.Options(autoscale_idle_timeout=600, autoscale_cooldown=0, start_timeout=120),
    ) as pool:
        out = pool.map(slow_addr, range(20))
        assert [i for i, _ in out] == list(range(20)) and len({a for _, a in out}) == 1
        assert pool.current_nodes() == 1 and market.live(pool.pool_id) == 1
        market.room(1)
        pool.resize(2)
        assert wait_until(lambda: pool.current_nodes() == 2, timeout=120)
        assert market.live(pool.pool_id) == 2
        pool.resize(1)
        assert wait_until(lambda: market.live(pool.pool_id) == 1, timeout=120)
        assert slow_addr(0) >> pool == (0, out[0][1])
    assert "the pool could not grow" in capfd.readouterr().err


@pytest.mark.parametrize("market", ["runpod", "gcp"], indirect=True)
def test_an_elastic_pool_cannot_be_a_stoppable_one(market: Market, tmp_path: Path) -> None:
    """A named cluster's pool (its provider keeps stopped instances) with a range of nodes
    is refused before anything is made: its instances come and go, what is kept is a fixed
    pool's nodes."""
    from flotilla._providers.cloud.kept import Keep

    provider = market.provider()
    provider.keep = Keep(tmp_path / "keep")
    before = market.made()
    nodes = sky.Nodes(0, max=3, min=0)
    with (
        pytest.raises(sky.ConfigurationError, match="cannot be a stoppable one"),
        sky.Compute(provider=provider, accelerator="A100", nodes=nodes),
    ):
        pass
    assert market.made() == before


@pytest.mark.parametrize("market", ["runpod", "gcp", "verda"], indirect=True)
def test_an_unreadable_stopped_pool_record_leaves_no_key_folder(
    market: Market, tmp_path: Path
) -> None:
    """A named cluster's pool whose record of stopped instances cannot be read is refused
    before anything is made, the record left for the user, and the pool's folder on this
    machine (its private login key) is removed, as every pool's release removes it."""
    from _standin import key_folders

    from flotilla._providers.cloud.identity import client_id
    from flotilla._providers.cloud.kept import Keep

    provider = market.provider()
    provider.keep = keep = Keep(tmp_path / "keep")
    keep.folder.mkdir()
    keep.state_file.write_text("{not json")
    before = market.made()
    with (
        pytest.raises(sky.ConfigurationError, match="cannot be read"),
        sky.Compute(provider=provider, accelerator="A100", nodes=2),
    ):
        pass
    assert market.made() == before and keep.state_file.read_text() == "{not json"
    assert key_folders([client_id()]) == []
