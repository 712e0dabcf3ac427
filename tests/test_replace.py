"""Lost nodes are replaced and the pool keeps its size: real agents killed with SIGKILL, on
the local provider and on SSH test hosts (a spare host takes the rank; without one the same
host is reconnected). Group pools are in test_groups.py; the policy in test_dispatch.py."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from _hosts import Lab, TestHost, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from _procs import alive, assert_all_gone, wait_until

import flotilla as sky
from flotilla._providers.ssh import SSHAllocation


@sky.function
def where() -> dict[str, object]:
    """What a node knows about itself, and its agent's pid (the executor's parent)."""
    info = sky.instance_info()
    return {
        "node": info.node,
        "addr": info.addr,
        "peers": [p.addr for p in info.peers],
        "agent": os.getppid(),
        "cwd": os.getcwd(),
    }


@sky.function(retries=1)
def mark_then_wait(folder: str) -> int:
    """Leave a file per attempt (node.pid), then wait for the go file; this node's rank."""
    import time

    node = sky.instance_info().node
    Path(folder, f"{node}.{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while not Path(folder, "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return node


def kill_agent(pool: sky.Compute, rank: int) -> None:
    """SIGKILL the agent of node ``rank`` and wait until the client noticed it."""
    node = pool._nodes[rank]
    os.kill(int(node.hello_info["pid"]), signal.SIGKILL)
    assert wait_until(lambda: pool._nodes[rank] is not node or node.state.value != "ready")


def attempts(folder: Path, node: int) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f"{node}."))


def in_flight_broadcast_survives_a_kill(pool: sky.Compute, folder: Path, rank: int) -> None:
    """A broadcast with retries=1 is running on every node; node ``rank``'s agent is
    killed; the broadcast still returns every rank, node ``rank``'s call run twice."""
    futures = pool.submit_broadcast(mark_then_wait(str(folder)))
    assert wait_until(lambda: all(attempts(folder, n) for n in range(pool.nodes)))
    kill_agent(pool, rank)
    assert wait_until(lambda: len(attempts(folder, rank)) == 2, timeout=30)
    (folder / "go").touch()
    assert [f.result(timeout=30) for f in futures] == list(range(pool.nodes))


# -- local ---------------------------------------------------------------------------------


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[sky.Compute]:
    with sky.Compute(sky.Local(workdir=str(tmp_path / "nodes")), nodes=3) as pool:
        yield pool


