"""The local provider: every node is an agent process tree on this machine."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile

from .._errors import ConfigurationError, ProvisionError
from .base import AgentProcess, PoolSpec, Provider
from .pipe import PipeAgent, spawn


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
                    proc = spawn(command, cwd=workdir, env=env)
                except OSError as e:
                    shutil.rmtree(workdir, ignore_errors=True)
                    raise ProvisionError(f"cannot start the agent {command[0]!r}: {e}") from e
                started.append(LocalAgent(proc, workdir))
        except BaseException:
            for agent in started:
                await agent.terminate()
            raise
        return started


class LocalAgent(PipeAgent):
    """An agent started as a child process of the client, in its own working directory."""

    def __init__(self, proc: subprocess.Popen[bytes], workdir: str) -> None:
        super().__init__(proc, address="127.0.0.1", host="localhost")
        self.workdir = workdir

    async def terminate(self) -> None:
        await super().terminate()
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
