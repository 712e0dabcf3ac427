"""The SSH provider: every node is a host reached over SSH (asyncssh).

One SSH connection per host carries everything: the bootstrap (see ``_bootstrap``) and the
agent, whose stdin/stdout are an SSH session channel. No extra port is opened.

Host keys are always verified against a known_hosts file. An unknown host is refused with
its fingerprint unless ``accept_new_host_keys=True`` (trust on first use: the key is
recorded in the file); a host whose key changed is always refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._bootstrap import MARKER, Bundle, client_bundle, start_agent
from ._errors import ConfigurationError, ProvisionError
from ._protocol import Buffer, FrameReader
from ._provider import AgentProcess, FramesCallback, PoolSpec, Provider

if TYPE_CHECKING:
    import asyncssh

logger = logging.getLogger("flotilla.ssh")

KEEPALIVE_INTERVAL = 2.0
KEEPALIVE_COUNT_MAX = 3
_PREAMBLE_LIMIT = 1 << 16  # bytes of shell noise tolerated before the bootstrap answer
_ERR_TAIL = 4096
_PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


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


def _import_asyncssh() -> Any:
    """The asyncssh module, or a ConfigurationError saying how to install it."""
    try:
        import asyncssh
    except ImportError as e:
        raise ConfigurationError(
            f"the SSH provider needs the asyncssh package ({e}): pip install 'flotilla[ssh]'"
        ) from None
    return asyncssh


# -- the provider --------------------------------------------------------------------------
class SSH(Provider):
    """Run the nodes on existing machines reached over SSH.

    Node ``i`` runs on ``hosts[i]``; a pool of N nodes uses the first N hosts. Each node
    runs the client's own flotilla version (uploaded once per version, see ``_bootstrap``)
    with the host's ``python``.

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
        connect_timeout: seconds to connect and authenticate to one host.
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
        _import_asyncssh()
        if spec.nodes > len(self.hosts):
            raise ConfigurationError(
                f"the pool asks for {spec.nodes} nodes but SSH has {len(self.hosts)} host(s): "
                f"add hosts to SSH(hosts=[...]) or lower nodes= to at most {len(self.hosts)}"
            )
        if self.key is not None and not os.path.isfile(self.key):
            raise ConfigurationError(f"SSH(key=...): no such private key file: {self.key}")

    def agent_command(self) -> list[str]:
        return [self.python, "-m", "flotilla.agent"]

    def _target(self, host: SSHHost) -> _Target:
        return _Target(
            host=host.host,
            user=host.user or self.user,
            port=host.port or self.port,
            address=host.private_addr or host.host,
        )

    async def start(self, spec: PoolSpec, command: list[str]) -> list[AgentProcess]:
        """Connect to the first ``spec.nodes`` hosts at once and start their agents.

        The agent command is the bootstrap's (``{python} -m flotilla.agent`` with the
        bundle on ``PYTHONPATH``), so ``command`` is not used. The first failure (in rank
        order among those seen together) is raised; everything started is stopped.
        """
        asyncssh = _import_asyncssh()
        loop = asyncio.get_running_loop()
        bundle = loop.run_in_executor(None, client_bundle)
        targets = [self._target(h) for h in self.hosts[: spec.nodes]]
        tasks = [
            loop.create_task(self._start_one(asyncssh, t, bundle, spec.options.start_timeout))
            for t in targets
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
            if failed or not all(t.done() for t in tasks):  # an error, or we were cancelled
                await _cancel_all(tasks)
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        return [t.result() for t in tasks]

    async def _start_one(
        self,
        asyncssh: Any,
        target: _Target,
        bundle: asyncio.Future[Bundle],
        timeout: float,
    ) -> SSHAgent:
        """Connect to one host and start its agent; ProvisionError naming the host."""
        conn = await self._connect(asyncssh, target)
        try:
            launcher = _Launcher(conn, target.host)
            try:
                stream = await asyncio.wait_for(
                    start_agent(launcher, self.workdir, self.python, await bundle), timeout
                )
            except TimeoutError:
                raise ProvisionError(
                    f"{target.host}: the agent did not start within {timeout:g} s "
                    "(Options(start_timeout=...) sets the limit)"
                ) from None
            except (OSError, asyncssh.Error) as e:
                raise ProvisionError(f"{target.host}: {_describe(e)}") from e
        except BaseException:
            conn.close()
            raise
        return SSHAgent(target, conn, stream)

    async def _connect(self, asyncssh: Any, target: _Target) -> asyncssh.SSHClientConnection:
        """Open the SSH connection to ``target``, verifying its host key."""
        policy = _HostKeyPolicy(target.host, self.known_hosts, self.accept_new_host_keys)
        options: dict[str, Any] = {
            "known_hosts": policy.load(asyncssh),
            "client_factory": _client_factory(policy),
            "connect_timeout": self.connect_timeout,
            "keepalive_interval": KEEPALIVE_INTERVAL,
            "keepalive_count_max": KEEPALIVE_COUNT_MAX,
            "encryption_algs": _encryption_algs(asyncssh),
        }
        if target.user:
            options["username"] = target.user
        if self.key:
            options["client_keys"] = [self.key]
        try:
            conn = await asyncio.wait_for(
                asyncssh.connect(target.host, target.port, **options),
                self.connect_timeout + 1.0,
            )
        except (OSError, TimeoutError, asyncssh.Error, ValueError) as e:
            raise self._connect_error(asyncssh, target, policy, e) from e
        return conn  # type: ignore[no-any-return]

    def _connect_error(
        self, asyncssh: Any, target: _Target, policy: _HostKeyPolicy, e: BaseException
    ) -> ProvisionError:
        """The connect failure of ``target`` as a ProvisionError, host first."""
        where = f"{target.host}: cannot connect over SSH (port {target.port})"
        if isinstance(e, asyncssh.HostKeyNotVerifiable):
            return ProvisionError(policy.refusal or f"{target.host}: {_describe(e)}")
        if isinstance(e, asyncssh.PermissionDenied):
            user = target.user or "the default user"
            how = f"the key {self.key}" if self.key else "ssh-agent or ~/.ssh/id_* keys"
            return ProvisionError(
                f"{target.host}: SSH authentication failed as {user} with {how} "
                f"({_describe(e)}): check SSH(user=..., key=...) and the host's authorized_keys"
            )
        if isinstance(e, TimeoutError):
            return ProvisionError(
                f"{where}: no answer within {self.connect_timeout:g} s "
                "(is the host up and reachable? SSH(connect_timeout=...) sets the limit)"
            )
        if isinstance(e, socket.gaierror):
            return ProvisionError(f"{target.host}: unknown host name ({e.strerror})")
        return ProvisionError(f"{where}: {_describe(e)}")


def _encryption_algs(asyncssh: Any) -> list[str]:
    """asyncssh's default ciphers with AES-GCM first: one AES-NI call per packet, the
    lowest latency per message (chacha20-poly1305, asyncssh's first choice, costs ~1.5x)."""
    defaults = [alg.decode() for alg in asyncssh.encryption.get_default_encryption_algs()]
    first = [alg for alg in _PREFERRED_CIPHERS if alg in defaults]
    return first + [alg for alg in defaults if alg not in first]


async def _cancel_all(tasks: list[asyncio.Task[SSHAgent]]) -> None:
    """Cancel unfinished start tasks and terminate the agents the others started."""
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    agents = [r for r in results if isinstance(r, SSHAgent)]
    await asyncio.gather(*(a.terminate() for a in agents), return_exceptions=True)


def _describe(e: BaseException) -> str:
    """A one-line description of an SSH or OS error."""
    reason = getattr(e, "reason", None)
    if isinstance(reason, str) and reason:
        return reason
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


# -- host keys -----------------------------------------------------------------------------
class _HostKeyPolicy:
    """Decides about a host key the known_hosts file does not list for the host.

    asyncssh accepts on its own the keys the file lists for the host; it asks this policy
    about any other key. A host the file lists with other keys has a changed key: refused.
    An unknown host is refused with its fingerprint, or accepted and recorded when
    ``accept_new`` (trust on first use). ``refusal`` holds the reason of a refusal.
    """

    def __init__(self, host: str, path: str, accept_new: bool) -> None:
        self.host = host
        self.path = path
        self.accept_new = accept_new
        self.refusal = ""
        self._known: Any = None
        self._asyncssh: Any = None

    def load(self, asyncssh: Any) -> Any:
        """The known_hosts file as asyncssh's SSHKnownHosts (empty if there is no file)."""
        self._asyncssh = asyncssh
        try:
            with open(self.path) as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        except OSError as e:
            raise ProvisionError(
                f"{self.host}: cannot read known_hosts {self.path}: {e.strerror}"
            ) from None
        try:
            self._known = asyncssh.import_known_hosts(text)
        except ValueError as e:
            raise ProvisionError(
                f"{self.host}: cannot parse known_hosts {self.path}: {e}"
            ) from None
        return self._known

    def decide(self, host: str, addr: str, port: int, key: Any) -> bool:
        """True to accept ``key`` (not listed for the host) from ``host`` at ``addr``."""
        fingerprint = f"{key.get_algorithm()} {key.get_fingerprint('sha256')}"
        match_port = port if port != 22 else None
        listed = self._asyncssh.match_known_hosts(self._known, host, addr, match_port)
        if listed[0] or listed[1]:  # host keys or CA keys: the host is known
            self.refusal = (
                f"{self.host}: REFUSED: the host key changed: the server presents "
                f"{fingerprint}, which is not the key recorded for it in {self.path} "
                "(someone may be intercepting the connection, or the host was reinstalled). "
                f"If the change is expected, remove the old key with "
                f"`ssh-keygen -R {_pattern(host, port)} -f {self.path}` and connect again"
            )
            return False
        if not self.accept_new:
            keyscan = f"ssh-keyscan {'-p ' + str(port) + ' ' if port != 22 else ''}{host}"
            self.refusal = (
                f"{self.host}: REFUSED: unknown host key {fingerprint} (the host is not in "
                f"{self.path}). If this fingerprint is the host's, trust it with "
                f"SSH(..., accept_new_host_keys=True), which records it, or add it with "
                f"`{keyscan} >> {self.path}`"
            )
            return False
        return self._record(host, port, key, fingerprint)

    def _record(self, host: str, port: int, key: Any, fingerprint: str) -> bool:
        """Append the key to the known_hosts file (trust on first use)."""
        algorithm, data = key.export_public_key("openssh").decode().split()[:2]
        line = f"{_pattern(host, port)} {algorithm} {data}\n"
        try:
            folder = os.path.dirname(self.path)
            if folder:
                os.makedirs(folder, mode=0o700, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:
            self.refusal = (
                f"{self.host}: cannot record its host key in {self.path} ({e.strerror}); "
                "refusing the unrecorded key"
            )
            return False
        logger.warning("%s: permanently added %s to %s", self.host, fingerprint, self.path)
        return True


def _pattern(host: str, port: int) -> str:
    """The known_hosts host pattern of ``host`` on ``port``."""
    return host if port == 22 else f"[{host}]:{port}"


def _client_factory(policy: _HostKeyPolicy) -> Callable[[], asyncssh.SSHClient]:
    """An asyncssh client class whose host-key check is ``policy``."""
    import asyncssh

    class _Client(asyncssh.SSHClient):
        def validate_host_public_key(
            self, host: str, addr: str, port: int, key: asyncssh.SSHKey
        ) -> bool:
            return policy.decide(host, addr, port, key)

    return _Client


# -- the agent's channel ---------------------------------------------------------------------
class _AgentStream:
    """One SSH session channel: the bootstrap answer, then the agent's protocol stream.

    Methods named ``on_*`` are called by the asyncssh session on the loop thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str) -> None:
        self.loop = loop
        self.host = host
        self.loop_thread = threading.get_ident()
        self.chan: asyncssh.SSHClientChannel[bytes] | None = None
        self.answer: asyncio.Future[str] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.status: int | None = None
        self.lost_reason = ""
        self.err_tail = b""
        self._preamble = bytearray()
        self._pending: list[bytes] = []
        self._err_pending: list[bytes] = []
        self._reader = FrameReader()
        self._on_frames: FramesCallback | None = None
        self._on_stderr: Callable[[bytes], None] | None = None
        self._queue: list[bytes] = []
        self._queue_lock = threading.Lock()
        self._flush_scheduled = False

    # -- events from asyncssh ----------------------------------------------------------
    def on_open(self, chan: asyncssh.SSHClientChannel[bytes]) -> None:
        self.chan = chan

    def on_data(self, data: bytes, stderr: bool) -> None:
        if stderr:
            self._stderr(data)
        elif not self.answer.done():
            self._preamble += data
            self._scan_answer()
        elif self._on_frames is not None:
            frames = self._reader.feed(data)
            if frames:
                self._on_frames(frames)
        else:
            self._pending.append(data)

    def on_exit(self, status: int) -> None:
        self.status = status

    def on_signal(self, name: str) -> None:
        number = getattr(signal, f"SIG{name}", None)
        self.status = -int(number) if number is not None else -1

    def on_close(self, exc: BaseException | None) -> None:
        if exc is not None and self.status is None:
            self.lost_reason = _describe(exc)
            self.status = 255  # what ssh(1) reports when the connection fails
            self._stderr(
                f"flotilla: the SSH connection to {self.host} was lost: "
                f"{self.lost_reason}\n".encode()
            )
        if not self.answer.done():
            self.answer.set_exception(self._no_answer())
        if not self.closed.done():
            self.closed.set_result(None)
        if self._on_frames is not None:
            self._on_frames(None)

    # -- bootstrap answer --------------------------------------------------------------
    def _scan_answer(self) -> None:
        """Look for the answer line; lines before it (shell profile noise) are dropped."""
        while True:
            end = self._preamble.find(b"\n")
            if end < 0:
                if len(self._preamble) > _PREAMBLE_LIMIT:
                    del self._preamble[: -len(MARKER)]
                return
            line = bytes(self._preamble[:end])
            del self._preamble[: end + 1]
            if line.startswith(MARKER):
                rest = bytes(self._preamble)
                self._preamble.clear()
                self.answer.set_result(line[len(MARKER) :].decode(errors="replace"))
                if rest:
                    self._pending.append(rest)
                return

    def _no_answer(self) -> ProvisionError:
        how = f" ({self.lost_reason})" if self.lost_reason else ""
        status = f"exit status {self.status}" if self.status is not None else "no exit status"
        msg = f"{self.host}: the start command ended without answering{how} ({status})"
        err = self.err_tail.decode(errors="replace").strip()
        if err:
            msg += f"\n--- its stderr ---\n{err}"
        return ProvisionError(msg)

    def _stderr(self, data: bytes) -> None:
        self.err_tail = (self.err_tail + data)[-_ERR_TAIL:]
        if self._on_stderr is not None:
            self._on_stderr(data)
        else:
            self._err_pending.append(data)

    # -- the agent side ----------------------------------------------------------------
    def start_reading(self, on_frames: FramesCallback, on_stderr: Callable[[bytes], None]) -> None:
        """Deliver what arrived so far, then every chunk as it arrives (loop thread)."""
        self._on_stderr = on_stderr
        for data in self._err_pending:
            on_stderr(data)
        self._err_pending.clear()
        self._on_frames = on_frames
        pending, self._pending = self._pending, []
        for data in pending:
            frames = self._reader.feed(data)
            if frames:
                on_frames(frames)
        if self.closed.done():
            on_frames(None)

    def write(self, parts: Sequence[Buffer]) -> None:
        """Queue ``parts`` for the channel, in call order; never waits for the loop.

        Callers hold their node's lock while writing, and the loop thread takes that lock
        when results arrive: a write that waited for the loop could deadlock. The bytes
        are copied here (the caller may reuse its buffers) and written on the loop thread
        (at once when called there). Raises BrokenPipeError when the channel is closed; a
        channel that closes later fails the node's calls through ``on_frames(None)``.
        """
        if self.closed.done():
            raise self._broken()
        data = b"".join(parts)
        with self._queue_lock:
            self._queue.append(data)
            schedule = not self._flush_scheduled
            self._flush_scheduled = True
        if threading.get_ident() == self.loop_thread:
            self._flush()
        elif schedule:
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed
                raise self._broken() from None

    def _flush(self) -> None:
        """Hand every queued write to asyncssh, in order (loop thread)."""
        with self._queue_lock:
            queued = list(self._queue)
            self._queue.clear()
            self._flush_scheduled = False
        chan = self.chan
        if chan is None or self.closed.done():
            return  # a closed channel already failed this node's calls
        try:
            for data in queued:
                chan.write(data)
        except OSError as e:  # the channel is closing: its close fails the node's calls
            logger.debug("%s: write after the channel closed: %s", self.host, e)

    def _broken(self, cause: BaseException | None = None) -> BrokenPipeError:
        why = self.lost_reason or (str(cause) if cause else "the channel is closed")
        return BrokenPipeError(f"the agent on {self.host} cannot be reached: {why}")

    def write_eof(self) -> None:
        """End the agent's stdin after what is queued (loop thread)."""
        self._flush()
        if self.chan is not None and not self.closed.done():
            with contextlib.suppress(OSError):
                self.chan.write_eof()

    def send_signal(self, name: str) -> None:
        if self.chan is not None and not self.closed.done():
            with contextlib.suppress(OSError):
                self.chan.send_signal(name)

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()


def _session_factory(stream: _AgentStream) -> Callable[[], asyncssh.SSHClientSession[bytes]]:
    """An asyncssh session class that forwards its events to ``stream``."""
    import asyncssh

    class _Session(asyncssh.SSHClientSession[bytes]):
        def connection_made(self, chan: asyncssh.SSHClientChannel[bytes]) -> None:
            stream.on_open(chan)

        def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
            stream.on_data(data, datatype == asyncssh.EXTENDED_DATA_STDERR)

        def eof_received(self) -> bool:
            return True  # stay open until the server closes: its exit status comes first

        def exit_status_received(self, status: int) -> None:
            stream.on_exit(status)

        def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
            stream.on_signal(signal)

        def connection_lost(self, exc: Exception | None) -> None:
            stream.on_close(exc)

    return _Session


class _Launcher:
    """The bootstrap's view of one SSH connection (a ``_bootstrap.Launcher``)."""

    def __init__(self, conn: asyncssh.SSHClientConnection, host: str) -> None:
        self.conn = conn
        self.host = host

    async def launch(self, command: str) -> tuple[str, str, _AgentStream]:
        stream = _AgentStream(asyncio.get_running_loop(), self.host)
        await self.conn.create_session(_session_factory(stream), command, encoding=None)
        try:
            answer = await stream.answer
        except BaseException:
            stream.close()
            raise
        return answer, stream.err_tail.decode(errors="replace"), stream

    async def run(self, command: str, stdin: bytes) -> tuple[int | None, str]:
        result = await self.conn.run(command, input=stdin, encoding=None, check=False)
        err = result.stderr or b""
        text = err.decode(errors="replace") if isinstance(err, bytes) else str(err)
        return result.exit_status, text

    async def discard(self, proc: _AgentStream) -> None:
        proc.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.closed), 2.0)


