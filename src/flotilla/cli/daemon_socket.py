"""The cluster daemon's socket: how the CLI talks to a running cluster (see ``ipc``).

:class:`DaemonSocket` binds ``NAME.sock`` in the cluster's private folder, serves each
connection of its own user on a thread (peer credentials checked), turns the requests into
calls on its daemon (a ``ClusterDaemon``, as far as :class:`Served` says) and streams a
job's events back. It removes only the socket it bound itself, never a newer daemon's at
the same path.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from collections import deque
from typing import Any, Protocol

from .._errors import FlotillaError
from .._system.private import socket_address
from .ipc import encode, peer_uid
from .jobs import Job, Subscriber
from .jobspec import JobSpec
from .ledger import Allocation
from .state import Paths


class Served(Protocol):
    """What the socket asks of the daemon it serves (``daemon.ClusterDaemon``)."""

    paths: Paths
    error: str
    autodown: bool
    cv: threading.Condition
    queue: deque[Job]
    running: dict[int, tuple[Job, Allocation | None]]
    jobs: dict[int, Job]
    stopped: threading.Event

    def submit(self, spec: JobSpec, follow: bool = False) -> tuple[Job, Subscriber | None]: ...
    def cancel(self, job: Job) -> None: ...
    def set_autostop(self, minutes: float | None, down: bool) -> None: ...
    def request_stop(self, delete_record: bool) -> None: ...


class DaemonSocket:
    """A cluster daemon's UNIX socket server: bind, accept, serve requests, close."""

    def __init__(self, daemon: Served) -> None:
        self.daemon = daemon
        self.server: socket.socket | None = None
        self.inode = 0  # of the socket bound here, to remove only this one
        self.handlers: list[threading.Thread] = []

    def bind(self) -> None:
        """Listen on the cluster's socket, private to its user (mode 0600)."""
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with socket_address(self.daemon.paths.socket) as address:  # in the private folder
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)
            old = os.umask(0o177)
            try:
                server.bind(address)
            finally:
                os.umask(old)
            self.inode = os.stat(address).st_ino
        server.listen(64)
        self.server = server

    def close(self) -> None:
        """Stop accepting and remove the socket (if it is still the one bound here)."""
        if self.server is not None:
            self.server.close()
        with contextlib.suppress(OSError), socket_address(self.daemon.paths.socket) as address:
            if os.stat(address).st_ino == self.inode:
                os.unlink(address)

    def join_handlers(self, timeout: float) -> None:
        """Let the connections being answered (``down``, followers) get their last answer."""
        for t in list(self.handlers):
            if t is not threading.current_thread():
                t.join(timeout)

    def accept_forever(self) -> None:
        assert self.server is not None
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed: shutting down
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self.handlers = [h for h in self.handlers if h.is_alive()] + [t]
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            uid = peer_uid(conn)
            if uid != os.geteuid():  # the socket is private; this holds even if it is not
                print(f"refused a connection from uid {uid}", file=sys.stderr)
                refusal = (
                    f"refused: this cluster belongs to uid {os.geteuid()}, and only its "
                    "owner may use it"
                )
                with contextlib.suppress(OSError):
                    conn.sendall(encode({"ev": "error", "message": refusal}))
                return
            try:
                with conn.makefile("rb") as f:
                    request = json.loads(f.readline() or b"{}")
                self._serve(conn, request)
            except (FlotillaError, ValueError, KeyError, TypeError) as e:
                with contextlib.suppress(OSError):
                    conn.sendall(encode({"ev": "error", "message": str(e)}))
            except OSError:
                pass  # the client went away

    def _serve(self, conn: socket.socket, request: dict[str, Any]) -> None:
        d = self.daemon
        op = request.get("op")
        if op == "ping":
            conn.sendall(encode({"ev": "pong", "pid": os.getpid(), "error": d.error}))
        elif op == "submit":
            attach = bool(request.get("attach"))
            job, sub = d.submit(JobSpec.from_dict(request["job"]), follow=attach)
            try:
                with d.cv:
                    queued = list(d.queue)
                    ahead = queued.index(job) + len(d.running) if job in queued else 0
                accepted = {"ev": "accepted", "job": job.id, "task_id": job.task_id}
                conn.sendall(encode({**accepted, "ahead": ahead}))
                if attach:
                    self._stream(conn, job, [], sub)
            finally:
                if sub is not None:
                    job.unsubscribe(sub)
        elif op == "follow":
            job_opt = d.jobs.get(int(request["job"]))
            if job_opt is None:
                conn.sendall(encode({"ev": "gone"}))
            else:
                node = request.get("node")
                which = None if node is None else int(node)
                self._stream(conn, job_opt, *job_opt.subscribe(which, replay=True))
        elif op == "cancel":
            job_opt = d.jobs.get(int(request["job"]))
            if job_opt is None:
                conn.sendall(encode({"ev": "gone"}))
                return
            was = job_opt.status
            if not job_opt.done.is_set():
                d.cancel(job_opt)
            conn.sendall(encode({"ev": "cancelled", "was": was.value, **job_opt.end_event()}))
        elif op == "autostop":  # `flotilla autostop`: a new idle limit, or none
            minutes = request.get("minutes")
            d.set_autostop(None if minutes is None else float(minutes), bool(request["down"]))
            conn.sendall(encode({"ev": "autostop", "minutes": minutes, "down": d.autodown}))
        elif op == "down":
            d.request_stop(delete_record=True)
            d.stopped.wait()
            conn.sendall(encode({"ev": "down"}))
        elif op == "stop":  # agents stop; node folders and environments stay (`start`)
            d.request_stop(delete_record=False)
            d.stopped.wait()
            conn.sendall(encode({"ev": "stopped", "error": d.error}))
        else:
            raise ValueError(f"unknown request {op!r}")

    def _stream(
        self, conn: socket.socket, job: Job, backlog: list[str], sub: Subscriber | None
    ) -> None:
        """Send ``backlog`` (the job's log so far, as ``log`` events), then what ``sub``
        gets until the job's end (or the end at once: None, the job had ended)."""
        if backlog:
            conn.sendall(b"".join(encode({"ev": "log", "line": line}) for line in backlog))
        if sub is None:
            conn.sendall(encode(job.end_event()))
            return
        try:
            while True:
                batch = [sub.events.get()]
                while not sub.events.empty() and len(batch) < 1000:
                    batch.append(sub.events.get_nowait())
                conn.sendall(b"".join(encode(ev) for ev in batch))
                if any(ev["ev"] == "end" for ev in batch):
                    return
        finally:
            job.unsubscribe(sub)
