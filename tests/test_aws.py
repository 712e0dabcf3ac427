"""The AWS provider against a real EC2 API (moto in server mode) and booting instances
(namespace hosts configured from the instances' user-data): see ``_aws.py``."""

from __future__ import annotations

import os
from typing import Any

from _aws import REGION, ZONES, AwsLab, aws_lab_fixture  # noqa: F401

import flotilla as sky
from flotilla._providers.base import Options, PoolSpec


@sky.function
def where() -> dict[str, Any]:
    info = sky.instance_info()
    return {
        "node": info.node,
        "addr": info.addr,
        "head_addr": info.head_addr,
        "peers": [p.addr for p in info.peers],
    }


@sky.function
def fail() -> None:
    raise ValueError("boom")


def _gone(lab: AwsLab, pool_id: str) -> None:
    """Nothing of the pool is left: instances terminated, group and key folder gone."""
    states = {i["InstanceId"]: i["State"]["Name"] for i in lab.pool_instances(pool_id)}
    assert states and set(states.values()) == {"terminated"}, states
    assert lab.pool_groups(pool_id) == []
    import glob
    import tempfile

    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-aws-{pool_id}-*")) == []
    for ident in states:
        assert lab.host_of(ident) is None, f"{ident}'s host still runs"


def _spec(nodes: int, **kwargs: Any) -> PoolSpec:
    return PoolSpec("t" + os.urandom(3).hex(), nodes, None, None, (), Options(), **kwargs)


def test_three_node_spot_pool(aws_lab: AwsLab) -> None:
    provider = aws_lab.provider(allocation="spot", tags={"team": "ml"})
    with sky.Compute(provider=provider, nodes=3) as pool:
        got = where() @ pool
        pool_id = pool.pool_id
        instances = sorted(aws_lab.pool_instances(pool_id), key=lambda i: i["AmiLaunchIndex"])
        addrs = [i["PrivateIpAddress"] for i in instances]
        assert [g["node"] for g in got] == [0, 1, 2]
        assert [g["addr"] for g in got] == addrs
        assert all(g["peers"] == addrs and g["head_addr"] == addrs[0] for g in got)
        for inst in instances:
            assert inst["InstanceLifecycle"] == "spot"
            tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
            assert tags["flotilla:pool"] == pool_id and tags["team"] == "ml"
            assert tags["flotilla:client"].split(":")[1] == str(os.getpid())
            assert "flotilla:created" in tags and "flotilla:owner" in tags
        (group,) = aws_lab.pool_groups(pool_id)
        rules = group["IpPermissions"]
        ssh = [r for r in rules if r.get("FromPort") == 22]
        # private_ips=True: SSH from the VPC's address ranges (the client is inside)
        vpc_ranges = {"172.31.0.0/16", f"{aws_lab.lab.subnet}.0/24"}
        assert {r["CidrIp"] for r in ssh[0]["IpRanges"]} == vpc_ranges
        members = [r for r in rules if r["IpProtocol"] == "-1"]
        assert members[0]["UserIdGroupPairs"][0]["GroupId"] == group["GroupId"]
        assert len(rules) == 2
    _gone(aws_lab, pool_id)
