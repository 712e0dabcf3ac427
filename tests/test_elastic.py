"""Elastic pools (Skyward's ``Nodes(desired, max, min)``): open with ``min``, add the rest as
they come up, grow under queued calls up to ``max``, shrink back when idle; every node sees
the new size. Real local pools and real SSH test hosts (sshd stopped for "down")."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _hosts import Lab, TestHost, lab_unavailable
from _procs import assert_all_gone, processes_in, wait_until

import flotilla as sky
from flotilla._providers.base import Allocation, Machine, PoolSpec, Provider
from flotilla._providers.offers import Offer


@sky.function
def place() -> tuple[int, int, int, str]:
    """(node, total_nodes, peers, host name) as the node sees them."""
    info = sky.instance_info()
    return info.node, info.total_nodes, len(info.peers), socket.gethostname()


@sky.function
def slow(_: int) -> tuple[int, int, int]:
    """Busy for a while: (node, total_nodes, pid of the process that ran it)."""
    import time

    time.sleep(1.0)
    info = sky.instance_info()
    return info.node, info.total_nodes, os.getpid()


def test_nodes_forms() -> None:
    assert sky.Nodes.of(3) == sky.Nodes(3)
    assert sky.Nodes.of((1, 3)) == sky.Nodes(1, max=3)
    assert not sky.Nodes(3).elastic
    spec = sky.Nodes(4, min=2, max=6)
    assert (spec.least, spec.desired, spec.most, spec.elastic) == (2, 4, 6, True)
    for bad in ((-1, 2), (2, "3"), "2", (1, 2, 3)):
        with pytest.raises(sky.ConfigurationError, match="nodes"):
            sky.Nodes.of(bad)


def test_nodes_take_skywards_order_meaning_and_messages() -> None:
    """``Nodes(desired, max, min)`` as skyward/api/spec.py has it: ``Nodes(2, 8)`` is a pool
    of 2 that grows up to 8 (it was ``min=8`` here, an error); ``(lo, hi)`` is
    ``(desired, max)``; 0 is lazy start and scale to zero; Skyward's checks, in its words."""
    assert sky.Nodes(2, 8) == sky.Nodes(desired=2, max=8) == sky.Nodes.of((2, 8))
    assert (sky.Nodes(2, 8).least, sky.Nodes(2, 8).most, sky.Nodes(2, 8).auto_scaling) == (
        2,
        8,
        True,
    )
    empty = sky.Nodes(0, 4, 0)
    assert (empty.desired, empty.max, empty.min, empty.least, empty.start) == (0, 4, 0, 0, 0)
    assert sky.Nodes(0, max=4).least == 0  # min defaults to desired: it scales to zero too
    assert sky.Nodes(2, max=8, min=4).start == 4  # more may be needed than desired
    assert not sky.Nodes(3).auto_scaling and not sky.Nodes(3).elastic
    for bad, message in (
        (lambda: sky.Nodes(-1), r"Nodes\(-1\): desired must be >= 0, got -1"),
        (lambda: sky.Nodes(4, 1), r"max \(1\) must be >= desired \(4\)"),
        (lambda: sky.Nodes(2, min=3), r"min \(3\) must be <= desired \(2\)"),
        (lambda: sky.Nodes(2, 4, 5), r"min \(5\) must be <= max \(4\)"),
        (lambda: sky.Nodes(2, 4, -1), r"min must be >= 0, got -1"),
        (lambda: sky.Nodes.of("2"), r"nodes must be int, tuple\[int, int\], or Nodes"),
        (lambda: sky.Compute(nodes=(4, 1)), r"max \(1\) must be >= desired \(4\)"),
    ):
        with pytest.raises(sky.ConfigurationError, match=message):
            bad()


def test_nodes_2_8_on_local_is_elastic_up_to_8() -> None:
    options = sky.Options(autoscale_idle_timeout=600)
    with sky.Compute(nodes=sky.Nodes(2, 8), options=options) as pool:
        assert pool.current_nodes() == 2
        assert len(pool.map(slow, range(16))) == 16  # 14 queued: up by ceil(14 / 1), to 8
        assert pool._elastic is not None and pool._elastic.target == 8
        assert wait_until(lambda: pool.current_nodes() == 8, timeout=120)
        assert [s[:3] for s in place() @ pool] == [(r, 8, 8) for r in range(8)]
        with pytest.raises(sky.ConfigurationError, match=r"within its min \(2\) and max \(8\)"):
            pool.resize(9)
        pool.resize(3)  # manual, within the bounds: idle nodes go, the last first
        assert wait_until(lambda: pool.current_nodes() == 3, timeout=60)
        assert [s[:3] for s in place() @ pool] == [(r, 3, 3) for r in range(3)]


