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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._errors import ConfigurationError, ProvisionError
from .base import (
    AgentProcess,
    AllocationState,
    Machine,
    MachineState,
    PoolSpec,
    Provider,
)
from .launch import ShellAllocation
from .ssh_shell import SSHShell, Target, ssh_client

logger = logging.getLogger("flotilla.ssh")


# -- hosts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SSHHost:
    """One SSH host.

    Attributes:
        host: host name or address the client connects to.
        user: login user (default: the provider's ``user``, then SSH's default).
        port: SSH port (default: the provider's ``port``).
        private_addr: the address the other nodes use to reach this one (e.g. a private
            network address); default: ``host``.
    """

    host: str
    user: str | None = None
    port: int | None = None
    private_addr: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigurationError(f"SSHHost.host must be a host name, got {self.host!r}")
        if self.port is not None:
            _check_port(self.port, f"port of host {self.host!r}")


def parse_host(text: str) -> SSHHost:
    """``SSHHost`` of ``"host"``, ``"user@host"``, ``"host:port"``, ``"user@[v6addr]:port"``."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigurationError(f"an SSH host must be a non-empty string, got {text!r}")
    user, _, rest = text.strip().rpartition("@")
    port: str | None = None
    if rest.startswith("["):
        host, sep, after = rest[1:].partition("]")
        if not sep or (after and not after.startswith(":")):
            raise ConfigurationError(f"cannot parse SSH host {text!r}: expected [address]:port")
        port = after[1:] or None
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    else:
        host = rest  # a plain name, or an IPv6 address without a port
    if not host:
        raise ConfigurationError(f"cannot parse SSH host {text!r}: no host name")
    if port is not None and not port.isdigit():
        raise ConfigurationError(f"cannot parse SSH host {text!r}: port {port!r} is not a number")
    return SSHHost(host, user or None, int(port) if port else None)


def _check_port(port: object, what: str) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigurationError(f"{what} must be a TCP port number (1-65535), got {port!r}")


@dataclass(frozen=True)
class _Target(Target):
    """A host with the provider's defaults applied, and the address peers reach it at."""

    address: str


