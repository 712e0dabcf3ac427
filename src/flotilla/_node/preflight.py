"""Rendezvous pre-flight: before the plugins of a group pool initialise their collective,
every node checks that it reaches the head's rendezvous address and port.

The head's first process listens on ``head_port`` briefly (until every other node has
connected, or :data:`PREFLIGHT_TIMEOUT`); the first process of every other node connects.
A node that cannot connect reports at once (no route, refused past the deadline, timed
out), naming itself, the address:port and the likely fixes, instead of the plugin waiting
for the whole start timeout and every node being blamed alike. When the network is fine
this costs one connection per node. Standard library only.
"""

from __future__ import annotations

import errno
import socket
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PREFLIGHT_TIMEOUT = 10.0
"""Seconds the head listens, and a node keeps trying while the head is not listening yet."""
_RETRY = 0.05
_FATAL = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL}
"""Connection errors that waiting will not cure: reported at once."""


def preflight(info: dict[str, Any], timeout: float = PREFLIGHT_TIMEOUT) -> str:
    """Run this process's part of the check (``info``: its COMPUTE_POOL); '' when fine,
    else the error to report."""
    first = info.get("local_rank", 0) == 0 and info.get("worker", 0) == 0  # its first slot
    if not first or info.get("total_nodes", 1) < 2:
        return ""
    if info.get("is_head"):
        _listen(int(info["head_port"]), int(info["total_nodes"]) - 1, timeout)
        return ""
    return _reach(info, timeout)


def _listen(port: int, expected: int, timeout: float) -> None:
    """Accept ``expected`` connections on ``port`` (or until ``timeout``); a port already
    taken means something listens there: the nodes will find it."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind(("", port))
        except OSError:
            return
        server.listen(max(expected, 1))
        accepted = 0
        while accepted < expected:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()
            accepted += 1


def _reach(info: dict[str, Any], timeout: float) -> str:
    addr, port = str(info["head_addr"]), int(info["head_port"])
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, timeout)):
                return ""
        except OSError as e:
            last = e
            if e.errno in _FATAL:
                break
            time.sleep(_RETRY)
    where = f"node {info.get('node')} ({info.get('addr') or '?'})"
    why = last.strerror if last is not None and last.strerror else str(last or "timed out")
    return (
        f"{where} cannot reach the head's rendezvous address {addr}:{port} ({why}); "
        "the group's collective could not form. Likely fixes: allow TCP to that port from "
        "this node (firewall rules, the cloud's security group), or make the nodes use an "
        "address and interface they share (the head's address must be routable from here)"
    )