def test_resize_with_nodes_changes_the_bounds_at_run_time() -> None:
    """Skyward's ``pool.resize(Nodes(...))`` / ``resize(desired, max)``: the pool's bounds
    change while it runs (within the max it opened with): it heads for the new desired, the
    autoscaler keeps to the new min and max, and ``resize(n)`` checks the new ones."""
    options = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0)
    with sky.Compute(nodes=sky.Nodes(1, max=5), options=options) as pool:
        assert pool.current_nodes() == 1
        pool.resize(sky.Nodes(3, max=4, min=2))
        assert pool.size == sky.Nodes(3, max=4, min=2)
        elastic = pool._elastic
        assert elastic is not None
        # it grows to the new desired 3, then, idle, shrinks to the new min 2 (not 1)
        shrunk = "autoscaler: 3 -> 2 node(s): idle"
        assert wait_until(lambda: any(d.startswith(shrunk) for d in elastic.decisions), 120)
        assert "autoscaler: 1 -> 3 node(s): pool.resize()" in elastic.decisions
        assert wait_until(lambda: pool.current_nodes() == 2, timeout=120)
        assert [s[:3] for s in place() @ pool] == [(r, 2, 2) for r in range(2)]
        with pytest.raises(sky.ConfigurationError, match=r"within its min \(2\) and max \(4\)"):
            pool.resize(5)
        assert len(pool.map(slow, range(12))) == 12  # queued: up to the new max, 4
        assert max(int(d.split()[3]) for d in elastic.decisions) == 4
        pool.resize(1, 2)  # Nodes(1, max=2): min 1
        assert wait_until(lambda: pool.current_nodes() == 1, timeout=120)
        assert pool.size == sky.Nodes(1, max=2)
        with pytest.raises(sky.ConfigurationError, match="at most 5 node"):
            pool.resize(sky.Nodes(2, max=6))
        for bad in ((), (1, 2, 3), ("2",), (True,)):
            with pytest.raises(sky.ConfigurationError, match=r"give resize\(n\)"):
                pool.resize(*bad)  # type: ignore[arg-type]
        with pytest.raises(sky.ConfigurationError, match=r"max \(1\) must be >= desired"):
            pool.resize(3, 1)
    with (
        sky.Compute(nodes=2) as fixed,
        pytest.raises(sky.ConfigurationError, match="fixed size"),
    ):
        fixed.resize(sky.Nodes(1, max=3))


@sky.function
def where(i: int) -> tuple[int, int, int]:
    """(i, node, pid)."""
    return i, sky.instance_info().node, os.getpid()