# -- the provider --------------------------------------------------------------------------
class SSH(Provider):
    """Run the nodes on existing machines reached over SSH.

    Node ``i`` runs on ``hosts[i]``; a pool of N nodes uses the first N hosts. Each node
    runs the client's own flotilla version (uploaded once per version, see ``_bootstrap``)
    with the host's ``python``. Needs OpenSSH's ``ssh`` client on this machine.

    Args:
        hosts: ``"user@host:port"`` strings or :class:`SSHHost` objects.
        user: default login user (default: SSH's, usually the local user name).
        port: default SSH port.
        key: private key file (default: ssh-agent and ``~/.ssh/id_*``).
        known_hosts: known_hosts file that host keys are checked against
            (default: ``~/.ssh/known_hosts``).
        accept_new_host_keys: trust on first use: accept a host that is not in
            ``known_hosts`` and record its key there. A changed key is always refused.
        python: interpreter on the hosts (Python >= 3.11).
        workdir: directory on the hosts for flotilla's files and the agents' working
            directory; ``~`` is the login user's home.
        connect_timeout: seconds to connect and authenticate to one host (whole seconds
            for ssh; a fraction is rounded up).
    """

    name = "ssh"

    def __init__(
        self,
        hosts: Sequence[str | SSHHost] | str | SSHHost,
        user: str | None = None,
        port: int = 22,
        key: str | os.PathLike[str] | None = None,
        known_hosts: str | os.PathLike[str] | None = None,
        accept_new_host_keys: bool = False,
        python: str = "python3",
        workdir: str = "~/.flotilla",
        connect_timeout: float = 10.0,
    ) -> None:
        if isinstance(hosts, str | SSHHost):
            hosts = [hosts]
        self.hosts: tuple[SSHHost, ...] = tuple(
            h if isinstance(h, SSHHost) else parse_host(h) for h in hosts
        )
        if not self.hosts:
            raise ConfigurationError("SSH(hosts=...) needs at least one host")
        _check_port(port, "SSH(port=...)")
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, int | float):
            raise ConfigurationError(f"connect_timeout must be a number, got {connect_timeout!r}")
        if connect_timeout <= 0:
            raise ConfigurationError(f"connect_timeout must be positive, got {connect_timeout!r}")
        if not python.strip() or not workdir.strip():
            raise ConfigurationError("SSH(python=..., workdir=...) must not be empty")
        self.user = user
        self.port = port
        self.key = os.path.expanduser(os.fspath(key)) if key is not None else None
        self.known_hosts = os.path.expanduser(
            os.fspath(known_hosts) if known_hosts is not None else "~/.ssh/known_hosts"
        )
        self.accept_new_host_keys = accept_new_host_keys
        self.python = python
        self.workdir = workdir
        self.home = workdir
        self.connect_timeout = float(connect_timeout)

    def __repr__(self) -> str:
        names = ", ".join(h.host for h in self.hosts[:4])
        more = f", ... ({len(self.hosts)} hosts)" if len(self.hosts) > 4 else ""
        return f"SSH([{names}{more}])"

    def validate(self, spec: PoolSpec) -> None:
        if spec.nodes > len(self.hosts):
            raise ConfigurationError(
                f"the pool asks for {spec.nodes} nodes but SSH has {len(self.hosts)} host(s): "
                f"add hosts to SSH(hosts=[...]) or lower nodes= to at most {len(self.hosts)}"
            )
        ssh_client()
        if self.key is not None and not os.path.isfile(self.key):
            raise ConfigurationError(f"SSH(key=...): no such private key file: {self.key}")
        if self.accept_new_host_keys:
            _check_writable(self.known_hosts)

    def target(self, host: SSHHost) -> _Target:
        return _Target(
            host=host.host,
            user=host.user or self.user,
            port=host.port or self.port,
            address=host.private_addr or host.host,
        )

    def shell(self, target: Callable[[Machine], Target]) -> SSHShell:
        """``ssh`` with this provider's key, known_hosts and timeout, to ``target``."""
        return SSHShell(
            target,
            key=self.key,
            known_hosts=self.known_hosts,
            accept_new_host_keys=self.accept_new_host_keys,
            connect_timeout=self.connect_timeout,
        )

    async def acquire(self, spec: PoolSpec) -> SSHAllocation:
        """The first ``spec.nodes`` hosts serve the ranks; the others are spares that
        :meth:`SSHAllocation.replace` takes in order. Nothing is connected yet."""
        if self.accept_new_host_keys:
            os.makedirs(os.path.dirname(self.known_hosts) or ".", mode=0o700, exist_ok=True)
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
        self.python = provider.python
        self.workdir = provider.workdir

    async def replace(self, rank: int, reason: str) -> Machine:
        """The next spare host, else the same host again (a new connection)."""
        old = self.machines[rank]
        return self._put(rank, self.spares.pop(0) if self.spares else self.targets[old.ident])

    def _put(self, rank: int, target: _Target) -> Machine:
        """A new machine on ``target`` at ``rank``, in place of the current one."""
        self.mark(self.machines[rank], MachineState.RELEASED)
        machine = _machine(rank, target)
        uses = sum(1 for t in self.targets.values() if t == target)
        if uses:  # a reconnection: a new machine of the allocation's history, same host
            machine = dataclasses.replace(machine, ident=f"{machine.ident}#{uses + 1}")
        self.targets[machine.ident] = target
        self.machines[rank] = machine
        self.mark(machine, MachineState.PENDING)
        return machine

    async def renew(self, rank: int, reason: str) -> AgentProcess:
        """The agent on the next spare host where it starts; with no spare left, on the
        same host again. A ProvisionError names every host tried and why it failed."""
        lost = self.targets[self.machines[rank].ident]
        failures: list[str] = []
        while True:
            spare = bool(self.spares)
            machine = self._put(rank, self.spares.pop(0) if spare else lost)
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

    async def release(self) -> None:
        self.state = AllocationState.RELEASED
        for machine in self.machines:
            self.mark(machine, MachineState.RELEASED)


def _machine(rank: int, target: _Target) -> Machine:
    user = f"{target.user}@" if target.user else ""
    return Machine(rank, target.host, target.address, f"{user}{target.host}:{target.port}")
