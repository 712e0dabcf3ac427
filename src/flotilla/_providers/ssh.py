"""The SSH provider: every node is a host reached with OpenSSH's ``ssh`` client.

One ``ssh`` process per host, one connection: it runs the bootstrap command (see
``_bootstrap``), which becomes the agent, and its stdin/stdout are the protocol channel. The
client writes to that process's stdin as it writes to a local agent's, and OpenSSH does the
cryptography in C: a round trip costs little more than on the local provider. No extra port
is opened, and the user's ``~/.ssh/config`` (aliases, ProxyJump...) applies.

Host keys are always verified (``StrictHostKeyChecking=yes``) against a known_hosts file.
An unknown host is refused with its fingerprint unless ``accept_new_host_keys=True`` (trust
on first use, ``accept-new``: the key is recorded in the file); a host whose key changed is
always refused. Options that would weaken this or leave something behind (agent and X11
forwarding, connection sharing with a lingering master) are turned off on the command line,
which takes precedence over any configuration file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._errors import ConfigurationError, ProvisionError
from .base import (
    AgentProcess,
    Allocation,
    AllocationState,
    FramesCallback,
    Machine,
    MachineState,
    PoolSpec,
    Provider,
)
from .bootstrap import SIGNAL_LINE, Bundle, NoAnswer, client_bundle, start_agent, start_command
from .pipe import PipeAgent, spawn

logger = logging.getLogger("flotilla.ssh")

KEEPALIVE_INTERVAL = 2
KEEPALIVE_COUNT_MAX = 3
SSH_FAILED = 255
"""ssh's exit status when it fails itself (cannot connect, connection lost)."""


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
class _Target:
    """A host with the provider's defaults applied."""

    host: str
    user: str | None
    port: int
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
        python: interpreter on the hosts, of the client's Python minor version (default:
            ``python3``, or, when that is another minor version, one found on the host;
            see README "Python on the nodes").
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
        python: str | None = None,
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
        if (python is not None and not python.strip()) or not workdir.strip():
            raise ConfigurationError("SSH(python=..., workdir=...) must not be empty")
        self.user = user
        self.port = port
        self.key = os.path.expanduser(os.fspath(key)) if key is not None else None
        self.known_hosts = os.path.expanduser(
            os.fspath(known_hosts) if known_hosts is not None else "~/.ssh/known_hosts"
        )
        self.accept_new_host_keys = accept_new_host_keys
        self.python = python or "python3"
        self.python_pinned = python is not None
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
        _ssh_client()
        if self.key is not None and not os.path.isfile(self.key):
            raise ConfigurationError(f"SSH(key=...): no such private key file: {self.key}")
        if self.accept_new_host_keys:
            _check_writable(self.known_hosts)

    def agent_command(self) -> list[str]:
        return [self.python, "-m", "flotilla.agent"]

    def target(self, host: SSHHost) -> _Target:
        return _Target(
            host=host.host,
            user=host.user or self.user,
            port=host.port or self.port,
            address=host.private_addr or host.host,
        )

    def ssh_argv(self, target: _Target, command: str, *extra: str) -> list[str]:
        """The ``ssh`` command line that runs ``command`` on ``target``."""
        options = {
            "BatchMode": "yes",  # never prompt: fail instead
            "StrictHostKeyChecking": "accept-new" if self.accept_new_host_keys else "yes",
            "UserKnownHostsFile": _config_path(self.known_hosts),
            "UpdateHostKeys": "no",
            "ConnectTimeout": str(max(1, math.ceil(self.connect_timeout))),
            "ServerAliveInterval": str(KEEPALIVE_INTERVAL),
            "ServerAliveCountMax": str(KEEPALIVE_COUNT_MAX),
            "ControlMaster": "no",
            "ControlPath": "none",
            "ForwardAgent": "no",
            "ForwardX11": "no",
            "ClearAllForwardings": "yes",
            "PermitLocalCommand": "no",
            "RequestTTY": "no",
        }
        argv = [_ssh_client(), "-T", "-e", "none", "-p", str(target.port), *extra]
        if target.user:
            argv += ["-l", target.user]
        if self.key:
            argv += ["-i", self.key, "-o", "IdentitiesOnly=yes"]
        for name, value in options.items():
            argv += ["-o", f"{name}={value}"]
        return [*argv, "--", target.host, command]

    async def acquire(self, spec: PoolSpec) -> SSHAllocation:
        """The first ``spec.nodes`` hosts serve the ranks; the others are spares that
        :meth:`SSHAllocation.replace` takes in order. Nothing is connected yet."""
        if self.accept_new_host_keys:
            os.makedirs(os.path.dirname(self.known_hosts) or ".", mode=0o700, exist_ok=True)
        return SSHAllocation(self, spec)

    async def start_one(self, target: _Target, bundle: Bundle, timeout: float) -> SSHAgent:
        """Start one host's agent; ProvisionError naming the host."""
        argv = self.ssh_argv(
            target, start_command(self.workdir, self.python, bundle.hash, len(bundle.data))
        )
        try:
            agent = SSHAgent(spawn(argv), target)
        except OSError as e:
            raise ProvisionError(f"{target.host}: cannot run ssh: {e}") from e
        ok = False
        try:
            await asyncio.wait_for(start_agent(agent, self.workdir, self.python, bundle), timeout)
        except NoAnswer as e:
            raise await self._start_error(target, e) from None
        except TimeoutError:
            raise ProvisionError(
                f"{target.host}: the agent did not start within {timeout:g} s "
                "(Options(start_timeout=...) sets the limit)"
            ) from None
        else:
            ok = True
        finally:
            if not ok:
                await agent.terminate()
        return agent

    async def _start_error(self, target: _Target, e: NoAnswer) -> ProvisionError:
        """Why ssh ended without starting the agent, as a ProvisionError naming the host."""
        host, err = target.host, e.stderr
        where = f"{host}: cannot connect over SSH (port {target.port})"
        if "REMOTE HOST IDENTIFICATION HAS CHANGED" in err:
            found = re.search(
                r"fingerprint for the (\S+) key sent by the remote host is\s+(\S+?)\.?\s", err
            )
            presented = f"{found[1]} {found[2]}" if found else "another key"
            return ProvisionError(
                f"{host}: REFUSED: the host key changed: the server presents {presented}, "
                f"which is not the key recorded for it in {self.known_hosts} (someone may be "
                "intercepting the connection, or the host was reinstalled). If the change is "
                f"expected, remove the old key with `ssh-keygen -R {_pattern(host, target.port)}"
                f" -f {self.known_hosts}` and connect again"
            )
        if "Host key verification failed" in err or "host key is known for" in err:
            presented = await self._offered_key(target)
            keyscan = f"ssh-keyscan {'-p ' + str(target.port) + ' ' if target.port != 22 else ''}"
            return ProvisionError(
                f"{host}: REFUSED: unknown host key {presented} (the host is not in "
                f"{self.known_hosts}). If this fingerprint is the host's, trust it with "
                "SSH(..., accept_new_host_keys=True), which records it, or add it with "
                f"`{keyscan}{host} >> {self.known_hosts}`"
            )
        if "Permission denied" in err:
            user = target.user or "the default user"
            how = f"the key {self.key}" if self.key else "ssh-agent or ~/.ssh/id_* keys"
            return ProvisionError(
                f"{host}: SSH authentication failed as {user} with {how} "
                f"({_last_line(err)}): check SSH(user=..., key=...) and the host's "
                "authorized_keys"
            )
        if "Could not resolve hostname" in err:
            return ProvisionError(f"{host}: unknown host name ({_last_line(err)})")
        if "timed out" in err:
            return ProvisionError(
                f"{where}: no answer within {math.ceil(self.connect_timeout)} s (is the host "
                "up and reachable? SSH(connect_timeout=...) sets the limit)"
            )
        found = re.search(r"ssh: connect to host .* port \d+: (.*)", err)
        if found:
            return ProvisionError(f"{where}: {found[1].strip()}")
        status = f"exit status {e.status}" if e.status is not None else "no exit status"
        msg = f"{host}: the start command ended without answering ({status})"
        if err.strip():
            msg += f"\n--- its stderr ---\n{err.strip()}"
        return ProvisionError(msg)

    async def _offered_key(self, target: _Target) -> str:
        """The host key ``target`` presents ("ED25519 SHA256:..."), from a second
        connection that stops at the host key check; "(fingerprint unavailable)" if none."""
        argv = self.ssh_argv(target, "true", "-v", "-o", "StrictHostKeyChecking=yes")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            _, err = await asyncio.wait_for(proc.communicate(), self.connect_timeout + 2)
        except (OSError, TimeoutError):
            return "(fingerprint unavailable)"
        found = re.search(rb"Server host key: (\S+) (\S+)", err)
        if not found:
            return "(fingerprint unavailable)"
        return f"{found[1].decode()} {found[2].decode()}"


