"""The SSH provider: every node is a host reached with OpenSSH's ``ssh`` client.

Each node's agent starts through ``ssh`` (``ssh_shell``: one process per host, one
connection, which carries the agent's stdio) with the launch layer's bootstrap (``launch``).
The client writes to that process's stdin as it writes to a local agent's, and OpenSSH does
the cryptography in C: a round trip costs little more than on the local provider. No extra
port is opened, and the user's ``~/.ssh/config`` (aliases, ProxyJump...) applies. Host keys
are always verified (see ``ssh_shell``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import ConfigurationError, ProvisionError
from .base import (
    AgentProcess,
    Machine,
    MachineState,
    PoolSpec,
    Provider,
)
from .launch import ShellAllocation
from .options import provider_init
from .settings import SSHHost, SSHSettings
from .ssh_shell import SSHShell, Target, ssh_client

logger = logging.getLogger("flotilla.ssh")


# -- hosts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Target(Target):
    """A host with the provider's defaults applied, and the address peers reach it at."""

    address: str


class SSH(Provider):
    """Run the nodes on existing machines reached over SSH.

    Node ``i`` runs on ``hosts[i]``; a pool of N nodes uses the first N hosts. Each node
    runs the client's own flotilla version (uploaded once per version, see ``bootstrap``)
    with the host's ``python``. Needs OpenSSH's ``ssh`` client on this machine.
    """

    name = "ssh"
    settings: SSHSettings
    elastic = True

    @provider_init(SSHSettings)
    def __init__(self) -> None: ...

    @property
    def hosts(self) -> tuple[SSHHost, ...]:
        """The hosts, in rank order (parsed when the settings were made)."""
        hosts = self.settings.hosts
        assert isinstance(hosts, tuple)
        return tuple(h for h in hosts if isinstance(h, SSHHost))

    def __repr__(self) -> str:
        names = ", ".join(h.host for h in self.hosts[:4])
        more = f", ... ({len(self.hosts)} hosts)" if len(self.hosts) > 4 else ""
        return f"SSH([{names}{more}])"

    def validate(self, spec: PoolSpec) -> None:
        if spec.most > len(self.hosts):
            raise ConfigurationError(
                f"the pool asks for {spec.most} nodes but SSH has {len(self.hosts)} host(s): "
                f"add hosts to SSH(hosts=[...]) or lower nodes= to at most {len(self.hosts)}"
            )
        ssh_client()
        if self.settings.key_file is not None and not os.path.isfile(self.settings.key_file):
            raise ConfigurationError(
                f"SSH(key=...): no such private key file: {self.settings.key_file}"
            )
        if self.settings.accept_new_host_keys:
            _check_writable(self.settings.known_hosts_file)

    def target(self, host: SSHHost) -> _Target:
        return _Target(
            host=host.host,
            user=host.user or self.settings.user,
            port=host.port or self.settings.port,
            address=host.private_addr or host.host,
        )

    def shell(self, target: Callable[[Machine], Target]) -> SSHShell:
        """``ssh`` with this provider's key, known_hosts and timeout, to ``target``."""
        return SSHShell(
            target,
            key=self.settings.key_file,
            known_hosts=self.settings.known_hosts_file,
            accept_new_host_keys=self.settings.accept_new_host_keys,
            connect_timeout=self.settings.connect_timeout,
        )

    async def acquire(self, spec: PoolSpec) -> SSHAllocation:
        """The first ``spec.nodes`` hosts serve the ranks; the others are spares that
        :meth:`SSHAllocation.replace` takes in order. Nothing is connected yet."""
        if self.settings.accept_new_host_keys:
            os.makedirs(
                os.path.dirname(self.settings.known_hosts_file) or ".", mode=0o700, exist_ok=True
            )
        return SSHAllocation(self, spec)


