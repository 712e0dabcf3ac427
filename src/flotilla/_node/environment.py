"""The node's environment, before its executors start: the Image's build, the bucket
volumes (standard library only).

:class:`NodeEnvironment` is the part of the :class:`~flotilla._node.agent.Agent` that
prepares what the executors run in, after CONFIG: it builds the Image in a subprocess
(``_node/build.py``, its output streamed to the client as PROGRESS), then starts the volumes
helper (``_node/volumes.py``, its own session, no token: it outlives the agent's sweep and
writes back), then the executors; a failure of either is the node's READY error.
"""

from __future__ import annotations

import os
import sys
from collections import deque

from .._system import fastjson as json
from .._wire.bodies import Config, Ready, dump
from .._wire.frames import Kind, frame
from .eventloop import Outbox, Poller
from .processes import STDERR_TAIL_LINES, log
from .supervisor import Supervisor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

TOKEN_VAR = "FLOTILLA_NODE_TOKEN"
"""Environment variable marking every process an agent started (directly or not)."""


class NodeEnvironment:
    """The environment's side of an :class:`~flotilla._node.agent.Agent` (see the module
    docstring): the agent sets these attributes."""

    sel: Poller
    client: Outbox
    executors: Supervisor
    config: Config | None
    stopping: bool
    builder: Any  # the environment build subprocess, while it runs
    volumes: Any  # the volumes helper, while it runs
    pending_volumes: dict[str, Any] | None  # CONFIG's, until it starts

    def _environment_ready(self) -> None:
        """The environment is there: set up the volumes (then start), or start."""
        if self.pending_volumes:
            spec, self.pending_volumes = self.pending_volumes, None
            self._start_volumes(spec)  # the executors start once the volumes are there
            return
        self.executors.start_all()

    def _start_volumes(self, spec: dict[str, Any]) -> None:
        """Start the volumes helper (``_node/volumes.py``): its own session and no token,
        so that it outlives the agent's sweep and writes back; it ends when its stdin (kept
        open here) closes. With ``private`` (nodes sharing this machine), this agent first
        moves into a mount namespace of its own, which the helper, its FUSE daemons and
        the executors inherit."""
        import subprocess

        keep: Any = None
        if spec.get("private"):  # nodes of one machine: this node's own view of the paths
            from .volumes import keep_mount_capability, private_namespace

            why = private_namespace()  # (this agent is single-threaded, as it must be)
            if why is not None:
                self._volumes_failed(f"no private mount namespace for this node: {why}")
                return
            keep = keep_mount_capability  # (a user namespace: the helper mounts there)
        env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR}
        proc = subprocess.Popen(
            [sys.executable, "-m", "flotilla._node.volumes"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
            preexec_fn=keep,
        )
        assert proc.stdin is not None and proc.stdout is not None
        self.volumes = proc
        self.volumes_out = b""
        self.volumes_settled = False
        self.volumes_timeout = float(spec.get("flush_timeout", 300.0))
        os.set_blocking(proc.stdout.fileno(), False)
        self.sel.register(proc.stdout.fileno(), False, self._on_volumes_output)
        try:
            proc.stdin.write(json.dumps(spec).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass  # it died early: its end says so

    def _on_volumes_output(self) -> None:
        proc = self.volumes
        data = _available(proc)
        if data is None:
            return
        self.volumes_out += data
        while b"\n" in self.volumes_out:
            line, self.volumes_out = self.volumes_out.split(b"\n", 1)
            if line == b"::ready":
                self.volumes_settled = True
                if not self.stopping:  # (a stop asked meanwhile: nothing more starts)
                    self.executors.start_all()
            elif line.startswith(b"::error "):
                self._volumes_failed(line[8:].decode(errors="replace"))
        if not data:
            self.sel.unregister(proc.stdout.fileno())
            if not self.stopping and not self.volumes_settled:
                self._volumes_failed("the volumes helper exited before the volumes were ready")

    def _volumes_failed(self, why: str) -> None:
        self.volumes_settled = True
        error: Ready = {"error": f"the volumes could not be set up on this node: {why}"}
        self.client.send(frame(Kind.READY, 0, dump(error)))

    def _stop_volumes(self) -> None:
        """Close the helper's stdin and wait for it: it writes back and unmounts."""
        proc = self.volumes
        if proc is None:
            return
        import subprocess

        self.volumes = None
        try:
            assert proc.stdin is not None
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(self.volumes_timeout)
        except subprocess.TimeoutExpired:
            self._log("the volumes helper did not finish writing back: stopped")
            proc.terminate()
            proc.wait()

    def _start_build(self, includes: bytes) -> None:
        """Build the Image in a subprocess; its output streams to the client as PROGRESS."""
        import subprocess

        assert self.config is not None
        env = dict(os.environ, **self.config.get("env", {}))
        proc = subprocess.Popen(
            [sys.executable, "-m", "flotilla._node.build", self.config["home"]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        self.builder = proc
        self.build_tail: deque[bytes] = deque(maxlen=STDERR_TAIL_LINES)
        self.build_step = "start"
        self.build_error = ""
        self.build_partial = b""
        out = proc.stdout.fileno()
        os.set_blocking(out, False)
        self.sel.register(out, False, self._on_build_output)
        try:
            proc.stdin.write(json.dumps(self.config["image"]).encode() + b"\n" + includes)
            proc.stdin.close()
        except OSError:
            pass  # it died early; its output says why

    def _on_build_output(self) -> None:
        proc = self.builder
        data = _available(proc)
        if data is None:
            return
        if data:
            lines = (self.build_partial + data).split(b"\n")
            self.build_partial = lines.pop()
            for line in lines:
                if line.startswith(b"::step "):
                    self.build_step = line[7:].decode(errors="replace")
                elif line.startswith(b"::error "):
                    self.build_error = line[8:].decode(errors="replace")
                else:
                    self.build_tail.append(line)
            self.client.send(frame(Kind.PROGRESS, 0, data))
            return
        self.sel.unregister(proc.stdout.fileno())
        code = proc.wait()
        proc.stdout.close()
        self.builder = None
        if code == 0:
            self._environment_ready()
            return
        tail = b"\n".join([*self.build_tail, self.build_partial]).decode(errors="replace")
        reason = f": {self.build_error}" if self.build_error else ""
        error: Ready = {
            "error": f"the environment build failed in step {self.build_step!r} "
            f"with exit code {code}{reason}",
            "build_step": self.build_step,
            "exitcode": code,
            "stderr_tail": tail,
        }
        self.client.send(frame(Kind.READY, 0, dump(error)))

    def _log(self, message: str) -> None:
        log(message)


def _available(proc: Any) -> bytes | None:
    """What a helper process's stdout (non-blocking) holds now: b"" at its end, None when
    nothing has come yet."""
    assert proc is not None and proc.stdout is not None
    try:
        return os.read(proc.stdout.fileno(), 65536)
    except BlockingIOError:
        return None
