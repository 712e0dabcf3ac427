"""The local provider: every node is an agent process tree on this machine."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from ._errors import ConfigurationError, ProvisionError
from ._protocol import Buffer, FrameReader, write_all
from ._provider import AgentProcess, FramesCallback, PoolSpec, Provider


class Local(Provider):
    """Run the nodes as local processes (the default provider).

    Each node is a separate agent process tree with its own working directory; node
    addresses are 127.0.0.1. By default the agents use this interpreter and its
    environment (``sys.path`` is passed on), so a pool starts in a fraction of a second.

    Args:
        python: interpreter for the agents (default: ``sys.executable``).
        workdir: parent folder of the nodes' working directories (default: a temp dir).
    """

    name = "local"
    shares_filesystem = True

    def __init__(self, python: str | None = None, workdir: str | None = None) -> None:
        self.python = python or sys.executable
        self.workdir = workdir
        self.home = os.environ.get("FLOTILLA_HOME", "~/.flotilla")

    def __repr__(self) -> str:
        return "Local()"

    def validate(self, spec: PoolSpec) -> None:
        acc = spec.accelerator
        if acc is not None:
            have = local_gpu_count()
            if have < acc.count:
                raise ConfigurationError(
                    f"accelerator {acc} requested but this machine has {have} GPU(s); "
                    f"the local provider runs on this machine only: drop `accelerator=` "
                    f"or use a provider that has {acc.name} GPUs"
                )

    def agent_command(self) -> list[str]:
        return [self.python, "-m", "flotilla.agent"]

    async def start(self, spec: PoolSpec, command: list[str]) -> list[AgentProcess]:
        env = dict(os.environ)
        env.pop("COMPUTE_POOL", None)
        env["PYTHONPATH"] = os.pathsep.join(_client_path())
        started: list[AgentProcess] = []
        if self.workdir is not None:
            try:
                os.makedirs(self.workdir, exist_ok=True)
            except OSError as e:
                raise ProvisionError(
                    f"cannot create the nodes' work folder {self.workdir!r}: {e}"
                ) from e
        try:
            for rank in range(spec.nodes):
                workdir = tempfile.mkdtemp(
                    prefix=f"flotilla-{spec.pool_id}-node{rank}-", dir=self.workdir
                )
                try:
                    proc = subprocess.Popen(
                        command,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        cwd=workdir,
                        env=env,
                        start_new_session=True,  # Ctrl-C reaches the client, which stops us
                        bufsize=0,
                    )
                except OSError as e:
                    shutil.rmtree(workdir, ignore_errors=True)
                    raise ProvisionError(f"cannot start the agent {command[0]!r}: {e}") from e
                started.append(LocalAgent(proc, workdir))
        except BaseException:
            for agent in started:
                await agent.terminate()
            raise
        return started


class LocalAgent(AgentProcess):
    """An agent started as a child process of the client."""

    def __init__(self, proc: subprocess.Popen[bytes], workdir: str) -> None:
        assert proc.stdin and proc.stdout and proc.stderr
        self.proc = proc
        self.workdir = workdir
        self.address = "127.0.0.1"
        self.host = "localhost"
        self._in = proc.stdin.fileno()
        self._out = proc.stdout.fileno()
        self._err = proc.stderr.fileno()
        self._loop: asyncio.AbstractEventLoop | None = None

    def write(self, parts: Sequence[Buffer]) -> None:
        write_all(self._in, parts)

    def start_reading(
        self,
        loop: asyncio.AbstractEventLoop,
        on_frames: FramesCallback,
        on_stderr: Callable[[bytes], None],
    ) -> None:
        self._loop = loop
        reader = FrameReader()

        def readable() -> None:
            try:
                frames = reader.read(self._out)
            except OSError:
                frames = None
            if frames is None:
                loop.remove_reader(self._out)
            on_frames(frames)

        def err_readable() -> None:
            try:
                data = os.read(self._err, 65536)
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(self._err)
                return
            on_stderr(data)

        loop.add_reader(self._out, readable)
        loop.add_reader(self._err, err_readable)

    async def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        delay = 0.001
        while self.proc.poll() is None:
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)
        return self.proc.returncode

    def exit_status(self) -> int | None:
        return self.proc.poll()

    async def terminate(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            if await self.wait(1.5) is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.wait(1.0)
        if self._loop is not None:
            for fd in (self._out, self._err):
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(fd)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _client_path() -> list[str]:
    """This process's import path, so agents import what the client imports."""
    out: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if path not in out and os.path.exists(path):
            out.append(path)
    return out


def local_gpu_count() -> int:
    """Number of NVIDIA GPUs visible on this machine."""
    return len(glob.glob("/dev/nvidia[0-9]*"))