def test_a_pool_born_empty_runs_a_burst_and_scales_to_zero(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``Nodes(0, max=4, min=0)``: no node before the first call; a burst of 200 calls runs
    on up to 4; idle, every node goes (the head too), and the next broadcast or call starts
    one again. The collections live in the client: they answer while the pool is empty."""
    options = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0)
    provider = sky.Local(workdir=str(tmp_path))
    with sky.Compute(provider, nodes=sky.Nodes(0, max=4, min=0), options=options) as pool:
        assert pool.current_nodes() == 0 and not processes_in(tmp_path)
        pool.dict("kept")["a"] = 1  # the collections answer with no node
        with pytest.raises(sky.ConfigurationError, match=r"has 0 node.*starts nodes on its next"):
            pool.submit_broadcast(place(), nodes=[0])
        out = pool.map(where, range(200))
        assert [i for i, _, _ in out] == list(range(200))
        assert {node for _, node, _ in out} <= {0, 1, 2, 3}
        elastic = pool._elastic
        assert elastic is not None and max(int(d.split()[3]) for d in elastic.decisions) <= 4
        assert wait_until(lambda: pool.current_nodes() == 0, timeout=60)  # scaled to zero
        assert wait_until(lambda: not processes_in(tmp_path), timeout=30), processes_in(tmp_path)
        assert pool.dict("kept")["a"] == 1
        assert [s[:3] for s in place() @ pool] == [(0, 1, 1)]  # a broadcast wakes it
        assert wait_until(lambda: pool.current_nodes() == 0, timeout=60)
        assert (where(7) >> pool)[:2] == (7, 0)  # and so does a single call
    err = capfd.readouterr().err
    assert "the pool is empty: its first call starts nodes (up to 4)" in err
    assert "autoscaler: 0 -> 4 node(s): 200 call(s) queued" in err
    assert "the pool is empty: its next call starts a node" in err


def test_every_autoscaler_decision_is_a_scaling_decision_event(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Each decision (grow for queued calls, ``pool.resize``, shrink when idle) is one
    ``events.ScalingDecision`` with the counts it heads from and to and the reason the
    console line gives; it survives ``as_dict``/``from_dict`` (``flotilla events --json``)."""
    from flotilla import events

    got: list[events.ScalingDecision] = []
    options = sky.Options(autoscale_idle_timeout=0.5, autoscale_cooldown=0)
    pool = sky.Compute(nodes=sky.Nodes(0, max=3, min=0), options=options, metrics=None)
    pool.subscribe(
        on_event=lambda e: got.append(e) if isinstance(e, events.ScalingDecision) else None
    )
    with pool:
        assert [i for i, _, _ in pool.map(where, range(30))] == list(range(30))
        assert wait_until(lambda: pool.current_nodes() == 0, timeout=60)
        pool.resize(2)
        assert wait_until(lambda: len(got) >= 3 and got[2].reason == "pool.resize()", 30), got
    first, idle, manual = got[:3]
    assert (first.from_nodes, first.pool) == (0, pool.pool_id)
    assert 1 <= first.to_nodes <= 3 and "call(s) queued" in first.reason
    assert (idle.from_nodes, idle.to_nodes) == (first.to_nodes, 0)
    assert idle.reason == "idle for 0.5 s"
    assert (manual.from_nodes, manual.to_nodes) == (0, 2)
    err = capfd.readouterr().err
    for d in got[:3]:
        assert f"autoscaler: {d.from_nodes} -> {d.to_nodes} node(s): {d.reason}" in err
        assert events.from_dict(events.as_dict(d)) == d


def test_flotilla_events_shows_a_scaling_decision_as_its_console_line() -> None:
    from flotilla import events
    from flotilla.cli.observe import describe

    why = "200 call(s) queued, 1 slot(s) a node"
    decision = events.ScalingDecision(pool="p", from_nodes=0, to_nodes=4, reason=why)
    line = describe(events.as_dict(decision))
    assert line.split(" ", 1)[1] == f"autoscaler: 0 -> 4 node(s): {why}"


def test_a_shrink_during_map_loses_no_call() -> None:
    """Decisions to shrink come while calls are being placed (the pool is under a third
    busy at every moment between short calls: no idle timeout, no cooldown): every call
    still runs exactly once, and only idle nodes go."""
    options = sky.Options(autoscale_idle_timeout=0, autoscale_cooldown=0)
    with sky.Compute(nodes=sky.Nodes(1, max=4), options=options) as pool:
        elastic = pool._elastic
        assert elastic is not None
        shrunk_during_map = False
        deadline = time.monotonic() + 300  # a loaded machine may need many maps to meet it
        while time.monotonic() < deadline:
            before = len(elastic.decisions)
            out = pool.map(where, range(300))
            assert [i for i, _, _ in out] == list(range(300))
            during = elastic.decisions[before:]
            shrunk_during_map = any(_down(d) for d in during)
            if shrunk_during_map:
                break
        assert shrunk_during_map


@sky.function
def hold_until(name: str) -> str:
    """Busy until the client puts something in the queue ``name``."""
    return str(sky.queue(name).get(timeout=120))


def test_a_call_placed_on_a_node_released_meanwhile_goes_to_another() -> None:
    """The interleaving a shrink during ``map`` can meet: the dispatcher chose the last
    node for a call, and the shrink released that node (it was idle) before the call was
    written. The call is placed again (it waited for a free slot here), not lost: it used
    to fail with an IndexError (the released rank was looked up among the nodes left)."""
    with sky.Compute(
        nodes=sky.Nodes(2, max=3), options=sky.Options(autoscale_idle_timeout=600)
    ) as pool:
        d = pool._dispatcher
        busy = hold_until("go") > pool  # node 0 busy: the next call goes to node 1
        assert wait_until(lambda: any(d.nodes[0].busy), timeout=30)
        last = d.nodes[-1]
        send = last.send

        def released_first(subs: list[Any]) -> None:
            shrunk = d.membership.remove_idle(last, lambda nodes, to: [])
            assert shrunk is not None  # the shrink won
            send(subs)

        last.send = released_first  # type: ignore[method-assign]
        moved = where(1) > pool
        pool.queue("go").put("now")
        assert busy.result(timeout=60) == "now"
        assert moved.result(timeout=60)[:2] == (1, 0)


class _Priced(sky.Local):
    """The local provider, with a price per node-hour (as a cloud's offers have)."""

    price = 1.0

    def offers(self, spec: PoolSpec) -> list[Offer] | None:
        return [Offer("local", None, 0, self.price, "here", False, "a process")]


class _Dear(_Priced):
    price = 2.0


class _Cheap(_Priced):
    price = 0.5


def test_growth_stops_at_what_max_hourly_cost_buys(capfd: pytest.CaptureFixture[str]) -> None:
    options = sky.Options(autoscale_idle_timeout=600)
    with sky.Compute(
        _Priced(), nodes=sky.Nodes(1, max=4), options=options, max_hourly_cost=2.5
    ) as pool:
        assert len(pool.map(slow, range(8))) == 8  # 7 queued: 4 wanted, 2 bought
        elastic = pool._elastic
        assert elastic is not None and elastic.cap == 2
        assert elastic.decisions and all(int(d.split()[3]) <= 2 for d in elastic.decisions)
        with pytest.raises(sky.ConfigurationError, match=r"max \(2\) \(max_hourly_cost buys 2\)"):
            pool.resize(3)
    assert "autoscaler: 1 -> 2 node(s): 7 call(s) queued" in capfd.readouterr().err


def test_over_a_provider_list_growth_stops_at_what_the_chosen_candidate_buys() -> None:
    """``provider=[$2/h a node, $0.5/h a node]`` in order, ``max_hourly_cost=4.5``: the
    pool is on the first candidate, so it may grow to 2 nodes, not to the 4 (its max) that
    the cheapest offer of the whole list would buy."""
    options = sky.Options(autoscale_idle_timeout=600)
    dear = _Dear()
    with sky.Compute(
        provider=[dear, _Cheap()], nodes=sky.Nodes(1, max=4), options=options, max_hourly_cost=4.5
    ) as pool:
        assert pool.provider.chosen is dear  # type: ignore[attr-defined]
        elastic = pool._elastic
        assert elastic is not None and elastic.cap == 2
        with pytest.raises(sky.ConfigurationError, match=r"max \(2\) \(max_hourly_cost buys 2\)"):
            pool.resize(3)


def test_a_torch_group_scales_to_zero_and_starts_a_new_group() -> None:
    """A group pool with ``min=0``: idle, its group ends with its last node; the next
    broadcast starts a new group of one."""
    pytest.importorskip("torch")
    options = sky.Options(autoscale_idle_timeout=0.5, autoscale_cooldown=0)
    plugins = [sky.plugins.torch()]
    with sky.Compute(nodes=sky.Nodes(1, max=2, min=0), plugins=plugins, options=options) as pool:
        assert world() @ pool == [(1, 1.0, 1)]
        assert wait_until(lambda: pool.current_nodes() == 0, timeout=120)
        assert world() @ pool == [(1, 1.0, 1)]


def _down(decision: str) -> bool:
    """Whether an autoscaler line ("autoscaler: 4 -> 2 node(s): ...") is a shrink."""
    words = decision.split()
    return int(words[3]) < int(words[1])


def test_a_pool_opens_with_min_and_grows_to_desired() -> None:
    with sky.Compute(nodes=sky.Nodes(3, min=1)) as pool:
        assert pool.nodes >= 1
        assert wait_until(lambda: pool.nodes == 3, timeout=60)
        seen = place() @ pool
        assert [s[:3] for s in seen] == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]


