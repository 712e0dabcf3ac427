"""An engine's daemons on a node (Ray's head or worker, Dask's scheduler or worker), run by
the node's first executor process for as long as it lives.

A :class:`Daemon` is a command started with the pool's environment and a marker of its own
in its environment (``FLOTILLA_ENGINE``), which everything it starts inherits. It dies with
its executor: the kernel kills it when the executor dies (``PR_SET_PDEATHSIG``), the agent
kills every process carrying its token when it exits (a pool closed, Ctrl-C on the client,
the client gone: the agents' watchdog), and :meth:`Daemon.stop` (the pool closing) kills
whatever carries its marker and removes its scratch folder. A scratch folder whose executor
died without removing it is removed by the next daemon started on that machine.
Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import FlotillaError
from .._system.procs import (
    OWNER,
    alive,
    die_with_parent,
    has_env,
    kill_all,
    of_gone_owners,
    owner_tag,
    pids,
)
from ._env import host_port

MARKER_VAR = "FLOTILLA_ENGINE"
"""Environment variable carried by every process of one node's engine daemons."""
OWNER_FILE = ".flotilla-owner"
"""In a scratch folder: the owner tag of the executor that made it (see :func:`sweep`)."""
TAIL_LINES = 30
"""Lines of a daemon's output kept to explain a failure: its first ones (a Python traceback
prints a chained exception's root cause first) and its last ones."""
STOP_GRACE = 2.0
"""Seconds :meth:`Daemon.stop` waits for the killed processes to be gone."""
ENGINE_PORT_OFFSET = {"ray": 16, "dask": 17, "ray-dashboard": 18}
"""The head's engine ports, from ``head_port``: the head's agent found the 64 ports from
``head_port`` free when it started (``PORT_BLOCK``), torch uses ``head_port``, JAX the next,
TensorFlow the ones after it; the engines take theirs from the block's middle (the client
knows them too: ``pool.dask_client()`` and ``pool.ray_dashboard()`` reach them)."""


class EngineError(FlotillaError, RuntimeError):
    """An engine's daemon (Ray's, Dask's) could not start on a node, or the client could
    not reach it (its own words in the message)."""


def scratch_dir(engine: str, pool_id: str, node: int) -> str:
    """The node's folder for one engine's files (Ray's sessions, Dask's spill space):
    ``/tmp/<engine>/flotilla-<pool>-<node>``, short (Ray's Unix sockets live under it)
    and removed when the pool closes."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), engine, f"flotilla-{pool_id[:8]}-{node}")


def head_engine_port(engine: str, head_port: int) -> int:
    """The head's port for ``engine`` (its rendezvous: Ray's GCS, Dask's scheduler)."""
    return head_port + ENGINE_PORT_OFFSET[engine]


def head_forward(pool: Any, engine: str) -> tuple[Any, str]:
    """Node 0's port for ``engine`` reached from this machine: (a forward through the
    pool's channel, None when node 0 runs here; the port as ``host:port`` on node 0)."""
    from .._client.forward import node_forward

    head = pool._nodes[0].proc.address
    port = head_engine_port(engine, int(pool._bringup.head_port))
    return node_forward(pool, 0, head, port), host_port(head, port)


def free_port(addr: str) -> int:
    """A port no process holds on ``addr`` now (the kernel's choice)."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def check_free(addr: str, port: int, what: str) -> None:
    """EngineError unless ``port`` can be bound on ``addr`` (every address) now."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise EngineError(
                f"{what}: port {port} on {addr} was free when the pool started and is "
                f"taken now ({e.strerror}); start the pool again (it picks another block)"
            ) from None


