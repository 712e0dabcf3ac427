"""OpenSSH as a remote shell: the ``ssh`` command line, its failures explained, its agent.

One ``ssh`` process per machine, one connection: it runs the bootstrap command, which
becomes the agent, and its stdin/stdout are the protocol channel. The SSH provider uses it
for its hosts, the AWS provider for its instances (its own key and pinned known_hosts).

Host keys are always verified (``StrictHostKeyChecking=yes``) against a known_hosts file.
An unknown host is refused with its fingerprint unless ``accept_new_host_keys`` (trust on
first use, ``accept-new``: the key is recorded in the file); a host whose key changed is
always refused. Options that would weaken this or leave something behind (agent and X11
forwarding, connection sharing with a lingering master) are turned off on the command line,
which takes precedence over any configuration file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from .._errors import ConfigurationError, ProvisionCause, ProvisionError
from .base import Machine
from .bootstrap import SIGNAL_LINE, NoAnswer
from .launch import RemoteShell
from .pipe import PipeAgent

logger = logging.getLogger("flotilla.ssh")

KEEPALIVE_INTERVAL = 2
KEEPALIVE_COUNT_MAX = 3
STARTS_PER_SERVER = 8
"""Agents started at once through one sshd (host and port): below the ten unauthenticated
connections past which sshd's default ``MaxStartups`` (10:30:100) starts dropping them."""
_DROPPED = re.compile(
    r"kex_exchange_identification|banner exchange|Connection (reset|closed) by \S+ port \d+"
)
"""What ssh says when sshd drops a connection before authentication (``MaxStartups``)."""


@dataclass(frozen=True)
class Target:
    """Where ``ssh`` connects for one machine.

    Attributes:
        host: host name or address to connect to.
        user: login user (None: SSH's default).
        port: SSH port.
    """

    host: str
    user: str | None
    port: int


REFUSALS = (
    "REMOTE HOST IDENTIFICATION HAS CHANGED",
    "Host key verification failed",
    "host key is known for",
    "Permission denied",
    "Could not resolve hostname",
)
"""What ssh says when trying again cannot help: another host key, a refused login, an
unknown name (``SSHShell.explain``'s IDENTITY, AUTH and UNKNOWN_HOST causes)."""


@dataclass(eq=False, repr=False)
class SSHShell(RemoteShell):
    """``ssh`` to a machine's :class:`Target`.

    Attributes:
        target: the target of a machine.
        key: private key file (None: ssh-agent and ``~/.ssh/id_*``).
        known_hosts: the known_hosts file host keys are checked against.
        accept_new_host_keys: trust on first use (see the module docstring).
        connect_timeout: seconds to connect and authenticate (rounded up for ssh).
        unknown_key_advice: how to trust an unknown host key, in its error.
    """

    name = "ssh"

    target: Callable[[Machine], Target]
    _: KW_ONLY
    key: str | None
    known_hosts: str
    accept_new_host_keys: bool
    connect_timeout: float
    unknown_key_advice: str = "SSH(..., accept_new_host_keys=True), which records it"
    _starting: dict[tuple[str, int], asyncio.Semaphore] = field(default_factory=dict, init=False)

    def pace(self, machine: Machine) -> asyncio.Semaphore:
        """At most :data:`STARTS_PER_SERVER` agents start through one sshd at once."""
        target = self.target(machine)
        key = (target.host, target.port)
        if key not in self._starting:
            self._starting[key] = asyncio.Semaphore(STARTS_PER_SERVER)
        return self._starting[key]

    def transient(self, failure: NoAnswer) -> bool:
        """sshd dropped the connection before authentication: too many starting."""
        return bool(_DROPPED.search(failure.stderr))

    def argv(self, machine: Machine, command: list[str]) -> list[str]:
        return self.ssh_argv(self.target(machine), "exec " + shlex.join(command))

    def ssh_argv(self, target: Target, command: str, *extra: str) -> list[str]:
        """The ``ssh`` command line that runs the shell command ``command`` on ``target``."""
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
        argv = [ssh_client(), "-T", "-e", "none", "-p", str(target.port), *extra]
        if target.user:
            argv += ["-l", target.user]
        if self.key:
            argv += ["-i", self.key, "-o", "IdentitiesOnly=yes"]
        for name, value in options.items():
            argv += ["-o", f"{name}={value}"]
        return [*argv, "--", target.host, command]

    def agent(self, proc: subprocess.Popen[bytes], machine: Machine) -> PipeAgent:
        return SSHAgent(proc, machine.address, machine.host)

    async def explain(self, machine: Machine, failure: NoAnswer) -> ProvisionError:
        """Why ssh ended without starting the agent: its stderr read once, here."""
        target = self.target(machine)
        host, err = machine.host, failure.stderr
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
                "expected, remove the old key with `ssh-keygen -R "
                f"{_pattern(target.host, target.port)} -f {self.known_hosts}` and connect again",
                cause=ProvisionCause.IDENTITY,
            )
        if "Host key verification failed" in err or "host key is known for" in err:
            presented = await self._offered_key(target)
            keyscan = f"ssh-keyscan {'-p ' + str(target.port) + ' ' if target.port != 22 else ''}"
            return ProvisionError(
                f"{host}: REFUSED: unknown host key {presented} (the host is not in "
                f"{self.known_hosts}). If this fingerprint is the host's, trust it with "
                f"{self.unknown_key_advice}, or add it with "
                f"`{keyscan}{target.host} >> {self.known_hosts}`",
                cause=ProvisionCause.IDENTITY,
            )
        if "Permission denied" in err:
            user = target.user or "the default user"
            how = f"the key {self.key}" if self.key else "ssh-agent or ~/.ssh/id_* keys"
            return ProvisionError(
                f"{host}: SSH authentication failed as {user} with {how} "
                f"({_last_line(err)}): check SSH(user=..., key=...) and the host's "
                "authorized_keys",
                cause=ProvisionCause.AUTH,
            )
        if "Could not resolve hostname" in err:
            return ProvisionError(
                f"{host}: unknown host name ({_last_line(err)})",
                cause=ProvisionCause.UNKNOWN_HOST,
            )
        if "timed out" in err:
            return ProvisionError(
                f"{where}: no answer within {math.ceil(self.connect_timeout)} s (is the host "
                "up and reachable? SSH(connect_timeout=...) sets the limit)",
                cause=ProvisionCause.UNREACHABLE,
            )
        found = re.search(r"ssh: connect to host .* port \d+: (.*)", err)
        if found:
            return ProvisionError(f"{where}: {found[1].strip()}", cause=ProvisionCause.UNREACHABLE)
        status = f"exit status {failure.status}" if failure.status is not None else "no exit status"
        msg = f"{host}: the start command ended without answering ({status})"
        if err.strip():
            msg += f"\n--- its stderr ---\n{err.strip()}"
        return ProvisionError(msg, cause=ProvisionCause.NO_ANSWER)

    async def _offered_key(self, target: Target) -> str:
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
            async with asyncio.timeout(self.connect_timeout + 2):
                _, err = await proc.communicate()
        except (OSError, TimeoutError):
            return "(fingerprint unavailable)"
        found = re.search(rb"Server host key: (\S+) (\S+)", err)
        if not found:
            return "(fingerprint unavailable)"
        return f"{found[1].decode()} {found[2].decode()}"


