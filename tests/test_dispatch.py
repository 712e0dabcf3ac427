"""The dispatcher's policy, call by call, on the in-process fake provider (tests/_fake.py):
least-busy choice, batch spreading, retries, group restarts, and the replacement of lost
nodes. The real Compute, dispatcher and node handles run; no agent is forked."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import CancelledError
from typing import Any

import pytest
from _fake import DIE, HANG, LOSE, FakeCall, FakeProvider
from _procs import wait_until

import flotilla as sky
from flotilla._client import dispatch
from flotilla._client.loop import get_loop
from flotilla._errors import ProvisionCause, ProvisionError
from flotilla._providers.base import AllocationState, MachineState


@sky.function
def work(x: int = 0) -> int:
    return x


@sky.function
def block() -> None:
    """Hangs on the fake (a handler says so)."""


@sky.function(retries=1)
def block_retried() -> None:
    """Hangs on the fake; re-run once if its node is lost."""


@sky.function(retries=1)
def flaky() -> str:
    return "ok"


@sky.function
def fragile() -> str:
    return "ok"


class Group:
    """A plugin whose processes form one group (as torch's do)."""

    forms_group = True

    def around_process(self, info: sky.InstanceInfo) -> None:
        return None


def rank_of(call: FakeCall) -> int:
    return call.rank


@pytest.fixture
def fake() -> FakeProvider:
    provider = FakeProvider()
    provider.on("work", rank_of)
    provider.on("block", lambda call: HANG)
    provider.on("block_retried", lambda call: HANG if call.attempt == 1 else call.rank)
    return provider


@pytest.fixture
def pool(fake: FakeProvider) -> Iterator[sky.Compute]:
    with sky.Compute(provider=fake, nodes=3) as p:
        yield p


def ranks_of(fake: FakeProvider, name: str) -> list[int]:
    return [c.rank for c in fake.calls if c.name == name]


# -- where calls go ----------------------------------------------------------------------


def test_a_single_call_goes_to_the_least_busy_node_ties_to_the_lowest_rank(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    assert [work() >> pool for _ in range(3)] == [0, 0, 0]  # idle nodes: rank 0 stays warm
    held = [block() > pool, block() > pool]  # rank 0, then rank 1 (rank 0 is busy)
    assert ranks_of(fake, "block") == [0, 1]
    assert work() >> pool == 2  # the only idle node
    held.append(block() > pool)  # rank 2 again
    held.append(block() > pool)  # every node has one call: the lowest rank
    assert ranks_of(fake, "block") == [0, 1, 2, 0]
    pool.cancel(held)
    for f in held:
        with pytest.raises(CancelledError):
            f.result(timeout=10)


def test_a_batch_is_spread_by_counting_each_assignment(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    assert sorted(Counter(pool.map(work, range(6))).items()) == [(0, 2), (1, 2), (2, 2)]
    held = block() > pool  # rank 0 has one call in flight
    batch = pool.submit_group([work(i) for i in range(4)])
    assert sorted(Counter(ranks_of(fake, "work")[6:]).items()) == [(0, 1), (1, 2), (2, 1)]
    pool.cancel([held])  # the call queued behind it on rank 0 runs
    assert sorted(batch.result(timeout=10)) == [0, 1, 1, 2]


def test_a_broadcast_runs_once_on_every_node_in_rank_order(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    assert work() @ pool == [0, 1, 2]
    assert pool.submit_broadcast(work(), nodes=[2])[0].result(timeout=10) == 2


# -- retries ---------------------------------------------------------------------------


def test_a_retried_call_runs_again_on_another_node_after_a_death(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    fake.on("flaky", lambda call: DIE if call.attempt == 1 else call.rank)
    assert flaky() >> pool == 1  # died on rank 0, ran again on rank 1
    assert ranks_of(fake, "flaky") == [0, 1]


def test_without_retries_a_death_is_a_worker_died_error(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    fake.on("fragile", lambda call: DIE)
    with pytest.raises(sky.WorkerDiedError, match=r"node 0 \(fake0\): the process running fragile"):
        fragile() >> pool
    assert len(ranks_of(fake, "fragile")) == 1


def test_a_user_error_is_not_retried(fake: FakeProvider, pool: sky.Compute) -> None:
    def bad(call: FakeCall) -> None:
        raise KeyError("user bug")

    fake.on("flaky", bad)
    with pytest.raises(KeyError, match="user bug"):
        flaky() >> pool
    assert len(ranks_of(fake, "flaky")) == 1


def test_a_retried_call_whose_node_is_lost_runs_again_elsewhere(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    fut = block_retried() > pool
    assert ranks_of(fake, "block_retried") == [0]
    fake.live[0].lose()
    assert fut.result(timeout=10) in (1, 2)  # another node (the replacement may be late)


# -- group pools -------------------------------------------------------------------------


@pytest.fixture
def quick_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The siblings of a failed call get no grace (the policy, not its timing, is tested)."""
    monkeypatch.setattr(dispatch, "STRAGGLER_GRACE", 0.0)


def test_one_rank_raising_restarts_the_group(fake: FakeProvider, quick_restarts: None) -> None:
    def one_raises(call: FakeCall) -> Any:
        if call.rank == 1:
            raise ValueError("bad batch")
        return HANG  # the others wait for rank 1 in a collective

    fake.on("block", one_raises)
    with sky.Compute(provider=fake, nodes=3, plugins=[Group()]) as pool:
        futures = pool.submit_broadcast(block())
        with pytest.raises(ValueError, match="bad batch"):
            futures[1].result(timeout=10)
        for f in (futures[0], futures[2]):
            with pytest.raises(sky.WorkerDiedError, match="all of them were restarted"):
                f.result(timeout=10)
        assert [a.restarts for a in fake.live] == [[1], [1], [1]]  # once, to every node
        assert work() @ pool == [0, 1, 2]


def test_a_broadcast_call_is_not_retried_alone_in_a_group(fake: FakeProvider) -> None:
    fake.on("flaky", lambda call: DIE if call.rank == 1 else HANG)
    with sky.Compute(provider=fake, nodes=2, plugins=[Group()]) as pool:
        futures = pool.submit_broadcast(flaky())
        with pytest.raises(sky.WorkerDiedError, match="killed by SIGKILL"):
            futures[1].result(timeout=10)
        with pytest.raises(sky.WorkerDiedError, match="restarted"):
            futures[0].result(timeout=10)
    assert len(ranks_of(fake, "flaky")) == 2  # no second attempt
    assert fake.agents[0].restarts == [1]


def test_an_error_on_every_rank_needs_no_restart(fake: FakeProvider) -> None:
    def always(call: FakeCall) -> None:
        raise ZeroDivisionError("everywhere")

    fake.on("fragile", always)
    with sky.Compute(provider=fake, nodes=2, plugins=[Group()]) as pool:
        with pytest.raises(ZeroDivisionError):
            fragile() @ pool
        assert work() @ pool == [0, 1]
    assert [a.restarts for a in fake.agents] == [[], []]


# -- lost nodes --------------------------------------------------------------------------


def test_a_lost_node_is_replaced_at_its_rank_with_updated_peers(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    before = list(fake.live)
    lost_machine = before[1].machine
    before[1].lose()
    assert work() @ pool == [0, 1, 2]  # waits for the replacement of rank 1
    after = fake.live
    assert after[0] is before[0] and after[2] is before[2] and after[1] is not before[1]
    assert [e for e in fake.events if e[0] == "replace"] == [
        ("replace", 1, "its agent was killed by SIGKILL")
    ]
    info = after[1].info
    assert info.node == 1 and info.total_nodes == 3
    assert info.addr == after[1].machine.address != lost_machine.address
    assert [p.addr for p in info.peers] == [a.machine.address for a in after]
    assert fake.allocation is not None
    states = fake.allocation.machine_states
    assert states[lost_machine.ident] is MachineState.RELEASED
    assert states[after[1].machine.ident] is MachineState.RUNNING


def test_calls_wait_for_a_node_being_replaced_or_go_elsewhere(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    fake.start_gate = gate = threading.Event()  # the provider is slow to start the new agent
    try:
        fake.live[0].lose()
        everywhere = pool.submit_broadcast(work())
        assert wait_until(lambda: ("replace", 0, "its agent was killed by SIGKILL") in fake.events)
        assert [work() >> pool for _ in range(2)] == [1, 1]  # single calls: the others
        assert everywhere[1].result(timeout=10) == 1 and everywhere[2].result(timeout=10) == 2
        assert not everywhere[0].done()  # rank 0's call waits for the new rank 0
    finally:
        gate.set()
    assert everywhere[0].result(timeout=10) == 0
    assert fake.calls[-1].agent is fake.live[0] is fake.agents[-1]


@pytest.mark.parametrize("nodes", [1, 2])
def test_calls_sent_to_a_dead_node_before_its_loss_is_noticed_wait_for_the_replacement(
    fake: FakeProvider, nodes: int
) -> None:
    with sky.Compute(provider=fake, nodes=nodes) as pool:
        dead = fake.live[-1]
        dead.lose(report=False)  # writes to it fail; the client has not seen its end yet
        everywhere = pool.submit_broadcast(work())
        single = work() > pool
        if nodes == 2:
            assert single.result(timeout=10) == 0  # the live node took it
        assert not everywhere[-1].done()  # it waits for the dead node's replacement
        dead.report_end()
        assert [f.result(timeout=10) for f in everywhere] == list(range(nodes))
        assert single.result(timeout=10) == 0
        assert fake.live[-1] is not dead


def test_a_retry_whose_only_node_died_meanwhile_waits_for_its_replacement(
    fake: FakeProvider,
) -> None:
    def die_with_the_agent(call: FakeCall) -> Any:
        if call.attempt == 1:
            call.agent.lose(report=False)  # the agent goes down with the process
            return DIE
        return call.rank

    fake.on("flaky", die_with_the_agent)
    with sky.Compute(provider=fake, nodes=1) as pool:
        fut = flaky() > pool
        assert not fut.done()  # the retry waits: its node refused it
        fake.agents[0].report_end()
        assert fut.result(timeout=10) == 0
        assert [c.agent for c in fake.calls] == fake.agents  # once on each agent


def test_a_call_with_retries_in_flight_on_a_lost_node_runs_again_on_its_replacement(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    first = list(fake.live)
    fake.on("block_retried", lambda call: HANG if call.agent in first else call.rank)
    futures = pool.submit_broadcast(block_retried())
    assert wait_until(lambda: all(a.hanging() for a in first))
    fake.live[1].lose()
    assert futures[1].result(timeout=10) == 1  # the replacement answered
    assert fake.calls[-1].agent is fake.live[1]
    for agent in fake.live[::2]:
        agent.answer(agent.hanging()[0], "done")
    assert [f.result(timeout=10) for f in futures] == ["done", 1, "done"]


def test_a_call_without_retries_on_a_lost_node_fails_naming_it(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    fake.on("fragile", lambda call: LOSE if call.rank == 2 else "fine")
    with pytest.raises(sky.NodeLostError, match=r"node 2 .*lost.*killed by SIGKILL") as info:
        fragile() @ pool
    assert info.value.node == 2
    fake.on("fragile", lambda call: "fine")
    assert fragile() @ pool == ["fine"] * 3  # and the pool carries on, whole


def test_in_a_group_pool_a_lost_node_restarts_every_process(fake: FakeProvider) -> None:
    with sky.Compute(provider=fake, nodes=3, plugins=[Group()]) as pool:
        first = list(fake.live)
        futures = pool.submit_broadcast(block())
        assert wait_until(lambda: all(a.hanging() for a in first))
        first[2].lose()
        with pytest.raises(sky.NodeLostError):
            futures[2].result(timeout=10)
        for f in futures[:2]:
            with pytest.raises(sky.WorkerDiedError, match="node 2 was lost"):
                f.result(timeout=10)
        assert work() @ pool == [0, 1, 2]
        assert not set(fake.live) & set(first)  # every rank has a new agent
        assert all(a.status is not None for a in first)  # the old ones were stopped
        assert [a.info.node for a in fake.live] == [0, 1, 2]


def test_with_replacement_off_the_pool_fails_naming_the_node(fake: FakeProvider) -> None:
    options = sky.Options(replace_lost_nodes=False)
    with sky.Compute(provider=fake, nodes=3, options=options) as pool:
        lost = fake.live[1]
        lost.lose()
        assert wait_until(lambda: pool._nodes[1].state.value == "lost")
        with pytest.raises(sky.PoolClosedError, match=r"cannot broadcast: node 1 .*SIGKILL"):
            work() @ pool
        assert work() >> pool == 0  # single calls still run on the others
    assert not [e for e in fake.events if e[0] == "replace"]


def test_a_node_that_cannot_be_replaced_is_gone_and_named(fake: FakeProvider) -> None:
    fake.no_spares = True
    with sky.Compute(provider=fake, nodes=2) as pool:
        fake.live[1].lose()
        with pytest.raises(sky.PoolClosedError, match=r"node 1 .*no machine to replace node 1"):
            work() @ pool
        assert work() >> pool == 0


def test_a_failed_replacement_is_logged_root_cause_first_whole_and_redacted(
    fake: FakeProvider, caplog: pytest.LogCaptureFixture
) -> None:
    """A replacement that fails with a chained, multi-line error: the log says the root
    cause first (the innermost error), then every error of the chain with all its lines
    (not only the first line of the outer one), the pool's secrets hidden."""
    secret = "hf_" + "x" * 20
    root = OSError(28, f"No space left on device (pulling with token {secret})")
    error = ProvisionError(
        "fake9: the executor failed to start:\n  installing torch\n"
        f"--- last lines of its stderr ---\nerror: HF_TOKEN={secret} rejected",
        cause=ProvisionCause.NODE,
    )
    error.__cause__ = root
    fake.replace_error = error
    image = sky.Image(env={"HF_TOKEN": secret})
    with (
        caplog.at_level(logging.WARNING, logger="flotilla"),
        sky.Compute(provider=fake, nodes=2, image=image) as pool,
    ):
        fake.live[1].lose()
        assert wait_until(lambda: any("replaced yet" in r.getMessage() for r in caplog.records))
        assert work() >> pool == 0
    (message,) = [r.getMessage() for r in caplog.records if "replaced yet" in r.getMessage()]
    assert secret not in message
    first, *rest = message.splitlines()
    assert first.startswith(
        "node 1 could not be replaced yet (OSError: [Errno 28] No space left on device "
        "(pulling with token ***)); trying again"
    ), first
    assert rest == [
        "  root cause: OSError: [Errno 28] No space left on device (pulling with token ***)",
        "  which caused: fake9: the executor failed to start:",
        "      installing torch",
        "    --- last lines of its stderr ---",
        "    error: HF_TOKEN=*** rejected",
    ], message


def test_closing_releases_the_allocation_and_fails_what_waits(fake: FakeProvider) -> None:
    fake.start_gate = gate = threading.Event()
    pool = sky.Compute(provider=fake, nodes=2)
    gate.set()
    pool.open()
    gate.clear()  # the replacement will hang in start_agent
    fake.live[1].lose()
    waiting = pool.submit_broadcast(work())
    assert wait_until(lambda: ("replace", 1, "its agent was killed by SIGKILL") in fake.events)
    pool.close()
    gate.set()
    with pytest.raises(sky.PoolClosedError, match="closed"):
        waiting[1].result(timeout=10)
    assert fake.allocation is not None and fake.allocation.state is AllocationState.RELEASED
    assert all(a.status is not None for a in fake.agents)


def test_a_machine_the_provider_reports_lost_is_replaced(
    fake: FakeProvider, pool: sky.Compute
) -> None:
    before = fake.live[2]
    assert fake.allocation is not None
    get_loop().call_soon_threadsafe(fake.allocation.report_lost, 2, "spot interruption")
    assert wait_until(lambda: before.status is not None)  # its agent is stopped
    assert work() @ pool == [0, 1, 2]
    assert fake.live[2] is not before
    reason = "the provider reports its machine lost: spot interruption"
    assert ("replace", 2, reason) in fake.events