def _check_writable(path: str) -> None:
    """Refuse a known_hosts file that ``accept_new_host_keys`` could not record keys in."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):  # the missing folders are created at start
        folder = os.path.dirname(folder)
    problem = ""
    if not os.path.isdir(folder):
        problem = f"{folder} is not a directory"
    elif not os.access(path if os.path.exists(path) else folder, os.W_OK):
        problem = "it is not writable"
    if problem:
        raise ConfigurationError(
            f"SSH(accept_new_host_keys=True) records new host keys in {path}, but {problem}: "
            "pass SSH(known_hosts=...) naming a file you can write"
        )


def _first_line(error: BaseException) -> str:
    return str(error).strip().split("\n", 1)[0] or type(error).__name__


class SSHAllocation(ShellAllocation):
    """Hosts of an SSH provider: ``hosts[:nodes]`` serve the ranks, the rest are spares.

    A lost host is replaced by the next spare; with none left, by the same host again (a
    reconnection: the host may have rebooted or its network come back). A spare on which
    the agent does not start (down, refusing, its key changed) is set aside for good
    (``unusable``, with why) and the next one tried.

    Attributes:
        spares: the spare hosts not used yet, in order.
        unusable: the spare hosts set aside (``user@host:port``) and why.
    """

    def __init__(self, provider: SSH, spec: PoolSpec) -> None:
        targets = [provider.target(h) for h in provider.hosts]
        machines = [_machine(rank, t) for rank, t in enumerate(targets[: spec.nodes])]
        super().__init__(spec, machines)
        self.provider = provider
        self.targets = {m.ident: t for m, t in zip(machines, targets, strict=False)}
        self.spares = targets[spec.nodes :]
        self.unusable: dict[str, str] = {}
        self.shell = provider.shell(lambda machine: self.targets[machine.ident])
        self.python = provider.settings.python or "python3"
        self.workdir = provider.settings.workdir

    async def replacement(self, rank: int, reason: str) -> Machine:
        """The next spare host, else the same host again (a new connection)."""
        old = self.machines[rank]
        return self._on(rank, self.spares.pop(0) if self.spares else self.targets[old.ident])

    async def candidate(self, rank: int) -> Machine | None:
        """The next spare host (an elastic pool grows); None when every host serves."""
        return self._on(rank, self.spares.pop(0)) if self.spares else None

    async def give_back(self, machine: Machine, failed: bool) -> None:
        """The host is a spare again: the last one tried if it ``failed`` (down: it is
        tried again after the others), else the first."""
        target = self.targets[machine.ident]
        if failed:
            self.spares.append(target)
        else:
            self.spares.insert(0, target)

    def _on(self, rank: int, target: _Target) -> Machine:
        """A new machine on ``target`` for ``rank``."""
        machine = _machine(rank, target)
        uses = sum(1 for t in self.targets.values() if t == target)
        if uses:  # a reconnection: a new machine of the allocation's history, same host
            machine = dataclasses.replace(machine, ident=f"{machine.ident}#{uses + 1}")
        self.targets[machine.ident] = target
        return machine

    async def renew(self, rank: int, reason: str) -> AgentProcess:
        """The agent on the next spare host where it starts; with no spare left, on the
        same host again. A ProvisionError names every host tried and why it failed."""
        lost = self.targets[self.machines[rank].ident]
        failures: list[str] = []
        while True:
            spare = bool(self.spares)
            machine = self._on(rank, self.spares.pop(0) if spare else lost)
            self.put(rank, machine)
            try:
                agent = await self.start_agent(machine)
            except ProvisionError as e:
                self.mark(machine, MachineState.LOST)
                why = _first_line(e)
                failures.append(why)
                if not spare:
                    if len(failures) == 1:
                        raise
                    raise ProvisionError(
                        f"no host could take node {rank}: every spare failed, then the lost "
                        f"host too: {'; '.join(failures)}"
                    ) from e
                self.unusable[machine.ident] = why
                left = (
                    f"trying the next one, {self.spares[0].host}"
                    if self.spares
                    else f"no spare left: reconnecting to {lost.host}"
                )
                logger.warning("spare host %s set aside: %s; %s", machine.host, why, left)
                continue
            self.mark(machine, MachineState.RUNNING)
            return agent


def _machine(rank: int, target: _Target) -> Machine:
    user = f"{target.user}@" if target.user else ""
    return Machine(rank, target.host, target.address, f"{user}{target.host}:{target.port}")