def test_a_pool_that_opens_early_without_a_max_keeps_its_size() -> None:
    """``Nodes(3, min=1)`` is Skyward's "fixed, start early": ``min`` is when it opens,
    not a floor to shrink to (no max: no autoscaling), however long it is idle."""
    from flotilla._client import loop

    options = sky.Options(autoscale_idle_timeout=0, autoscale_cooldown=0)
    with sky.Compute(nodes=sky.Nodes(3, min=1), options=options) as pool:
        assert wait_until(lambda: pool.current_nodes() == 3, timeout=60)
        elastic = pool._elastic
        assert elastic is not None

        async def decide() -> None:
            for _ in range(3):  # idle from the first look on: a shrink would be decided
                elastic._scale()

        loop.run(decide())
        assert (elastic.target, elastic.decisions, pool.current_nodes()) == (3, [], 3)


def test_a_pool_grows_under_map_and_shrinks_when_idle(capfd: pytest.CaptureFixture[str]) -> None:
    options = sky.Options(autoscale_idle_timeout=0.5, autoscale_cooldown=0)
    with sky.Compute(nodes=(1, 3), options=options) as pool:
        assert pool.nodes == 1
        assert [s[:3] for s in place() @ pool] == [(0, 1, 1)]
        out = pool.map(slow, range(9))
        assert {node for node, _, _ in out} == {0, 1, 2}  # the new nodes took calls
        assert max(total for _, total, _ in out) == 3  # and every node learnt the size
        grown = {pid for node, _, pid in out if node > 0}
        assert wait_until(lambda: pool.nodes == 1, timeout=30)  # idle: back to desired
        assert [s[:3] for s in place() @ pool] == [(0, 1, 1)]  # broadcasts: nodes present
        assert_all_gone(grown, timeout=10, what="processes of the released nodes")
    err = capfd.readouterr().err  # one line per event
    assert "joined: the pool has 3 node(s)" in err
    assert "autoscaler: 1 -> 3 node(s): " in err  # one line per decision
    assert "autoscaler: 3 -> 1 node(s): idle for 0.5 s" in err
    assert "node 2 released: the pool has 2 node(s)" in err


