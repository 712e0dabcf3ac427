"""The launch layer: start an agent on a machine reached through a remote shell.

A provider whose machines are reached through a command that runs a command there with its
stdio relayed (``ssh host``, ``srun -w node``, ``kubectl exec -i``, ``ip netns exec``)
supplies a :class:`RemoteShell`: the argv prefix for one machine and how to explain that
shell's own failures. :func:`start_remote_agent` does the rest, the same way for all of
them: run the bootstrap (``bootstrap``: upload the client's flotilla or reuse it, start the
agent) or, on a machine that sees the client's files, the agent itself behind an answer
line; wait for the answer within the pool's start timeout; and turn every failure into a
:class:`ProvisionError` whose ``cause`` (a :class:`ProvisionCause`) says why, here and
nowhere else.

:class:`ShellAllocation` is the allocation of such a provider: it implements
:meth:`Allocation.start_agent` with :func:`start_remote_agent`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping

from .._errors import ProvisionCause, ProvisionError
from .base import AgentProcess, Allocation, Machine
from .bootstrap import (
    NoAnswer,
    announced,
    client_bundle,
    start_agent,
    start_command,
    wait_announced,
)
from .pipe import PipeAgent, spawn

logger = logging.getLogger("flotilla")
RETRY_FIRST = 0.25
RETRY_MAX = 4.0
"""Seconds before starting an agent again after a transient failure of the shell (doubling,
with jitter), while the start timeout allows."""


class RemoteShell(ABC):
    """How to run a command on one machine with its stdio relayed to this process.

    Attributes:
        name: the shell's command, named in messages (``ssh``, ``srun``).
        env: the environment of the shell's process on this machine (None: this one's).
    """

    name: str = "shell"
    env: Mapping[str, str] | None = None
    retry_first: float = RETRY_FIRST
    retry_max: float = RETRY_MAX
    """Seconds before trying a :meth:`transient` failure again: the first, doubling up
    to the most."""

    @abstractmethod
    def argv(self, machine: Machine, command: list[str]) -> list[str]:
        """The local command line that runs ``command`` (an argv) on ``machine``."""

    @abstractmethod
    async def explain(self, machine: Machine, failure: NoAnswer) -> ProvisionError:
        """Why the shell ended without the command answering (``failure``: its exit status
        and stderr), as a ProvisionError naming the machine, with its ``cause``."""

    def pace(self, machine: Machine) -> contextlib.AbstractAsyncContextManager[object]:
        """Held while an agent starts on ``machine`` (a shell may bound how many starts
        reach one server at once); nothing by default."""
        return contextlib.nullcontext()

    def transient(self, failure: NoAnswer) -> bool:
        """Whether the shell's ``failure`` is one to try again after a while (a server
        dropping connections while too many are starting); never by default."""
        return False

    def subject(self, machine: Machine) -> str:
        """What did not start, in messages ("the agent", "the agent's step in job 12")."""
        return "the agent"

    def holds(self, machine: Machine) -> tuple[int, ...]:
        """Descriptors the shell's process for ``machine`` inherits: the write end of a
        pipe whose end of input releases the machine (SLURM's holder, the containers'
        janitor), so that the machine is released only once this process (and with it
        the agent) has ended too: a cluster's agents outlive their client for a while
        (``PoolSpec.keep_agents``). None by default."""
        return ()

    def agent(self, proc: subprocess.Popen[bytes], machine: Machine) -> PipeAgent:
        """The agent whose stdio is ``proc``'s (a shell may filter its own messages)."""
        return PipeAgent(proc, machine.address, machine.host)