# -- the agent -------------------------------------------------------------------------------
class SSHAgent(AgentProcess):
    """An agent running on a host, its stdio being an SSH session channel."""

    def __init__(
        self, target: _Target, conn: asyncssh.SSHClientConnection, stream: _AgentStream
    ) -> None:
        self.address = target.address
        self.host = target.host
        self.conn = conn
        self.stream = stream

    def write(self, parts: Sequence[Buffer]) -> None:
        self.stream.write(parts)

    def start_reading(
        self,
        loop: asyncio.AbstractEventLoop,
        on_frames: FramesCallback,
        on_stderr: Callable[[bytes], None],
    ) -> None:
        self.stream.start_reading(on_frames, on_stderr)

    async def wait(self, timeout: float) -> int | None:
        try:
            await asyncio.wait_for(asyncio.shield(self.stream.closed), timeout)
        except TimeoutError:
            return None
        return self.stream.status

    def exit_status(self) -> int | None:
        return self.stream.status

    async def terminate(self) -> None:
        """End of stdin (the agent stops its executor and exits), then TERM, then KILL."""
        stream = self.stream
        if not stream.closed.done():
            stream.write_eof()
            if await self.wait(2.0) is None:
                stream.send_signal("TERM")
                if await self.wait(1.5) is None:
                    stream.send_signal("KILL")
                    stream.close()
                    await self.wait(1.0)
        self.conn.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.wait_closed(), 2.0)