def test_close_ends_the_pools_loop_when_it_is_cancelled_as_it_wakes() -> None:
    """The elastic pool's own loop is cancelled (by close) in the very step its wake-up
    event is set. On Python 3.11, ``asyncio.wait_for`` then returned normally and lost the
    cancellation: the loop ran on and the pool's close never returned (a full-run hang)."""
    from flotilla._client import loop

    with sky.Compute(nodes=(1, 2), options=sky.Options(autoscale_idle_timeout=600)) as pool:
        elastic = pool._elastic
        assert elastic is not None

        async def cancel_as_it_wakes() -> bool:
            (runs,) = [t for t in elastic._tasks if "_run" in repr(t.get_coro())]
            await asyncio.sleep(0.02)  # it waits for the event again
            elastic._wake.set()
            runs.cancel()
            done, _ = await asyncio.wait({runs}, timeout=5)
            return runs in done and runs.cancelled()

        assert loop.run(cancel_as_it_wakes())


def test_at_max_calls_queue_on_the_nodes_again() -> None:
    """Below max a call waits for a free process (so that the pool grows for it); at max
    calls queue on the nodes, with no round trip to the client between two of them."""
    with sky.Compute(nodes=(1, 2), options=sky.Options(autoscale_idle_timeout=600)) as pool:
        pool.map(slow, range(4))
        assert wait_until(lambda: pool.nodes == 2, timeout=30)
        futures = [pool.submit(slow(i)) for i in range(6)]
        d = pool._dispatcher
        assert not d.backlog and sum(len(n.inflight) for n in d.nodes) == 6
        assert len({f.result()[0] for f in futures}) == 2


def test_a_torch_group_restarts_with_the_new_world_size() -> None:
    pytest.importorskip("torch")
    _torch_group_resizes(None)


