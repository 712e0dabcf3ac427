"""Elastic pools on AWS (the moto EC2 lab, instances that boot as namespace hosts: see
``_aws.py``): an instance is launched per node added and terminated per node released; a
pool born empty launches nothing before its first call, and one that scales to zero
terminates every instance (its bill stops). The instances are counted in the emulator."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from _aws import AwsLab, aws_lab_fixture, aws_shared_lab_fixture  # noqa: F401

import flotilla as sky
from flotilla import events

BILLED = ("pending", "running", "stopping", "stopped")
"""Instance states EC2 bills (for the instance, or its disk): not shutting-down or
terminated."""


@sky.function
def slow_addr(i: int) -> tuple[int, str]:
    time.sleep(0.05)
    return i, sky.instance_info().addr


def _billed(lab: AwsLab, pool_id: str) -> list[str]:
    """The pool's instances EC2 still bills, by id."""
    return sorted(
        i["InstanceId"] for i in lab.pool_instances(pool_id) if i["State"]["Name"] in BILLED
    )


def _until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` (which asks the emulator: every 0.2 s) until true or ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _gone(lab: AwsLab, pool_id: str) -> None:
    launched = lab.pool_instances(pool_id)
    assert launched and {i["State"]["Name"] for i in launched} == {"terminated"}
    assert lab.pool_groups(pool_id) == []
    for inst in launched:
        assert lab.wait_ended(inst["InstanceId"]), inst["InstanceId"]


def test_an_aws_pool_born_empty_bursts_on_up_to_4_instances_and_scales_to_zero(
    aws_lab: AwsLab,
) -> None:
    """``Nodes(0, max=4, min=0)`` on EC2: no instance before the first call (lazy start);
    a burst of 200 calls runs on at most 4 instances at once (launched as the autoscaler
    decided, never above 4); idle, every instance is terminated (nothing billed) and its
    host ends; the next call launches one instance again."""
    options = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0, start_timeout=300)
    provider = aws_lab.provider(allocation="on-demand")
    nodes = sky.Nodes(0, max=4, min=0)
    decisions: list[events.ScalingDecision] = []
    with sky.Compute(provider=provider, nodes=nodes, options=options) as pool:
        pool.subscribe(
            on_event=lambda e: decisions.append(e) if isinstance(e, events.ScalingDecision) else 0
        )
        pool_id = pool.pool_id
        assert pool.current_nodes() == 0
        assert aws_lab.pool_instances(pool_id) == []  # nothing launched yet
        assert len(aws_lab.pool_groups(pool_id)) == 1  # the rest is ready: the call launches
        peak = [0]
        done = threading.Event()

        def count() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], len(_billed(aws_lab, pool_id)))
                done.wait(0.2)

        counter = threading.Thread(target=count)
        counter.start()
        try:
            out = pool.map(slow_addr, range(200))
        finally:
            done.set()
            counter.join()
        assert [i for i, _ in out] == list(range(200))
        launched = aws_lab.pool_instances(pool_id)
        assert 1 <= peak[0] <= 4, peak[0]
        assert {a for _, a in out} <= {i["PrivateIpAddress"] for i in launched}
        assert decisions and all(d.to_nodes <= 4 for d in decisions), decisions
        assert decisions[0].from_nodes == 0 and "queued" in decisions[0].reason
        # scale to zero: every instance terminated, its host ended
        assert _until(lambda: pool.current_nodes() == 0, timeout=120)
        assert _until(lambda: _billed(aws_lab, pool_id) == [], timeout=120)
        for inst in launched:
            assert aws_lab.wait_ended(inst["InstanceId"]), inst["InstanceId"]
        assert decisions[-1].to_nodes == 0 and "idle" in decisions[-1].reason
        # the next call launches one instance
        assert (slow_addr(7) >> pool)[0] == 7
        assert len(_billed(aws_lab, pool_id)) == 1
        assert len(aws_lab.pool_instances(pool_id)) == len(launched) + 1
    _gone(aws_lab, pool_id)


def test_an_aws_pool_grows_past_a_capacity_error_and_shrinks_one_instance_at_a_time(
    aws_lab: AwsLab, capfd: pytest.CaptureFixture[str]
) -> None:
    """``Nodes(1, max=3)``: ``resize(3)`` meets no capacity (RunInstances refused in every
    zone): the pool says so and goes on serving on its one instance; once EC2 has room
    it has 3 instances; ``resize(1)`` terminates the last two, last rank first, one at a
    time, and keeps rank 0's instance."""
    options = sky.Options(autoscale_idle_timeout=600, autoscale_cooldown=0, start_timeout=300)
    provider = aws_lab.provider(allocation="on-demand")
    err = ""

    def said(text: str) -> Callable[[], bool]:
        def check() -> bool:
            nonlocal err
            err += capfd.readouterr().err
            return text in err

        return check

    try:
        with sky.Compute(provider=provider, nodes=sky.Nodes(1, max=3), options=options) as pool:
            pool_id = pool.pool_id
            (first,) = _billed(aws_lab, pool_id)
            head = aws_lab.describe(InstanceIds=[first])[0]["PrivateIpAddress"]
            aws_lab.fail_launches("InsufficientInstanceCapacity")  # every zone and market
            pool.resize(3)
            assert _until(said("the pool could not grow (no capacity for 1 x"), timeout=120), err
            assert slow_addr(1) >> pool == (1, head)  # it works meanwhile, on its instance
            assert pool.current_nodes() == 1 and _billed(aws_lab, pool_id) == [first]
            aws_lab.clear_faults()
            assert _until(lambda: pool.current_nodes() == 3, timeout=300)
            grown = _billed(aws_lab, pool_id)
            assert len(grown) == 3 and first in grown
            assert len({addr for _, addr in slow_addr(0) @ pool}) == 3
            pool.resize(1)
            assert _until(lambda: _billed(aws_lab, pool_id) == [first], timeout=120)
            assert pool.current_nodes() == 1
            assert _until(said("released: the pool has 1 node(s)"), timeout=30), err
            released = [line for line in err.splitlines() if " released: " in line]
            assert [line.split(" released")[0].split("flotilla: ")[1][:6] for line in released] == [
                "node 2",
                "node 1",
            ]
            assert slow_addr(2) >> pool == (2, head)
    finally:
        aws_lab.clear_faults()
    _gone(aws_lab, pool_id)


def test_an_elastic_pool_cannot_be_a_stoppable_one(aws_lab: AwsLab, tmp_path: Any) -> None:
    from flotilla._providers.aws.kept import Keep

    provider = aws_lab.provider()
    provider.keep = Keep(tmp_path)
    with pytest.raises(sky.ConfigurationError, match="cannot be a stoppable one"):
        sky.Compute(provider=provider, nodes=(1, 2)).open()


def test_an_aws_pool_scaled_to_zero_costs_nothing_by_its_price_table(
    aws_lab: AwsLab, capfd: pytest.CaptureFixture[str]
) -> None:
    """``Nodes(0, max=2, min=0)`` on spot: the pool's running cost (``hourly``, by the spot
    price its launch line shows, from the emulator's spot price history) is 0 before the
    first call, one or two instances' price while its calls run, and 0 again once the idle
    timeout scaled it to zero (no instance billed)."""
    import re

    options = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0, start_timeout=300)
    provider = aws_lab.provider(allocation="spot")
    with sky.Compute(provider=provider, nodes=sky.Nodes(0, max=2, min=0), options=options) as pool:
        line = next(ln for ln in capfd.readouterr().err.splitlines() if "flotilla: AWS " in ln)
        found = re.search(r", spot \$([0-9.e-]+)/h", line)
        assert found is not None, line
        price = float(found.group(1))
        allocation: Any = pool._allocation
        assert price > 0 and allocation.hourly == 0
        costs: list[float] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                costs.append(allocation.hourly)
                done.wait(0.1)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            out = pool.map(slow_addr, range(40))
        finally:
            done.set()
            sampler.join()
        assert [i for i, _ in out] == list(range(40))
        peak = max(costs, default=0.0)
        assert any(peak == pytest.approx(k * price, rel=1e-3) for k in (1, 2)), (peak, price)
        assert _until(lambda: pool.current_nodes() == 0, timeout=120)
        assert _until(lambda: _billed(aws_lab, pool.pool_id) == [], timeout=120)
        assert allocation.hourly == 0
    _gone(aws_lab, pool.pool_id)