def _ssh_client() -> str:
    """The path of OpenSSH's ``ssh``, or a ConfigurationError saying how to install it."""
    path = shutil.which("ssh")
    if path is None:
        raise ConfigurationError(
            "the SSH provider runs OpenSSH's `ssh` client, which is not on PATH: install it "
            "(apt-get install openssh-client, dnf install openssh-clients, brew install "
            "openssh)"
        )
    return path


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


def _config_path(path: str) -> str:
    """``path`` as an ssh option value: % escaped, quoted if it has spaces."""
    path = path.replace("%", "%%")
    return f'"{path}"' if any(c.isspace() for c in path) else path


def _pattern(host: str, port: int) -> str:
    """The known_hosts host pattern of ``host`` on ``port``."""
    return host if port == 22 else f"[{host}]:{port}"


def _first_line(error: BaseException) -> str:
    return str(error).strip().split("\n", 1)[0] or type(error).__name__


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


class SSHAllocation(Allocation):
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
        self._bundle: Bundle | None = None

    async def start_agent(self, machine: Machine, command: list[str]) -> AgentProcess:
        """Run the bootstrap over ssh (``command`` is the bootstrap's, not used)."""
        if self._bundle is None:
            self._bundle = await asyncio.get_running_loop().run_in_executor(None, client_bundle)
        timeout = self.spec.options.start_timeout
        return await self.provider.start_one(self.targets[machine.ident], self._bundle, timeout)

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

    async def renew(self, rank: int, reason: str, command: list[str]) -> AgentProcess:
        """The agent on the next spare host where it starts; with no spare left, on the
        same host again. A ProvisionError names every host tried and why it failed."""
        lost = self.targets[self.machines[rank].ident]
        failures: list[str] = []
        while True:
            spare = bool(self.spares)
            machine = self._put(rank, self.spares.pop(0) if spare else lost)
            try:
                agent = await self.start_agent(machine, command)
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