@sky.function
def world() -> tuple[int, float, int]:
    """(world size, all-reduced 1.0, total_nodes) on each process of a torch group."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    if not dist.is_initialized():  # one process: the plugin forms no group
        return 1, float(t.item()), sky.instance_info().total_nodes
    dist.all_reduce(t)
    return dist.get_world_size(), float(t.item()), sky.instance_info().total_nodes


def _torch_group_resizes(provider: Provider | None) -> None:
    """A torch group pool of (1, 2) grows under queued calls and shrinks when idle, each
    time restarting its processes with the new world size."""
    options = sky.Options(autoscale_idle_timeout=5.0, autoscale_cooldown=0)
    plugins = [sky.plugins.torch()]
    with sky.Compute(provider, nodes=(1, 2), plugins=plugins, options=options) as pool:
        assert world() @ pool == [(1, 1.0, 1)]
        pool.map(slow, range(4))  # calls wait: the pool grows, between calls
        assert wait_until(lambda: pool.nodes == 2, timeout=120)
        assert world() @ pool == [(2, 2.0, 2), (2, 2.0, 2)]
        assert wait_until(lambda: pool.nodes == 1, timeout=120)  # idle: shrinks
        assert world() @ pool == [(1, 1.0, 1)]


def test_closing_while_nodes_are_still_joining_leaves_nothing(tmp_path: Path) -> None:
    provider = sky.Local(workdir=str(tmp_path))
    with sky.Compute(provider=provider, nodes=sky.Nodes(6, min=1)) as pool:
        assert len(place() @ pool) >= 1  # the others are starting or joining
    assert wait_until(lambda: not processes_in(tmp_path), timeout=20), processes_in(tmp_path)
    assert not list(tmp_path.iterdir())  # every node's folder removed


def test_a_lost_node_of_an_elastic_pool_is_replaced_at_its_rank() -> None:
    @sky.function
    def agent_pid() -> int:
        return os.getppid()

    with sky.Compute(nodes=sky.Nodes(2, max=3)) as pool:
        pids = agent_pid() @ pool
        os.kill(pids[1], 9)
        assert wait_until(lambda: (agent_pid() @ pool)[1] != pids[1], timeout=60)
        assert [s[:3] for s in place() @ pool] == [(0, 2, 2), (1, 2, 2)]


class _Fixed(Provider):
    """A provider without elastic allocations."""

    async def acquire(self, spec: PoolSpec) -> Allocation:
        raise AssertionError("never reached")


def test_a_provider_without_elastic_pools_refuses_them_before_acquiring() -> None:
    with pytest.raises(sky.ConfigurationError, match="fixed-size pools only"):
        sky.Compute(provider=_Fixed(), nodes=(1, 2)).open()
    assert Allocation.candidate is not None and Machine is not None


# -- SSH -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    with Lab() as lab:
        lab.add_hosts(4)
        yield lab


def _stop_sshd(lab: Lab, host: TestHost) -> None:
    lab.kill_all(host)
    if host.sshd is not None:
        host.sshd.wait(10)
    if host._log is not None:
        host._log.close()


def test_ssh_pool_opens_with_min_up_and_reaches_desired_when_hosts_come_back(
    lab: Lab, capfd: pytest.CaptureFixture[str]
) -> None:
    down = lab.hosts[:2]  # the first hosts: the ranks go to the hosts that answer
    for host in down:
        _stop_sshd(lab, host)
    with sky.Compute(provider=lab.provider(), nodes=sky.Nodes(4, min=2)) as pool:
        assert pool.nodes == 2
        seen = place() @ pool
        assert [s[:3] for s in seen] == [(0, 2, 2), (1, 2, 2)]
        assert {s[3] for s in seen} == {h.hostname for h in lab.hosts[2:]}
        for host in down:
            lab.start_sshd(host)
        assert wait_until(lambda: pool.nodes == 4, timeout=90)
        err = capfd.readouterr().err
        assert all(err.count(f"{h.addr}: cannot connect") == 1 for h in down), err  # once
        seen = place() @ pool
        assert [s[:3] for s in seen] == [(r, 4, 4) for r in range(4)]
        assert {s[3] for s in seen} == {h.hostname for h in lab.hosts}
    assert lab.wait_no_agents(timeout=10) == {}


def test_ssh_pool_that_cannot_reach_min_fails_naming_the_hosts_down(lab: Lab) -> None:
    down = lab.hosts[:2]
    for host in down:
        _stop_sshd(lab, host)
    try:
        provider = lab.provider(lab.hosts[:3])
        options = sky.Options(start_timeout=3.0)
        with (
            pytest.raises(sky.ProvisionError, match=r"1 of the 2 node\(s\)") as info,
            sky.Compute(provider=provider, nodes=sky.Nodes(3, min=2), options=options),
        ):
            pass
        assert all(f"{h.addr}: " in str(info.value) for h in down)  # each, with why
    finally:
        for host in down:
            lab.start_sshd(host)
    assert lab.wait_no_agents(timeout=10) == {}


def test_ssh_torch_group_restarts_with_the_new_world_size(lab: Lab) -> None:
    pytest.importorskip("torch")
    _torch_group_resizes(lab.provider(python=sys.executable))


def test_a_group_joins_a_node_between_back_to_back_calls(lab: Lab) -> None:
    """A torch group called in a tight loop still takes the node that comes up: new calls
    wait at a gate while those under way finish, then every process restarts."""
    pytest.importorskip("torch")
    down = lab.hosts[0]
    _stop_sshd(lab, down)
    provider = lab.provider(lab.hosts[:2], python=sys.executable)
    try:
        with sky.Compute(
            provider, nodes=sky.Nodes(2, min=1), plugins=[sky.plugins.torch()]
        ) as pool:
            assert world() @ pool == [(1, 1.0, 1)]
            lab.start_sshd(down)
            deadline = time.monotonic() + 120
            seen = world() @ pool
            while len(seen) < 2 and time.monotonic() < deadline:
                seen = world() @ pool  # back to back: no idle moment to wait for
            assert seen == [(2, 2.0, 2), (2, 2.0, 2)]
    finally:
        if down.sshd is None or down.sshd.poll() is not None:
            lab.start_sshd(down)


def test_ssh_pool_grows_under_map_and_shrinks_when_idle(lab: Lab) -> None:
    options = sky.Options(autoscale_idle_timeout=0.5, autoscale_cooldown=0)
    with sky.Compute(provider=lab.provider(), nodes=(1, 3), options=options) as pool:
        out = pool.map(slow, range(9))
        assert {node for node, _, _ in out} == {0, 1, 2}
        assert wait_until(lambda: pool.nodes == 1, timeout=30)
        assert [s[:3] for s in place() @ pool] == [(0, 1, 1)]
        assert wait_until(lambda: len(lab.agent_pids()) == 1, timeout=15)  # released: gone
    assert lab.wait_no_agents(timeout=10) == {}


def test_ssh_pool_born_empty_scales_to_zero_and_wakes(lab: Lab) -> None:
    """``Nodes(0, max=2, min=0)`` on SSH hosts: no agent before the first call, a burst on
    up to 2 hosts, no agent once idle, and the next broadcast starts one again."""
    options = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0)
    nodes = sky.Nodes(0, max=2, min=0)
    with sky.Compute(provider=lab.provider(), nodes=nodes, options=options) as pool:
        assert pool.current_nodes() == 0 and lab.agent_pids() == {}
        out = pool.map(where, range(40))
        assert [i for i, _, _ in out] == list(range(40))
        assert {node for _, node, _ in out} <= {0, 1}
        assert wait_until(lambda: pool.current_nodes() == 0, timeout=60)
        assert lab.wait_no_agents(timeout=30) == {}
        assert [s[:3] for s in place() @ pool] == [(0, 1, 1)]
    assert lab.wait_no_agents(timeout=10) == {}


def test_ssh_starts_retry_with_backoff_when_sshd_drops_connections(lab: Lab) -> None:
    """An sshd that drops unauthenticated connections beyond two (``MaxStartups 2``):
    eight nodes on it start all the same (paced, and dropped attempts are tried again)."""
    host = lab.hosts[-1]
    _stop_sshd(lab, host)
    config = host.folder / "sshd_config"
    text = config.read_text().replace("MaxStartups 64", "MaxStartups 2")
    config.write_text(text)
    lab.start_daemon(
        host,
        "mount -t tmpfs -o size=512m,mode=1777 tmpfs /dev/shm && "
        f"exec /usr/sbin/sshd -D -e -f {config}",
        "sshd.log",
    )
    assert wait_until(lambda: _listening(host.addr), timeout=10)
    try:
        provider = lab.provider([host] * 8)
        with sky.Compute(provider=provider, nodes=8) as pool:
            assert len(place() @ pool) == 8
        log = (host.folder / "sshd.log").read_text(errors="replace")
        assert "drop connection" in log or "MaxStartups" in log  # it did drop some
    finally:
        _stop_sshd(lab, host)
        config.write_text(text.replace("MaxStartups 2", "MaxStartups 64"))
        lab.start_sshd(host)


def _listening(addr: str) -> bool:
    try:
        with socket.create_connection((addr, 22), 0.2):
            return True
    except OSError:
        return False