def ssh_client() -> str:
    """The path of OpenSSH's ``ssh``, or a ConfigurationError saying how to install it."""
    path = shutil.which("ssh")
    if path is None:
        raise ConfigurationError(
            "the SSH provider runs OpenSSH's `ssh` client, which is not on PATH: install it "
            "(apt-get install openssh-client, dnf install openssh-clients, brew install "
            "openssh)"
        )
    return path


def _config_path(path: str) -> str:
    """``path`` as an ssh option value: % escaped, quoted if it has spaces."""
    path = path.replace("%", "%%")
    return f'"{path}"' if any(c.isspace() for c in path) else path


def _pattern(host: str, port: int) -> str:
    """The known_hosts host pattern of ``host`` on ``port``."""
    return host if port == 22 else f"[{host}]:{port}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# -- the agent -------------------------------------------------------------------------------
_LOST = re.compile(
    rb"^(Timeout, server .* not responding|Connection to .* closed by remote host"
    rb"|client_loop: .*|Connection reset by .*|.*Broken pipe.*|packet_write_wait: .*"
    rb"|ssh_dispatch_run_fatal: .*)\.?\r?$"
)


SIGNAL_LINE_WAIT = 10.0
"""Seconds an agent's exit status waits, once its ssh exited, for the end of its stderr
(which brings the signal line of an agent killed by a signal)."""


class SSHAgent(PipeAgent):
    """An agent on a host, reached through the stdio of its ``ssh`` process.

    Stderr carries the agent's output and ssh's own messages: a lost connection is
    reported as such, the bootstrap's signal line becomes the exit status.
    """

    def __init__(self, proc: subprocess.Popen[bytes], address: str, host: str) -> None:
        super().__init__(proc, address, host)
        self._signal = 0
        self._partial = b""
        self._exited_at: float | None = None  # when exit_status first saw ssh exited
        self.stderr_filters.append(self._lines)

    def _lines(self, data: bytes) -> bytes:
        """What to pass on of a piece of the ssh process's stderr: its whole lines, each as
        :meth:`_line` says (a partial line waits for its end)."""
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        kept = [self._line(line) for line in lines]
        return b"".join(line + b"\n" for line in kept if line is not None)

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
        """The agent's exit status, negative for the signal that killed it (the start
        command's signal line on stderr); None while it runs, and while its ssh has exited
        but the stderr that may still bring that line has not ended (at most
        ``SIGNAL_LINE_WAIT`` more: a loaded machine reads it late)."""
        status = self.proc.poll()
        if status is None:
            return None
        if not self._signal and self._err_ended is not None and not self._err_ended.done():
            now = time.monotonic()
            if self._exited_at is None:
                self._exited_at = now
            if now - self._exited_at < SIGNAL_LINE_WAIT:
                return None
        return -self._signal if self._signal else status
