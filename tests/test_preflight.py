"""Rendezvous pre-flight on the SSH namespace lab: a node whose route to the head is made
unreachable fails the start at once, naming itself, the head's address:port and the fixes
(not after the start timeout, not blaming every node)."""

from __future__ import annotations

import sys

import pytest
from _hosts import Lab, run, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture

import flotilla as sky

pytest.importorskip("torch")


@sky.function
def rank() -> int:
    return sky.instance_info().node


def test_a_node_that_cannot_reach_the_head_is_named_at_once(ssh_lab: Lab) -> None:
    hosts = ssh_lab.hosts[:3]
    head, cut = hosts[0], hosts[2]
    run("ip", "-n", cut.netns, "route", "add", "unreachable", f"{head.addr}/32")
    try:
        options = sky.Options(start_timeout=600)  # the error must not wait for this
        provider = ssh_lab.provider(hosts, python=sys.executable)  # the one with torch
        with (
            pytest.raises(sky.ProvisionError) as info,
            sky.Compute(provider=provider, nodes=3, plugins=[sky.plugins.torch()], options=options),
        ):
            pass
        message = str(info.value)
        assert (
            f"node 2 ({cut.addr}) cannot reach the head's rendezvous address {head.addr}:"
            in message
        )
        assert "firewall" in message and "security group" in message
        assert "node 1" not in message.split("cannot reach")[0]
    finally:
        run("ip", "-n", cut.netns, "route", "del", "unreachable", f"{head.addr}/32", check=False)
    assert ssh_lab.wait_no_agents(hosts, timeout=10.0) == {}


def test_the_preflight_passes_when_the_network_is_fine(ssh_lab: Lab) -> None:
    provider = ssh_lab.provider(ssh_lab.hosts[:2], python=sys.executable)
    with sky.Compute(provider=provider, nodes=2, plugins=[sky.plugins.torch()]) as pool:
        assert rank() @ pool == [0, 1]
