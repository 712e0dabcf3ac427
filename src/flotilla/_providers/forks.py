"""A local pool's fork server, as the client holds it: its agents forked from one warm
interpreter instead of a fresh one each (the node side is ``flotilla._node.forkserver``).

A node's start is then a fork and the agent's own work, not an interpreter's start and
the agent's imports: :class:`ForkServer` starts ``python -m flotilla._node.forkserver``
once (in a session of its own, with the agents' environment and the compiled node code on
its path), :meth:`ForkServer.wait_ready` waits until it has imported them (the pool's
acquire, in a worker thread), and :meth:`ForkServer.fork` asks it for one agent, giving it
the agent's three pipes (a fork of a warm process: about as long as a spawn's fork and
exec, so an agent's start does it on the event loop as it spawns). The agent is a
:class:`ForkedAgent`: what ``PipeAgent`` uses of a ``Popen`` (its pipes, ``pid``,
``poll``, ``send_signal``, ``kill``, ``wait``), its exit status as the server reported it.
Closing the server's socket (:meth:`ForkServer.close`) ends it once the agents it forked
have ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO

from .._system import procs

START_TIMEOUT = 60.0
"""Seconds a fork may wait for the server's answer (its start included) on a busy machine."""


class ForkServer:
    """One fork server process and the client's end of its socket (see the module
    docstring)."""

    def __init__(self, python: str, root: str, env: dict[str, str]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = theirs.fileno()
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "flotilla._node.forkserver", str(fd)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(fd,),
                start_new_session=True,
                cwd=root,
                env=dict(env, PYTHONPATH=root),
            )
        except BaseException:
            self.sock.close()
            raise
        finally:
            theirs.close()
        self._asking = threading.Lock()  # one request (and its answer) at a time
        self._reading = threading.Lock()  # one reader of the socket
        self._answers: list[tuple[int, str]] = []  # (pid, why it could not start)
        self._ends: dict[int, int] = {}  # pid -> its returncode
        self._forked: set[int] = set()
        self.ended = False  # the server closed its end
        self.ready = False  # it said it has imported what agents need

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the server has imported the agents' modules (it said so). Raises
        OSError when it ended or did not within ``timeout`` seconds."""
        self._until(lambda: self.ready, timeout, "ended as it started", "did not start")

    def fork(self, cwd: str, env: dict[str, str], lanes: int = -1) -> ForkedAgent:
        """A new agent in ``cwd`` with ``env`` (its ``PYTHONPATH`` gives its import path),
        and ``lanes`` (its end of a lane socket, see ``_node/lanes.py``; -1: none).
        Raises OSError when the server cannot (it ended, or did not answer in time)."""
        ours: list[int] = []
        theirs: list[int] = []
        for _ in range(3):
            r, w = os.pipe()
            ours.append(w if not ours else r)
            theirs.append(r if not theirs else w)
        try:
            with self._asking:
                request = json.dumps({"cwd": cwd, "env": env}).encode()
                given = [*theirs, lanes] if lanes >= 0 else theirs
                socket.send_fds(self.sock, [request], given)
                pid = self._answer()
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return ForkedAgent(self, pid, *ours)

    def _until(self, done: Callable[[], bool], timeout: float, ended: str, late: str) -> None:
        """Take in what the server says until ``done()``; OSError "the local fork server
        {ended}" when it ended first, "... {late} in {timeout} s" when it took longer."""
        deadline = time.monotonic() + timeout
        while not done():
            if self.ended:
                raise OSError(f"the local fork server {ended}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise OSError(f"the local fork server {late} in {timeout:.0f} s")
            select.select([self.sock], [], [], left)
            self._read()

    def _answer(self) -> int:
        self._until(lambda: bool(self._answers), START_TIMEOUT, "ended", "did not answer")
        pid, failed = self._answers.pop(0)
        self._forked.add(pid)
        if failed:
            raise OSError(f"the local fork server could not start an agent: {failed}")
        return pid

    def _read(self) -> None:
        """Take in what the server said (without waiting)."""
        with self._reading:
            while not self.ended:
                try:
                    data = self.sock.recv(256, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                except OSError:
                    data = b""
                if not data:
                    self.ended = True
                    return
                kind, pid, said = [*data.decode(errors="replace").split(" ", 2), ""][:3]
                if kind == "R":
                    self.ready = True
                elif kind in ("P", "E"):
                    self._answers.append((int(pid), said))
                elif kind == "X":
                    self._ends[int(pid)] = int(said)

    def returncode(self, pid: int) -> int | None:
        """``pid``'s exit status, once it ended (see ``Popen.returncode``)."""
        if pid not in self._ends:
            self._read()
        if pid not in self._ends and self.ended and not procs.alive(pid):
            self._ends[pid] = -signal.SIGKILL  # the server is gone: its status is unknown
        return self._ends.get(pid)

    def close(self) -> None:
        """Close the server's socket: it ends once its agents have ended (reaped here when
        they have, else by ``subprocess`` later: it never outlives them)."""
        self._read()
        self.sock.close()
        self.ended = True
        if self._forked <= set(self._ends):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2.0)


class ForkedAgent:
    """An agent forked by a :class:`ForkServer`: a ``Popen``'s face for ``PipeAgent``."""

    def __init__(self, server: ForkServer, pid: int, stdin: int, stdout: int, stderr: int):
        self.server = server
        self.pid = pid
        self.stdin: IO[bytes] | None = open(stdin, "wb", buffering=0)  # noqa: SIM115
        self.stdout: IO[bytes] | None = open(stdout, "rb", buffering=0)  # noqa: SIM115
        self.stderr: IO[bytes] | None = open(stderr, "rb", buffering=0)  # noqa: SIM115
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["flotilla.agent"], timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
