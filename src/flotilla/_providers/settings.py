"""The settings of the local and SSH providers (SLURM's and AWS's are in their packages):
frozen objects, checked when made (before anything starts), that the providers read and the
command line derives its flags from. Light to import."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from .._errors import ConfigurationError, check_number, check_text
from .options import option

SSH_KNOWN_HOSTS = "~/.ssh/known_hosts"


@dataclass(frozen=True)
class LocalSettings:
    """Where the local provider runs its nodes.

    Attributes:
        python: interpreter for the agents (default: ``sys.executable``).
        workdir: parent folder of the nodes' working directories (default: a temp dir).
        keep_folders: name the nodes' folders ``node0``, ``node1``... in ``workdir`` and
            keep them when the pool closes: a later pool with the same ``workdir`` finds
            what the nodes left there (``flotilla stop`` / ``start``).
    """

    python: str | None = None
    workdir: str | None = None
    keep_folders: bool = False

    def __post_init__(self) -> None:
        for key in ("python", "workdir"):
            value = getattr(self, key)
            check_text(value, f"Local({key}=...) must be a non-empty string or None", or_none=True)
        if self.keep_folders and self.workdir is None:
            raise ConfigurationError("Local(keep_folders=True) needs workdir=...: where they stay")


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
    check_text(text, f"an SSH host must be a non-empty string, got {text!r}")
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


def _host_list(text: str) -> tuple[str, ...]:
    """``--hosts a,user@b:2222``: the hosts, head first."""
    return tuple(h.strip() for h in text.split(",") if h.strip())


def _check_port(port: object, what: str) -> None:
    message = f"{what} must be a TCP port number (1-65535), got {port!r}"
    check_number(port, message, whole=True, above=0, below=65536)


@dataclass(frozen=True)
class SSHSettings:
    """How the SSH provider reaches its hosts; checked when made.

    Attributes:
        hosts: the hosts, in rank order: ``"user@host:port"`` strings or :class:`SSHHost`
            objects (strings are parsed).
        user: default login user (default: SSH's, usually the local user name).
        port: default SSH port.
        key: private key file (default: ssh-agent and ``~/.ssh/id_*``).
        known_hosts: known_hosts file that host keys are checked against
            (default: ``~/.ssh/known_hosts``).
        accept_new_host_keys: trust on first use: accept a host that is not in
            ``known_hosts`` and record its key there. A changed key is always refused.
        python: interpreter on the hosts, of the client's Python minor version (default:
            ``python3``, or, when that is another minor version, one found on the host;
            see docs/guide.md, "Python on the nodes"). Given, it is only checked.
        workdir: directory on the hosts for flotilla's files and the agents' working
            directory; ``~`` is the login user's home.
        connect_timeout: seconds to connect and authenticate to one host (whole seconds
            for ssh; a fraction is rounded up).
    """

    hosts: Sequence[str | SSHHost] | str | SSHHost = option((), flag="--hosts", parse=_host_list)
    user: str | None = None
    port: int = 22
    key: str | os.PathLike[str] | None = option(None, parse=os.path.abspath)
    known_hosts: str | os.PathLike[str] | None = option(
        SSH_KNOWN_HOSTS, flag="--known-hosts", parse=os.path.abspath
    )
    accept_new_host_keys: bool = option(False, flag="--accept-new-host-keys")
    python: str | None = None
    workdir: str = "~/.flotilla"
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        hosts = [self.hosts] if isinstance(self.hosts, str | SSHHost) else self.hosts
        parsed = tuple(h if isinstance(h, SSHHost) else parse_host(h) for h in hosts)
        if not parsed:
            raise ConfigurationError("SSH(hosts=...) needs at least one host")
        _check_port(self.port, "SSH(port=...)")
        timeout = self.connect_timeout
        check_number(timeout, f"connect_timeout must be a number, got {timeout!r}")
        check_number(timeout, f"connect_timeout must be positive, got {timeout!r}", above=0)
        if (self.python is not None and not self.python.strip()) or not self.workdir.strip():
            raise ConfigurationError("SSH(python=..., workdir=...) must not be empty")
        object.__setattr__(self, "hosts", parsed)
        if self.key is not None:
            object.__setattr__(self, "key", os.path.expanduser(os.fspath(self.key)))
        known = SSH_KNOWN_HOSTS if self.known_hosts is None else self.known_hosts
        object.__setattr__(self, "known_hosts", os.path.expanduser(os.fspath(known)))
        object.__setattr__(self, "connect_timeout", float(timeout))

    @property
    def key_file(self) -> str | None:
        """``key`` as a path (``~`` expanded when the settings were made)."""
        return None if self.key is None else os.fspath(self.key)

    @property
    def known_hosts_file(self) -> str:
        """``known_hosts`` as a path (``~`` expanded when the settings were made)."""
        return os.fspath(self.known_hosts or SSH_KNOWN_HOSTS)


# -- the provider --------------------------------------------------------------------------
