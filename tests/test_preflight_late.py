"""Rendezvous pre-flight of a node that arrives late: the head answers the check for as long
as it lives, so a node that reaches it after the head's processes started their plugins (a
replacement that first built its environment, a node of a group restart) joins, and a node
that finds nothing there is still named. Local pools: real agents and executors."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import flotilla as sky
from flotilla._node.preflight import PORT_OFFSET, preflight

ENTERED = "head-entered"
HOLD = 120.0
"""Seconds a held node waits for the head at most (the test fails if it had to)."""


@sky.function
def rank() -> int:
    return sky.instance_info().node


class LateNode:
    """A plugin whose processes form one group, and whose unpickling (in each executor,
    before its pre-flight) holds every node but the head until the head's first process
    has entered its plugins, past its own start: the other node reaches the pre-flight
    late, as a replacement building its environment does."""

    forms_group = True

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        info = json.loads(os.environ.get("COMPUTE_POOL", "{}"))
        if info.get("node", 0) == 0:
            return
        entered = Path(self.folder, ENTERED)
        deadline = time.monotonic() + HOLD
        while not entered.exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # polls a file the head writes: the wait's condition
        if not entered.exists():
            Path(self.folder, "held-too-long").touch()

    def around_process(self, info: sky.InstanceInfo) -> None:
        if info.node == 0:
            Path(self.folder, ENTERED).touch()


def test_a_node_reaching_the_preflight_after_the_head_started_joins(tmp_path: Path) -> None:
    plugin = LateNode(str(tmp_path))
    with sky.Compute(nodes=2, plugins=[plugin]) as pool:  # type: ignore[list-item]
        assert rank() @ pool == [0, 1]
    assert (tmp_path / ENTERED).exists()
    assert not (tmp_path / "held-too-long").exists()


def test_a_node_that_finds_nothing_at_the_heads_port_is_named(tmp_path: Path) -> None:
    """A refusal that lasts (the head is gone, or a firewall rejects the port) fails the
    check, naming the node and the address:port."""
    import socket

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    info = {
        "node": 1,
        "addr": "127.0.0.2",
        "total_nodes": 2,
        "is_head": False,
        "head_addr": "127.0.0.1",
        "head_port": free - PORT_OFFSET,
    }
    message = preflight(info, timeout=0.5)
    assert f"node 1 (127.0.0.2) cannot reach the head's rendezvous address 127.0.0.1:{free}" in (
        message
    )
    assert "Connection refused" in message