class Daemon:
    """One engine daemon of this node (see the module docstring).

    Args:
        name: what it is, in messages ("ray head").
        argv: its command.
        env: its environment (the marker is added).
        scratch: its scratch folder: made empty before it starts, removed when it stops.
        watch: the texts :meth:`said` is asked about: each is looked for in every line of
            its output as it is read (a failure's traceback may push the line that names its
            cause out of the lines kept).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        scratch: str,
        watch: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.marker = f"{name.replace(' ', '-')}.{os.getpid()}.{os.urandom(6).hex()}"
        self.env = {**env, MARKER_VAR: self.marker}
        self.scratch = scratch
        self.proc: subprocess.Popen[bytes] | None = None
        self.head: list[str] = []
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.lines = 0
        self.watch = tuple(watch)
        self.found: set[str] = set()
        self.seen = threading.Condition()
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        sweep(os.path.dirname(self.scratch))
        shutil.rmtree(self.scratch, ignore_errors=True)  # a killed run's leftovers
        os.makedirs(self.scratch, mode=0o700, exist_ok=True)
        with open(os.path.join(self.scratch, OWNER_FILE), "w") as f:
            f.write(owner_tag())
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.scratch,
            preexec_fn=lambda: die_with_parent(signal.SIGKILL, None),
        )
        self._reader = threading.Thread(target=self._read, name=f"{self.name} output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            with self.seen:
                if len(self.head) < TAIL_LINES:
                    self.head.append(line)
                self.tail.append(line)
                self.lines += 1
                self.found.update(text for text in self.watch if text in line)
                self.seen.notify_all()
        with self.seen:
            self.seen.notify_all()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def failure(self, why: str) -> EngineError:
        """An error naming the daemon, ``why``, and its output: all of it when short, else
        its first and last lines (the root cause of a chained traceback comes first)."""
        if self._reader is not None and not self.running():
            self._reader.join(1.0)  # the output it printed before it exited
        with self.seen:
            shown, lines = list(self.tail), self.lines
            if lines > 2 * TAIL_LINES:
                skipped = f"... ({lines - 2 * TAIL_LINES} lines left out) ..."
                shown = [*self.head, skipped, *shown]
            elif lines > TAIL_LINES:
                shown = self.head[: lines - TAIL_LINES] + shown
        text = "\n".join(f"    {line}" for line in shown)
        return EngineError(f"{self.name}: {why}" + (f"; its output:\n{text}" if text else ""))

    def wait_for(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``ready()`` (checked after every line of output and every 50 ms);
        EngineError when the daemon exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not ready():
            if not self.running():
                code = self.proc.returncode if self.proc is not None else None
                raise self.failure(f"exited (status {code}) before {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.failure(f"not {what} after {timeout:g} s")
            with self.seen:
                self.seen.wait(min(left, 0.05))

    def said(self, text: str) -> bool:
        """Whether a line of its output so far contains ``text``, one of its ``watch``."""
        if text not in self.watch:
            raise ValueError(f"{self.name}: said({text!r}) asks for a text not in its watch")
        with self.seen:
            return text in self.found

    def stop(self) -> None:
        """Stop it: SIGKILL to every process carrying its marker (the pool is going away:
        nothing of an engine's state outlives it, and a graceful stop of Ray's head takes
        longer than the agent's ``shutdown_grace``), then remove its scratch folder."""
        marker = f"{MARKER_VAR}={self.marker}".encode()
        kill_all(lambda pid: has_env(pid, marker))
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_GRACE)
        wait_none_left(marker, STOP_GRACE)
        if self._reader is not None:
            self._reader.join(1.0)
        shutil.rmtree(self.scratch, ignore_errors=True)
        with contextlib.suppress(OSError):  # /tmp/<engine> when no other pool uses it
            os.rmdir(os.path.dirname(self.scratch))


def sweep(root: str) -> None:
    """Remove the scratch folders under ``root`` whose executor is gone: a pool whose client
    died, or whose node was killed, had no time to remove them (the agent killed the
    engine's processes, which carry its token)."""
    try:
        names = [n for n in os.listdir(root) if n.startswith("flotilla-")]
    except OSError:
        return
    owners = {}
    for name in names:
        with contextlib.suppress(OSError), open(os.path.join(root, name, OWNER_FILE)) as f:
            owners[f.read().strip()] = name
    for tag in of_gone_owners(list(owners), re.compile(OWNER)):
        shutil.rmtree(os.path.join(root, owners[tag]), ignore_errors=True)


def wait_none_left(marker: bytes, timeout: float) -> bool:
    """Wait until no live process carries ``marker`` (killed ones take a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids() if has_env(p, marker) and alive(p)]
        if not left or time.monotonic() >= deadline:
            return not left
        time.sleep(0.02)
