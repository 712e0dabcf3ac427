"""The allocation of a cloud pool: instances reached over SSH with the host key the pool
made pinned (``keys``), their agents started by the launch layer once their SSH port
answers (``boot.wait_port``), a start that fails as on a booting instance tried again
(:class:`CloudShell`'s ``transient()``, ``boot.booting``) until the start timeout."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from ..._errors import ProvisionCause, ProvisionError
from ..base import AgentProcess, Machine
from ..bootstrap import NoAnswer
from ..launch import ShellAllocation, start_remote_agent
from ..ssh_shell import SSHShell, Target
from .boot import booting, wait_port
from .guard import guard_command
from .keys import KeyPair, keygen

_T = TypeVar("_T")


class CloudShell(SSHShell):
    """``ssh`` to a cloud instance, its host key pinned (never trusted on first use): a
    start that ssh ends as on a booting instance is tried again every 0.2-1 s."""

    retry_first = 0.2
    retry_max = 1.0

    def transient(self, failure: NoAnswer) -> bool:
        return super().transient(failure) or booting(failure)


class CloudAllocation(ShellAllocation):
    """Instances reached through a :class:`CloudShell`. A subclass sets ``shell`` and
    implements :meth:`target` (where a machine's sshd is) and acquiring, replacing and
    releasing its instances.

    Attributes:
        handover: how the pool's host key reached the instances, in the refusal of one
            that presents another key.
        executor: the threads of the cloud's blocking API calls (one pool of them per
            cloud, shared by its allocations).
        shell_type: the shell that reaches the instances (:class:`CloudShell`, or one
            that tries more failures again).
    """

    shell: CloudShell
    ssh: CloudShell
    settings: Any
    folder: str
    known_hosts: str
    login_key: KeyPair | None
    handover = "installed at its start"
    executor: ClassVar[concurrent.futures.ThreadPoolExecutor]
    shell_type: ClassVar[type[CloudShell]] = CloudShell

    def guard(self, poweroff: Sequence[str]) -> str:
        """The boot guard of the pool's instances (``guard.guard_command``): ``poweroff``
        after ``max(ttl, start_timeout)`` s unless an agent started, per the pool's
        settings (``ttl``, ``workdir``, ``ssh_user``)."""
        settings = self.settings
        return guard_command(
            settings.ttl,
            self.spec.options.start_timeout,
            settings.workdir,
            settings.ssh_user,
            poweroff,
        )

    def poll(
        self, step: Callable[[], bool], deadline: float, late: Callable[[], str], every: float
    ) -> None:
        """Call ``step`` every ``every`` s until it says it is done (it raises when an
        instance ended); ProvisionError when the pool is released meanwhile, or (TIMEOUT)
        saying ``late()`` past ``deadline``."""
        while not step():
            if self.ending.is_set():
                raise ProvisionError(f"pool {self.spec.pool_id}: released while starting")
            if time.monotonic() > deadline:
                raise ProvisionError(late(), cause=ProvisionCause.TIMEOUT)
            time.sleep(every)

    def _open(self, settings: Any, folder: str) -> None:
        """The pool's side on this machine: its private ``folder`` (keys, known_hosts),
        the login key to come (:meth:`_make_login_key`), and the shell that reaches its
        instances with their host keys pinned, per ``settings`` (``python``, ``workdir``,
        ``connect_timeout``)."""
        self.folder = folder
        self.known_hosts = os.path.join(folder, "known_hosts")
        self.login_key = None
        self.python = settings.python or "python3"
        self.workdir = settings.workdir
        self.ssh = self.shell_type(
            self.target,
            key=None,
            known_hosts=self.known_hosts,
            accept_new_host_keys=False,
            connect_timeout=settings.connect_timeout,
        )
        self.shell = self.ssh

    async def _make_login_key(self) -> KeyPair:
        """The pool's login key, made in its folder; the shell logs in with it."""
        key = await self._in_thread(
            keygen, self.folder, "login_key", f"flotilla-{self.spec.pool_id}"
        )
        self.login_key = key
        self.ssh.key = key.path
        return key

    async def _in_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in one of :attr:`executor`'s threads. A cancelled caller does not
        stop the thread: what it creates is recorded before it is sent
        (``base.Allocation.creating``), and the release waits for those calls, so nothing
        made escapes it."""
        return await asyncio.wrap_future(self.executor.submit(fn, *args))

    def target(self, machine: Machine) -> Target:
        """Where ``machine``'s sshd answers."""
        raise NotImplementedError

    def name(self, machine: Machine) -> str:
        """``machine`` in messages: its id and where it is reached."""
        target = self.target(machine)
        port = f":{target.port}" if target.port != 22 else ""
        return f"{machine.ident} ({target.host}{port})"

    async def start_agent(self, machine: Machine) -> AgentProcess:
        """Wait for the instance's SSH port, then start the agent (:meth:`start_pinned`)."""
        deadline = time.monotonic() + self.spec.options.start_timeout
        await self.wait_ssh(machine, deadline)
        return await self.start_pinned(machine, deadline)

    async def wait_ssh(self, machine: Machine, deadline: float) -> None:
        """Wait until ``machine``'s SSH port accepts connections (until ``deadline``)."""
        target = self.target(machine)
        timeout = self.spec.options.start_timeout
        await wait_port(target.host, target.port, deadline, self.name(machine), timeout)

    async def start_pinned(self, machine: Machine, deadline: float) -> AgentProcess:
        """Start the agent on ``machine`` over SSH with its host key pinned, tried again
        while it fails as on a booting instance, until ``deadline``; ProvisionError naming
        the instance (REFUSED when it presents another host key)."""
        name = self.name(machine)
        try:
            return await start_remote_agent(
                self.shell,
                machine,
                python=self.python,
                workdir=self.workdir,
                timeout=max(1.0, deadline - time.monotonic()),
                env=self.agent_env(machine),
            )
        except ProvisionError as e:
            if e.cause is ProvisionCause.IDENTITY:
                raise ProvisionError(
                    f"{name}: REFUSED: the instance does not present the SSH host key "
                    f"flotilla generated for it and {self.handover} (the connection may be "
                    f"intercepted): {e}",
                    cause=e.cause,
                ) from None
            raise ProvisionError(f"{name}: {e}", cause=e.cause) from None


def show(logger: logging.Logger, message: str) -> None:
    """Log ``message`` and say it on stderr (what the user waits for)."""
    logger.info("%s", message)
    print(f"flotilla: {message}", file=sys.stderr, flush=True)
