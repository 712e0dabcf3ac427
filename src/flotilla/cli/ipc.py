"""The cluster daemon's protocol: JSON objects, one per line, over its Unix socket.

The client sends one request and reads events until the daemon closes the connection::

    {"op": "ping"}                                  -> {"ev": "pong", ...}
    {"op": "submit", "job": {...}, "attach": true}  -> {"ev": "accepted", "job": 3, ...},
                                                       then (attached) the job's events
    {"op": "follow", "job": 3, "node": null}        -> the job's log so far, then its events
    {"op": "cancel", "job": 3}                      -> {"ev": "cancelled", ...}
    {"op": "down"}                                  -> {"ev": "down"} once everything stopped

Job events: {"ev": "out", "node": K, "rank": R, "stream": 1|2, "line": "..."},
{"ev": "bar", ...the same fields} (a line redrawn with \\r: what it shows now),
{"ev": "phase", "text": "..."}, {"ev": "end", "status": "...", "exit_code": N,
"report": [lines]}. Errors: {"ev": "error", "message": "..."}.

The socket sits in the cluster's private folder and the daemon serves only connections
whose peer credentials (``SO_PEERCRED``) are its own user's: secrets travel in ``submit``.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._client.console import prefix as prefix  # node lines: one format, the API's too

Event = dict[str, Any]


def encode(obj: Event) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def connect(path: Path) -> socket.socket:
    """A connection to the daemon listening at ``path`` (OSError when there is none)."""
    from .._system.private import socket_address

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with socket_address(path) as address:  # a socket in a folder we verified
            sock.connect(address)
    except OSError:
        sock.close()
        raise
    return sock


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket connection."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def events(sock: socket.socket) -> Iterator[Event]:
    """The JSON objects the other side sends, until it closes the connection."""
    with sock.makefile("rb") as f:
        for raw in f:
            if raw.strip():
                yield json.loads(raw)


def request(path: Path, obj: Event) -> Iterator[Event]:
    """Send one request; yield the daemon's answers."""
    sock = connect(path)
    try:
        sock.sendall(encode(obj))
        yield from events(sock)
    finally:
        sock.close()


def node_name(node: int, rank: int) -> str:
    """A node in messages: ``node-1 (rank=1)``."""
    return f"node-{node} (rank={rank})"
