"""Elastic pools on Vast.ai (the stand-in marketplace of ``_vast.py``, whose instances boot
as namespace hosts): an instance is rented per node added, on another machine of the
pool's physical cluster (joined to its overlay), and destroyed per node released; a pool
born empty rents nothing before its first call."""

from __future__ import annotations

import time

import pytest
from _procs import wait_until
from _vast import VastLab, vast_lab_fixture  # noqa: F401 - the vast_lab fixture

import flotilla as sky

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@sky.function
def slow_place(i: int) -> tuple[int, str, list[str]]:
    time.sleep(0.05)
    info = sky.instance_info()
    return i, info.addr, [p.addr for p in info.peers]


def _rented(lab: VastLab) -> int:
    return sum(1 for method, path in lab.requests if method == "PUT" and "/asks/" in path)


def test_a_vast_pool_born_empty_rents_per_node_and_scales_to_zero(vast_lab: VastLab) -> None:
    """``Nodes(0, max=3, min=0)``: the cluster is the cheapest that holds 3 machines (not
    the cheaper one of 2); nothing is rented before the first call; a burst runs on at
    most 3 instances of that cluster; idle, every instance is destroyed by the client; the
    next call rents one again."""
    vast_lab.add_machines(3, cluster_id=7, dph_total=1.0)
    vast_lab.add_machines(2, cluster_id=8, dph_total=0.5)  # cheaper, but max does not fit
    options = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0, start_timeout=120)
    nodes = sky.Nodes(0, max=3, min=0)
    with sky.Compute(
        provider=sky.VastAI(), accelerator="A100", nodes=nodes, options=options
    ) as pool:
        assert pool.current_nodes() == 0
        assert vast_lab.live() == [] and _rented(vast_lab) == 0
        (overlay,) = vast_lab.overlays.values()
        assert overlay.cluster_id == 7
        out = pool.map(slow_place, range(60))
        assert [i for i, _, _ in out] == list(range(60))
        rented = _rented(vast_lab)
        assert 1 <= len({addr for _, addr, _ in out}) <= 3 and 1 <= rented <= 3
        assert all(addr.startswith(overlay.subnet + ".") for _, addr, _ in out)
        assert {i.machine.spec.cluster_id for i in vast_lab.live()} <= {7}
        assert wait_until(lambda: pool.current_nodes() == 0, timeout=120)
        assert vast_lab.wait_gone(60) == []  # every instance destroyed: nothing billed
        assert set(vast_lab.destroyed.values()) == {"account"}
        assert (slow_place(1) >> pool)[0] == 1
        assert len(vast_lab.live()) == 1 and _rented(vast_lab) == rented + 1
    assert vast_lab.wait_gone(60) == [] and vast_lab.overlays == {}


def test_a_vast_pool_grows_and_shrinks_one_instance_at_a_time(vast_lab: VastLab) -> None:
    """``Nodes(1, max=3)``: ``resize(3)`` rents two more instances, on the cluster's other
    machines, every node's peers the three overlay addresses; ``resize(1)`` destroys the
    last two and keeps rank 0's."""
    vast_lab.add_machines(3, cluster_id=4, dph_total=1.0)
    options = sky.Options(autoscale_idle_timeout=600, autoscale_cooldown=0, start_timeout=120)
    with sky.Compute(
        provider=sky.VastAI(), accelerator="A100", nodes=sky.Nodes(1, max=3), options=options
    ) as pool:
        (first,) = vast_lab.live()
        pool.resize(3)
        assert wait_until(lambda: pool.current_nodes() == 3, timeout=180)
        live = vast_lab.live()
        assert len(live) == 3 and len({i.machine.machine_id for i in live}) == 3
        places = slow_place(0) @ pool
        addrs = sorted(addr for _, addr, _ in places)
        assert len(set(addrs)) == 3 and all(sorted(p) == addrs for _, _, p in places)
        pool.resize(1)
        assert wait_until(lambda: [i.id for i in vast_lab.live()] == [first.id], timeout=60)
        assert pool.current_nodes() == 1
        assert len(vast_lab.destroyed) == 2
        assert slow_place(2) >> pool == (2, places[0][1], [places[0][1]])