def test_a_killed_local_agent_is_replaced_at_its_rank(
    trio: sky.Compute, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = where() @ trio
    with caplog.at_level(logging.WARNING, logger="flotilla"):
        kill_agent(trio, 1)
        after = where() @ trio
    assert [i["node"] for i in after] == [0, 1, 2]
    assert after[0] == before[0] and after[2] == before[2]  # the others were left alone
    assert after[1]["agent"] != before[1]["agent"]  # a new process tree...
    assert after[1]["cwd"] != before[1]["cwd"]  # ...in a new work folder
    assert not os.path.exists(str(before[1]["cwd"]))  # the old one is gone
    assert after[1]["peers"] == ["127.0.0.1"] * 3
    messages = [r.getMessage() for r in caplog.records]
    assert "node 1 lost (its agent was killed by SIGKILL), replacing" in messages
    assert any(m.startswith("node 1 back after ") and m.endswith(" s") for m in messages)


def test_a_call_with_retries_runs_again_when_its_local_node_is_killed(
    trio: sky.Compute, tmp_path: Path
) -> None:
    folder = tmp_path / "marks"
    folder.mkdir()
    in_flight_broadcast_survives_a_kill(trio, folder, rank=2)
    assert [i["node"] for i in where() @ trio] == [0, 1, 2]


def test_single_calls_and_map_go_on_while_a_node_is_replaced(trio: sky.Compute) -> None:
    kill_agent(trio, 0)
    assert sorted(trio.map(sky.function(lambda x: x * 2), range(6))) == [0, 2, 4, 6, 8, 10]
    assert [i["node"] for i in where() @ trio] == [0, 1, 2]


def test_with_replacement_off_a_killed_node_fails_the_pool_clearly(tmp_path: Path) -> None:
    options = sky.Options(replace_lost_nodes=False)
    with sky.Compute(nodes=2, options=options) as pool:
        kill_agent(pool, 1)
        with pytest.raises(sky.PoolClosedError) as info:
            where() @ pool
        message = str(info.value)
        assert "node 1" in message and "killed by SIGKILL" in message
        assert "replace_lost_nodes" in message
        assert (where() >> pool)["node"] == 0  # the other node carries on


def test_nothing_of_a_replaced_node_outlives_the_pool(tmp_path: Path) -> None:
    nodes_dir = tmp_path / "nodes"
    with sky.Compute(sky.Local(workdir=str(nodes_dir)), nodes=2) as pool:
        kill_agent(pool, 1)
        agents = [int(i["agent"]) for i in where() @ pool]
    assert_all_gone(agents, timeout=10, what="agents, the replacement's included")
    assert list(nodes_dir.iterdir()) == []


# -- SSH test hosts --------------------------------------------------------------------------


def test_a_spare_ssh_host_takes_the_rank_of_a_killed_agent(ssh_lab: Lab, tmp_path: Path) -> None:
    spare = ssh_lab.add_host()
    hosts = [*ssh_lab.hosts[:3], spare]
    try:
        with sky.Compute(provider=ssh_lab.provider(hosts), nodes=3) as pool:
            before = where() @ pool
            assert [i["addr"] for i in before] == [h.addr for h in hosts[:3]]
            kill_agent(pool, 1)
            after = where() @ pool
            assert [i["node"] for i in after] == [0, 1, 2]
            assert after[1]["addr"] == spare.addr  # the spare took rank 1
            assert after[1]["peers"] == [hosts[0].addr, spare.addr, hosts[2].addr]
            assert after[0] == before[0] and after[2] == before[2]
        assert ssh_lab.wait_no_agents(hosts, timeout=5.0) == {}
    finally:
        ssh_lab.remove_host(spare)


def test_without_a_spare_the_same_ssh_host_is_reconnected(ssh_lab: Lab, tmp_path: Path) -> None:
    hosts = ssh_lab.hosts[:3]
    folder = ssh_lab.shared / f"marks-{tmp_path.name}"  # the hosts' and this machine's
    folder.mkdir()
    with sky.Compute(provider=ssh_lab.provider(hosts), nodes=3) as pool:
        before = where() @ pool
        kill_agent(pool, 0)
        after = where() @ pool
        assert [i["addr"] for i in after] == [h.addr for h in hosts]  # node 0 back on its host
        assert after[0]["agent"] != before[0]["agent"] and not alive(int(before[0]["agent"]))
        in_flight_broadcast_survives_a_kill(pool, folder, rank=1)
    assert ssh_lab.wait_no_agents(hosts, timeout=5.0) == {}


def test_a_spare_whose_agent_does_not_start_is_set_aside_for_the_next(
    ssh_lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    down, up = ssh_lab.add_host(), ssh_lab.add_host()
    hosts = [*ssh_lab.hosts[:3], down, up]
    try:
        with sky.Compute(provider=ssh_lab.provider(hosts), nodes=3) as pool:
            ssh_lab.kill_all(down)  # the first spare's sshd is gone: its connection is refused
            with caplog.at_level(logging.WARNING, logger="flotilla"):
                kill_agent(pool, 1)
                after = where() @ pool
            assert [i["node"] for i in after] == [0, 1, 2]
            assert [i["addr"] for i in after] == [hosts[0].addr, up.addr, hosts[2].addr]
            assert after[1]["peers"] == [hosts[0].addr, up.addr, hosts[2].addr]
            allocation = pool._allocation
            assert isinstance(allocation, SSHAllocation)
            assert list(allocation.unusable) == [f"root@{down.addr}:22"]
            assert "Connection refused" in allocation.unusable[f"root@{down.addr}:22"]
            messages = [r.getMessage() for r in caplog.records]
            assert any(
                m.startswith(f"spare host {down.addr} set aside: {down.addr}: cannot connect")
                and m.endswith(f"trying the next one, {up.addr}")
                for m in messages
            ), messages
            assert any(m.startswith("node 1 back after ") for m in messages)
        assert ssh_lab.wait_no_agents(hosts, timeout=5.0) == {}
    finally:
        ssh_lab.remove_host(down)
        ssh_lab.remove_host(up)


def test_when_no_host_can_take_the_rank_the_error_names_each_and_why(ssh_lab: Lab) -> None:
    """Broadcasts wait for the rank up to the start timeout while it is tried again, then
    fail naming the node and every host tried, with why."""
    lost, spare = ssh_lab.add_host(), ssh_lab.add_host()
    hosts = [ssh_lab.hosts[0], lost, spare]
    options = sky.Options(start_timeout=20)
    try:
        with sky.Compute(provider=ssh_lab.provider(hosts), nodes=2, options=options) as pool:
            ssh_lab.kill_all(spare)
            node = pool._nodes[1]
            ssh_lab.kill_all(lost)  # node 1's host: its sshd, session and agent
            assert wait_until(lambda: node.state.value != "ready")  # the client noticed
            with pytest.raises(sky.FlotillaError) as info:
                where() @ pool
            message = str(info.value)
            assert "node 1" in message
            assert "cannot take calls until it is back" in message
            assert "no host could take node 1: every spare failed, then the lost host too" in (
                message
            )
            assert f"{spare.addr}: cannot connect over SSH (port 22): Connection refused" in (
                message
            )
            assert f"{lost.addr}: cannot connect over SSH (port 22): Connection refused" in (
                message
            )
            assert (where() >> pool)["node"] == 0  # the other node carries on
        assert ssh_lab.wait_no_agents(hosts, timeout=5.0) == {}
    finally:
        ssh_lab.remove_host(lost)
        ssh_lab.remove_host(spare)


def _stop_sshd(lab: Lab, host: TestHost) -> None:
    """Stop the host's sshd with everything it started (the node's session and agent)."""
    lab.kill_all(host)
    if host.sshd is not None:
        host.sshd.wait(10)
    if host._log is not None:
        host._log.close()


def _replacement_failed(caplog: pytest.LogCaptureFixture) -> bool:
    return any("could not be replaced" in r.getMessage() for r in caplog.records)


def test_a_host_that_comes_back_is_taken_back_and_a_broadcast_waits_for_it(
    ssh_lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    host = ssh_lab.add_host()
    hosts = [ssh_lab.hosts[0], host]
    try:
        with sky.Compute(provider=ssh_lab.provider(hosts), nodes=2) as pool:
            before = where() @ pool
            with caplog.at_level(logging.WARNING, logger="flotilla"):
                _stop_sshd(ssh_lab, host)
                # the replacement is tried while the host is down, and fails
                assert wait_until(lambda: _replacement_failed(caplog), timeout=60)
                futures = pool.submit_broadcast(where())  # waits for node 1
                ssh_lab.start_sshd(host)
                after = [f.result(timeout=120) for f in futures]
            assert [i["addr"] for i in after] == [h.addr for h in hosts]
            assert after[1]["agent"] != before[1]["agent"]  # a new agent on the same host
            assert after[0] == before[0]
            assert [i["node"] for i in where() @ pool] == [0, 1]  # and it goes on serving
            messages = [r.getMessage() for r in caplog.records]
            tried = [m for m in messages if "could not be replaced yet" in m]
            assert len(tried) == 1, messages  # said once, not at every attempt
            assert tried[0].startswith("node 1 could not be replaced yet (") and (
                "Connection refused" in tried[0]
            )
            assert "trying again until it is back" in tried[0]
            assert any(m.startswith("node 1 back after ") for m in messages), messages
        assert ssh_lab.wait_no_agents(hosts, timeout=10.0) == {}
    finally:
        ssh_lab.remove_host(host)


def test_a_host_down_past_the_start_timeout_fails_broadcasts_then_serves_again(
    ssh_lab: Lab,
) -> None:
    host = ssh_lab.add_host()
    hosts = [ssh_lab.hosts[0], host]
    options = sky.Options(start_timeout=20)
    try:
        with sky.Compute(provider=ssh_lab.provider(hosts), nodes=2, options=options) as pool:
            node = pool._nodes[1]
            _stop_sshd(ssh_lab, host)
            assert wait_until(lambda: node.state.value != "ready")
            with pytest.raises(sky.PoolClosedError) as info:
                where() @ pool  # waits up to the start timeout, then fails naming node 1
            message = str(info.value)
            assert "node 1" in message and host.addr in message
            assert "cannot take calls until it is back" in message
            assert "Connection refused" in message
            with pytest.raises(sky.PoolClosedError, match="until it is back"):
                where() @ pool  # meanwhile: at once
            assert (where() >> pool)["node"] == 0  # single calls go to the other node
            ssh_lab.start_sshd(host)
            assert wait_until(
                lambda: pool._nodes[1] is not node and pool._nodes[1].state.value == "ready",
                timeout=120,
            )
            assert [i["addr"] for i in where() @ pool] == [h.addr for h in hosts]
        assert ssh_lab.wait_no_agents(hosts, timeout=10.0) == {}
    finally:
        ssh_lab.remove_host(host)
