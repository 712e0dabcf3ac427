"""Re-attaching a client to a running agent (a named cluster's, whose daemon died).

A cluster's agents are configured with ``reattach_grace`` seconds and a ``reattach_key``
(a secret of the pool, kept in the cluster's private record). Such an agent listens on an
abstract UNIX socket (:class:`Listener`; its name is in every task's environment as
``FLOTILLA_AGENT_ADDRESS``, so the cluster's record has it). When its client goes away it
keeps running for ``reattach_grace`` seconds, holding what it would have sent, and accepts
one new client there; past the grace it ends as it does today, killing everything it
started. A ``Compute`` pool has no grace: its agents end with their input.

The connection is authenticated both ways before any frame passes (:func:`serve_handshake`
and :func:`client_handshake`: HMAC-SHA256 of each side's nonce under the key; the key
itself never travels), and only a process of this agent's user may connect (the peer's
uid, as the daemon's socket checks it).

``python -m flotilla._node.reattach ADDRESS`` is the client's end on the node
(:func:`bridge`): it reads the key as the first line of its stdin (over the provider's own
authenticated channel: a pipe, an SSH session), does the handshake and then copies bytes
between its stdin/stdout and the agent, so the client speaks the protocol to it as to an
agent it started.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import sys

ADDRESS_VAR = "FLOTILLA_AGENT_ADDRESS"
"""In every task's environment: the name of its agent's re-attach socket."""
_NONCE = 32
_ATTACH, _PROBE = b"a", b"p"
_HANDSHAKE_TIMEOUT = 10.0


def _mac(key: bytes, who: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, who + nonce, hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        data += chunk
    return data


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a UNIX socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


class Listener:
    """The agent's re-attach socket (abstract: nothing on disk; gone with the agent)."""

    def __init__(self) -> None:
        self.name = f"flotilla-agent-{os.getpid()}-{os.urandom(8).hex()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.name)
        self.sock.listen(4)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self, key: bytes) -> socket.socket | None:
        """A new client, authenticated (None: none waiting, another user's, it failed the
        handshake, or it only asked whether this agent is there: a probe)."""
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return None
        try:
            if peer_uid(conn) != os.geteuid():
                raise PermissionError("a process of another user")
            conn.setblocking(True)
            conn.settimeout(_HANDSHAKE_TIMEOUT)
            attach = serve_handshake(conn, key)
            conn.settimeout(None)
        except (OSError, ValueError) as e:
            print(f"flotilla agent: refused a re-attach: {e}", file=sys.stderr, flush=True)
            conn.close()
            return None
        if not attach:
            conn.close()
            return None
        return conn

    def close(self) -> None:
        self.sock.close()


def serve_handshake(conn: socket.socket, key: bytes) -> bool:
    """The agent's side: its nonce; the client's nonce and proof; its own proof; then
    whether the client attaches (True) or only probed."""
    mine = os.urandom(_NONCE)
    conn.sendall(mine)
    theirs = _read_exactly(conn, _NONCE)
    proof = _read_exactly(conn, 32)
    if not hmac.compare_digest(proof, _mac(key, b"client", mine)):
        raise ValueError("wrong key")
    conn.sendall(_mac(key, b"agent", theirs))
    return _read_exactly(conn, 1) == _ATTACH


def client_handshake(conn: socket.socket, key: bytes, attach: bool = True) -> None:
    """The client's side of :func:`serve_handshake`."""
    agents = _read_exactly(conn, _NONCE)
    mine = os.urandom(_NONCE)
    conn.sendall(mine + _mac(key, b"client", agents))
    proof = _read_exactly(conn, 32)
    if not hmac.compare_digest(proof, _mac(key, b"agent", mine)):
        raise ValueError("the agent does not hold the cluster's key")
    conn.sendall(_ATTACH if attach else _PROBE)


def bridge(address: str, probe: bool = False) -> int:
    """Connect this process's stdin/stdout to the agent at ``address`` (see the module
    docstring); the exit status says why it ended (3: no such agent, 4: refused).
    ``probe``: only check that the agent is there and holds the key (exit status 0)."""
    key_line = b""
    while not key_line.endswith(b"\n"):
        chunk = os.read(0, 1)
        if not chunk:
            return 4
        key_line += chunk
    key = bytes.fromhex(key_line.decode().strip())
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect("\0" + address)
    except OSError as e:
        print(f"no agent at {address}: {e}", file=sys.stderr, flush=True)
        return 3
    try:
        if peer_uid(conn) != os.geteuid():
            raise PermissionError("the socket belongs to another user")
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        client_handshake(conn, key, attach=not probe)
        conn.settimeout(None)
    except (OSError, ValueError) as e:
        print(f"the agent at {address} refused the re-attach: {e}", file=sys.stderr, flush=True)
        return 4
    if probe:
        return 0
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(conn, selectors.EVENT_READ)
    while True:
        for key_, _ in sel.select():
            if key_.fileobj == 0:
                data = os.read(0, 1 << 16)
                if not data:  # the client is gone: so is this end; the agent waits again
                    return 0
                conn.sendall(data)
            else:
                data = conn.recv(1 << 16)
                if not data:  # the agent ended
                    return 0
                view = memoryview(data)
                while view:
                    view = view[os.write(1, view) :]


if __name__ == "__main__":
    sys.exit(bridge(sys.argv[1], "--probe" in sys.argv[2:]))