# -- the agent -------------------------------------------------------------------------------
_LOST = re.compile(
    rb"^(Timeout, server .* not responding|Connection to .* closed by remote host"
    rb"|client_loop: .*|Connection reset by .*|.*Broken pipe.*|packet_write_wait: .*"
    rb"|ssh_dispatch_run_fatal: .*)\.?\r?$"
)


class SSHAgent(PipeAgent):
    """An agent on a host, reached through the stdio of its ``ssh`` process.

    Stderr carries the agent's output and ssh's own messages: a lost connection is
    reported as such, the bootstrap's signal line becomes the exit status.
    """

    def __init__(self, proc: subprocess.Popen[bytes], target: _Target) -> None:
        super().__init__(proc, target.address, target.host)
        self.lost_reason = ""
        self._signal = 0
        self._partial = b""

    def start_reading(
        self,
        loop: asyncio.AbstractEventLoop,
        on_frames: FramesCallback,
        on_stderr: Callable[[bytes], None],
    ) -> None:
        def filtered(data: bytes) -> None:
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()
            kept = [self._line(line) for line in lines]
            text = b"".join(line + b"\n" for line in kept if line is not None)
            if text:
                on_stderr(text)

        super().start_reading(loop, on_frames, filtered)

    def _line(self, line: bytes) -> bytes | None:
        """What to pass on of one stderr line of the ssh process (None: nothing)."""
        if line.startswith(SIGNAL_LINE):
            with contextlib.suppress(ValueError):
                self._signal = int(line[len(SIGNAL_LINE) :])
            return None
        if line.startswith(b"Warning: Permanently added"):
            logger.warning("%s: %s", self.host, line.decode(errors="replace").strip())
            return None
        if _LOST.match(line):
            self.lost_reason = line.decode(errors="replace").strip().rstrip(".")
            return (
                f"flotilla: the SSH connection to {self.host} was lost: {self.lost_reason}".encode()
            )
        return line

    def exit_status(self) -> int | None:
        status = self.proc.poll()
        if status is not None and self._signal:
            return -self._signal
        return status
