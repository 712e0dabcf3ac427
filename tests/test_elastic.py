"""Elastic pools (Skyward's ``Nodes(desired, min, max)``): open with ``min``, add the rest as
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

import pytest
from _hosts import Lab, TestHost, lab_unavailable
from _procs import assert_all_gone, processes_in, wait_until

import flotilla as sky
from flotilla._providers.base import Allocation, Machine, PoolSpec, Provider


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
    for bad in ((0, 2), (2, "3"), "2"):
        with pytest.raises(sky.ConfigurationError, match="nodes"):
            sky.Nodes.of(bad)


def test_a_pool_opens_with_min_and_grows_to_desired() -> None:
    with sky.Compute(nodes=sky.Nodes(3, min=1)) as pool:
        assert pool.nodes >= 1
        assert wait_until(lambda: pool.nodes == 3, timeout=60)
        seen = place() @ pool
        assert [s[:3] for s in seen] == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]


def test_a_pool_grows_under_map_and_shrinks_when_idle(capfd: pytest.CaptureFixture[str]) -> None:
    options = sky.Options(scale_down_after=0.5)
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
    assert "node 2 released, idle for 0.5 s: the pool has 2 node(s)" in err


def test_close_ends_the_pools_loop_when_it_is_cancelled_as_it_wakes() -> None:
    """The elastic pool's own loop is cancelled (by close) in the very step its wake-up
    event is set. On Python 3.11, ``asyncio.wait_for`` then returned normally and lost the
    cancellation: the loop ran on and the pool's close never returned (a full-run hang)."""
    from flotilla._client import loop

    with sky.Compute(nodes=(1, 2), options=sky.Options(scale_down_after=600)) as pool:
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
    with sky.Compute(nodes=(1, 2), options=sky.Options(scale_down_after=600)) as pool:
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
    options = sky.Options(scale_down_after=5.0)
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
    options = sky.Options(scale_down_after=0.5)
    with sky.Compute(provider=lab.provider(), nodes=(1, 3), options=options) as pool:
        out = pool.map(slow, range(9))
        assert {node for node, _, _ in out} == {0, 1, 2}
        assert wait_until(lambda: pool.nodes == 1, timeout=30)
        assert [s[:3] for s in place() @ pool] == [(0, 1, 1)]
        assert wait_until(lambda: len(lab.agent_pids()) == 1, timeout=15)  # released: gone
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
