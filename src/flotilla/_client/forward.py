"""A port of a node reached from this machine through the pool's own channel.

:class:`PortForward` listens on ``127.0.0.1`` (a port the kernel picks) and relays each
connection to ``addr:port`` as seen from one node of the pool, through the shell the pool
starts its agents with (its ``RemoteShell``: ``ssh`` with the pool's key and pinned host
keys, ``srun`` into the pool's job, ``kubectl exec`` into its pod...): every connection
runs a small relay (standard library Python, the node's own interpreter) on the node, its
stdin and stdout carrying the bytes. So nothing is opened on the node beyond what already
listens there, and only this machine's loopback reaches the forward. Used by
``pool.dask_client()`` and ``pool.ray_dashboard()``.

The relays are this process's children (they die with it) and end with the forward
(:meth:`PortForward.close`, the pool closing); on the node a relay ends when its stdin does
(the channel closed) or when the port it reached closes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .._system.procs import die_with_parent

RELAY = r"""
import os, socket, sys, threading
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
except OSError as e:
    sys.exit(f"cannot connect to {sys.argv[1]}:{sys.argv[2]} on this node: {e}")
s.settimeout(None)
def up():
    while True:
        data = os.read(0, 65536)
        if not data:
            os._exit(0)  # the channel closed: the client side of this connection is gone
        s.sendall(data)
threading.Thread(target=up, daemon=True).start()
while True:
    data = s.recv(65536)
    if not data:
        os._exit(0)
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]
"""
"""The node's end of one connection: connect to ``argv[1]:argv[2]``, relay stdin/stdout."""
BUFFER = 65536
ERRORS_KEPT = 10


class PortForward:
    """``127.0.0.1:<local_port>`` on this machine relayed to ``addr:port`` on a node.

    Args:
        argv: the local command that runs a command (an argv) on the node with its stdio
            relayed (the pool's ``RemoteShell.argv`` for that node's machine).
        env: the environment of that command here (None: this process's).
        python: the node's interpreter (the one its agent runs).
        addr, port: what to reach, as the node sees it.
    """

    def __init__(
        self,
        argv: Callable[[list[str]], list[str]],
        env: Mapping[str, str] | None,
        python: str,
        addr: str,
        port: int,
    ) -> None:
        self.command: list[str] = list(argv([python, "-c", RELAY, addr, str(port)]))
        self.env = dict(env) if env is not None else None
        self.target = f"{addr}:{port}"
        self.errors: deque[str] = deque(maxlen=ERRORS_KEPT)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.local_port = int(self._listener.getsockname()[1])
        self._accepting = threading.Thread(target=self._accept, name="port forward", daemon=True)
        self._accepting.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.local_port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                self._relay(conn)
            except OSError as e:
                self.errors.append(f"cannot run {self.command[0]}: {e}")
                conn.close()

    def _relay(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            proc = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self.env,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL, None),
            )
            self._procs = [p for p in self._procs if p.poll() is None] + [proc]
        threading.Thread(target=self._to_node, args=(conn, proc), daemon=True).start()
        threading.Thread(target=self._from_node, args=(conn, proc), daemon=True).start()
        threading.Thread(target=self._stderr, args=(proc,), daemon=True).start()

    def _to_node(self, conn: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None
        with contextlib.suppress(OSError, ValueError):
            while data := conn.recv(BUFFER):
                proc.stdin.write(data)
                proc.stdin.flush()
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()  # the relay on the node ends with its stdin
        _end(proc)

    def _from_node(self, conn: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            while data := os.read(proc.stdout.fileno(), BUFFER):
                conn.sendall(data)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()
        _end(proc)

    def _stderr(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode(errors="replace").strip()
            if line:
                self.errors.append(line)

    def said(self) -> str:
        """What the relays said on their stderr lately (why a connection failed)."""
        return " | ".join(self.errors)

    def close(self) -> None:
        """Stop listening and end every relay (here; on the node they end with it)."""
        with self._lock:
            self._closed = True
            procs, self._procs = self._procs, []
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for proc in procs:
            _end(proc)
        self._accepting.join(5)


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def node_forward(pool: Any, rank: int, addr: str, port: int) -> PortForward | None:
    """A :class:`PortForward` to ``addr:port`` as node ``rank`` of ``pool`` sees it, through
    the shell its agent was started with; None when the pool's agents run without one (the
    local provider's nodes are processes of this machine: connect directly)."""
    allocation = pool._allocation
    shell = getattr(allocation, "shell", None)
    if shell is None or not hasattr(shell, "argv"):
        return None
    machine = allocation.machines[rank]
    python = str(pool._nodes[rank].hello_info["python"])
    return PortForward(lambda command: shell.argv(machine, command), shell.env, python, addr, port)


# -- what a pool's plugins opened on this machine, closed with the pool ------------------------

_kept: dict[int, list[Any]] = {}  # id(pool) -> forwards and clients, closed last first
_kept_lock = threading.Lock()


def keep(pool: Any, *things: Any) -> None:
    """Close ``things`` (each has ``close()``) when ``pool`` closes (see :func:`closed_with`)."""
    with _kept_lock:
        _kept.setdefault(id(pool), []).extend(things)


@contextlib.contextmanager
def closed_with(pool: Any) -> Iterator[None]:
    """A plugin's ``around_pool``: on the way out, close what :func:`keep` got for ``pool``."""
    try:
        yield
    finally:
        with _kept_lock:
            things = _kept.pop(id(pool), [])
        for thing in reversed(things):
            with contextlib.suppress(Exception):
                thing.close()