async def start_remote_agent(
    shell: RemoteShell,
    machine: Machine,
    *,
    python: str,
    workdir: str,
    timeout: float,
    ship: bool = True,
    env: Mapping[str, str] | None = None,
    lock: str | None = None,
) -> PipeAgent:
    """Start the agent on ``machine`` through ``shell``; the running agent.

    Args:
        python: the interpreter on the machine.
        workdir: the machine's folder for flotilla's files (the bundles) and the agent's
            working directory.
        timeout: seconds until the agent must run.
        ship: True: the client's flotilla is uploaded (once per version) and run from
            ``workdir``; False: the machine sees the client's files and runs ``python``
            as it is (the shell sets the working directory).
        env: variables set for the agent.
        lock: a file of ``workdir`` the agent (and what it starts) holds a shared lock on
            while it runs (see :func:`bootstrap.start_command`; only with ``ship``).

    Raises ProvisionError naming the machine, with its ``cause``; nothing is left running.
    """
    loop = asyncio.get_running_loop()
    bundle = await loop.run_in_executor(None, client_bundle) if ship else None
    if bundle is not None:
        command = start_command(workdir, python, bundle, lock)
    else:
        command = announced([python, "-m", "flotilla.agent"])
    if env:
        command = ["env", *(f"{k}={v}" for k, v in env.items()), *command]
    argv = shell.argv(machine, command)
    deadline = loop.time() + timeout
    delay = shell.retry_first
    while True:
        async with shell.pace(machine):
            try:
                proc = spawn(argv, env=shell.env, pass_fds=shell.holds(machine))
                agent = shell.agent(proc, machine)
            except OSError as e:
                raise ProvisionError(
                    f"{machine.host}: cannot run {shell.name}: {e}", cause=ProvisionCause.SPAWN
                ) from e
            ok = False
            try:
                answered = (
                    wait_announced(agent)
                    if bundle is None
                    else start_agent(agent, workdir, python, bundle)
                )
                async with asyncio.timeout_at(deadline):
                    await answered
                ok = True
                return agent
            except NoAnswer as e:
                if not shell.transient(e) or deadline - loop.time() < 2 * delay:
                    raise await shell.explain(machine, e) from None
                logger.info(
                    "%s: %s ended without starting the agent (%s); again in %.1f s",
                    machine.host,
                    shell.name,
                    (e.stderr.strip().splitlines() or ["no message"])[-1],
                    delay,
                )
            except TimeoutError:
                said = agent.err_tail.decode(errors="replace").strip().splitlines()[-1:]
                raise ProvisionError(
                    f"{machine.host}: {shell.subject(machine)} did not start within {timeout:g} s"
                    + (f" ({shell.name}: {said[0]})" if said else "")
                    + "; Options(start_timeout=...) sets the limit",
                    cause=ProvisionCause.TIMEOUT,
                ) from None
            finally:
                if not ok:
                    await agent.terminate()
        await asyncio.sleep(delay * random.uniform(1.0, 1.5))  # others' attempts spread out
        delay = min(shell.retry_max, delay * 2)


class ShellAllocation(Allocation):
    """An allocation whose agents start through a :class:`RemoteShell`
    (:func:`start_remote_agent`). Subclasses set the attributes and implement
    acquiring, replacing and releasing their machines.

    Attributes:
        shell: how to reach a machine.
        python: the interpreter on the machines.
        workdir: the machines' folder for flotilla's files (see :func:`start_remote_agent`).
        ship: whether the client's flotilla is uploaded (False: the machines see the
            client's files).
        lock: a file of ``workdir`` each agent holds a shared lock on while it runs
            (None: none; see :func:`start_remote_agent`).
    """

    shell: RemoteShell
    python: str = "python3"
    workdir: str = "~/.flotilla"
    ship: bool = True
    lock: str | None = None

    async def start_agent(self, machine: Machine) -> AgentProcess:
        """Start the agent on ``machine`` through :attr:`shell`."""
        return await start_remote_agent(
            self.shell,
            machine,
            python=self.python,
            workdir=self.workdir,
            timeout=self.spec.options.start_timeout,
            ship=self.ship,
            env=self.agent_env(machine),
            lock=self.lock,
        )

    def agent_env(self, machine: Machine) -> dict[str, str]:
        """Variables set for the agent on ``machine`` (none by default)."""
        return {}
