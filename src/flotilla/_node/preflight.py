"""Rendezvous pre-flight: before the plugins of a group pool initialise their collective,
every node checks that it reaches the head's address on a port of the head's block.

The head's *agent* answers the check for its whole life (:func:`answer`): from its CONFIG
on, it accepts and closes every connection to ``head_port + PORT_OFFSET``, the last port of
the block its HELLO found free (``agent.PORT_BLOCK``; the plugins take the first ones and
the engines the middle). The first process of every other node connects (:func:`preflight`).
A node that cannot connect reports at once (no route, refused past the deadline, timed
out), naming itself, the address:port and the likely fixes, instead of the plugin waiting
for the whole start timeout and every node being blamed alike. When the network is fine
this costs one connection per node.

The answer lasts as long as the head does, not a window of the head's first process: a
node that arrives late (a replacement whose environment is built first, a node of a group
restart, a slow machine) finds it as the first ones do, whatever the plugins listen on
(Ray's and Dask's pools have nothing on ``head_port``). A refusal still fails the check
once :data:`PREFLIGHT_TIMEOUT` passed: the head is gone, or a firewall rejects the port
(iptables' ``REJECT`` refuses, as a closed port does). Standard library only.
"""

from __future__ import annotations

import _socket
import errno
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PREFLIGHT_TIMEOUT = 10.0
"""Seconds a node keeps trying while nothing answers at the head's port (the head's agent
has not read its CONFIG yet)."""
PORT_OFFSET = 63
"""The port the head's agent answers on: ``head_port + 63``, the last of its block of 64."""
_RETRY = 0.05
_FATAL = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL}
"""Connection errors that waiting will not cure: reported at once."""


def answer(head_port: int) -> Any:
    """The head's agent: a listening socket on ``head_port + PORT_OFFSET``, every address,
    IPv6 too where the node has it (its caller accepts and closes each connection:
    :func:`accept`); None when the port is taken (something listens there: the nodes find
    it) or cannot be bound. Until accepted, the kernel completes the nodes' connections
    itself (its backlog): an agent busy a moment still answers."""
    for family, host in ((_socket.AF_INET6, "::"), (_socket.AF_INET, "")):
        try:
            server = _socket.socket(family, _socket.SOCK_STREAM)
        except OSError:  # (no IPv6 on this node)
            continue
        try:
            if family == _socket.AF_INET6:  # IPv4 too
                server.setsockopt(_socket.IPPROTO_IPV6, _socket.IPV6_V6ONLY, 0)
            server.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            server.bind((host, head_port + PORT_OFFSET))
            server.listen(_socket.SOMAXCONN)
            server.setblocking(False)
        except OSError:
            server.close()
            continue
        return server
    return None


def accept(server: Any) -> None:
    """Accept the connections waiting on ``server`` (:func:`answer`'s) and close them."""
    while True:
        try:
            fd, _ = server._accept()
        except OSError:  # none left (EAGAIN), or one reset before it was taken
            return
        _socket.close(fd)


def preflight(info: dict[str, Any], timeout: float = PREFLIGHT_TIMEOUT) -> str:
    """Run this process's part of the check (``info``: its COMPUTE_POOL); '' when fine,
    else the error to report. The head's processes have nothing to do (its agent answers)."""
    first = info.get("local_rank", 0) == 0 and info.get("worker", 0) == 0  # its first slot
    if not first or info.get("total_nodes", 1) < 2 or info.get("is_head"):
        return ""
    return _reach(info, timeout)


def _reach(info: dict[str, Any], timeout: float) -> str:
    import socket

    addr, port = str(info["head_addr"]), int(info["head_port"])
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port + PORT_OFFSET), timeout=min(2.0, timeout)):
                return ""
        except OSError as e:
            last = e
            if e.errno in _FATAL:
                break
            time.sleep(_RETRY)
    where = f"node {info.get('node')} ({info.get('addr') or '?'})"
    why = last.strerror if last is not None and last.strerror else str(last or "timed out")
    return (
        f"{where} cannot reach the head's rendezvous address {addr}:{port + PORT_OFFSET} "
        f"({why}); the group's collective could not form. Likely fixes: allow TCP to the "
        f"head's ports {port}-{port + PORT_OFFSET} from this node (firewall rules, the "
        "cloud's security group), or make the nodes use an address and interface they "
        "share (the head's address must be routable from here)"
    )
