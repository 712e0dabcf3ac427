"""Cloud instance duties of a node: the power-off watchdog and the spot interruption poller.

A cloud provider asks for them by setting ``FLOTILLA_CLOUD`` (JSON, see :class:`Config`) in
the agent's environment. The agent then calls :func:`start` once and :meth:`Contact.touch`
whenever a frame from the client arrives. :func:`start` forks a helper (a fork of the
agent, as it starts: no interpreter of its own to start, which cost an instance's start
about as much CPU as the agent itself), which

* forks the **watchdog**, a daemon (own session, no inherited descriptors) that outlives
  the agent and runs the power-off command ``ttl`` seconds after the last contact from the
  client: the modification time of the contact file, which the agent touches (:func:`mark`
  makes a removed file again; the watchdog counts a missing file as no contact, keeping
  the last time it saw). One watchdog per instance (a lock file, which it makes again if
  removed: the boot guard looks for it): a second agent on the instance shares it. With
  the instance's shutdown behaviour "terminate", power-off ends the instance and its
  billing;
* then polls the instance metadata service (EC2's IMDSv2: a token, then
  ``spot/instance-action``; Compute Engine's, whose URL ends in ``/computeMetadata/v1``:
  ``instance/preempted`` until it says ``TRUE``) until the agent ends (it watches the
  agent's pidfd, see :class:`Agent`), and on an interruption notice writes one line to its
  stderr, which is the agent's, so it reaches the client on the agent's stderr stream::

      FLOTILLA_CLOUD NOTICE {"action": "terminate", "time": "2026-11-23T19:00:00Z"}

Standard library only (it runs on the node).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import sys
import time

from .._system import fastjson as json
from .._wire.protocol import CLOUD_ENV as ENV
from .._wire.protocol import CLOUD_NOTICE as NOTICE

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # (typeshed has no _signal: signal's names, its types)
    from typing import Any
else:
    import _signal  # signal.py's C module: the same calls and SIG* ints, without its enums

_TOKEN_TTL = 21600


class Config:
    """What a cloud provider asks of a node. (A plain class: a dataclass would import
    ``dataclasses``, with ``inspect``, ~8 ms of a cloud node's start.)

    Attributes:
        contact: the contact file (per instance); its mtime is the last client contact.
        ttl: seconds after the last contact when the watchdog powers off (0: no watchdog).
        poweroff: the power-off command (argv).
        imds: base URL of the instance metadata service ("" for no interruption poller).
        poll: seconds between two metadata polls.
        retry: seconds before a power-off command that failed (exit status not 0: the
            API throttled, say) is run again; the instance still runs, and costs.
    """

    __slots__ = ("contact", "imds", "poll", "poweroff", "retry", "ttl")

    def __init__(
        self,
        contact: str,
        ttl: float,
        poweroff: tuple[str, ...],
        imds: str = "",
        poll: float = 2.0,
        retry: float = 60.0,
    ) -> None:
        self.contact, self.ttl, self.poweroff = contact, ttl, poweroff
        self.imds, self.poll, self.retry = imds, poll, retry

    @staticmethod
    def from_json(text: str) -> Config:
        raw: dict[str, Any] = json.loads(text)
        return Config(
            contact=os.path.expanduser(str(raw["contact"])),
            ttl=float(raw.get("ttl", 0)),
            poweroff=tuple(raw.get("poweroff", ())),
            imds=str(raw.get("imds", "")),
            poll=float(raw.get("poll", 2.0)),
            retry=float(raw.get("retry", 60.0)),
        )


def mark(path: str, when: float | None = None) -> None:
    """Set the contact file's time to ``when`` (None: now), making the file (and its
    folder) if it is not there: through its descriptor, so a file removed meanwhile (by
    hand, a cleanup, a boot guard's stale-file removal) is made again at the next contact,
    never an error or a contact lost."""
    times = None if when is None else (when, when)
    try:
        os.utime(path, times)
        return
    except FileNotFoundError:
        pass
    fd = _made(path)
    try:
        os.utime(fd, times)
    finally:
        os.close(fd)


def _made(path: str) -> int:
    """A write descriptor of ``path``, made (0600, its folder 0700) if it is not there:
    the contact file's and the watchdog's lock file's one way to be made again."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)


class Contact:
    """The agent's side: touches the contact file, at most once per ``every`` seconds.

    A cluster's agent whose client is gone (it waits for a new one, ``agent._detach``)
    moves the watchdog's deadline instead (:meth:`hold`): the instance lives exactly as
    long as the agent waits, whatever ``ttl`` is, and powers off as the wait ends unless a
    client re-attached (then :meth:`renew`: ``ttl`` after each contact again)."""

    def __init__(self, path: str, every: float, ttl: float = 0.0) -> None:
        self.path = path
        self.every = every
        self.ttl = ttl
        self.last = time.monotonic()

    def touch(self, now: float) -> None:
        if now - self.last >= self.every:
            self.last = now
            with contextlib.suppress(OSError):
                mark(self.path)

    def hold(self, seconds: float) -> None:
        """The watchdog powers off ``seconds`` from now (0: at once), no contact coming
        meanwhile: the contact file's time becomes ``now + seconds - ttl``."""
        when = time.time() + seconds - self.ttl
        with contextlib.suppress(OSError):
            mark(self.path, when)

    def renew(self) -> None:
        """A client is there again: the last contact is now."""
        self.last = -self.every
        self.touch(time.monotonic())


def start() -> Contact | None:
    """Start the watchdog and the poller if ``FLOTILLA_CLOUD`` asks for them (the variable
    is removed from the agent's environment: task processes do not inherit it). Called by
    the agent as it starts, while it runs one thread and before it marks its processes
    with its token: the helper is a fork of it (:func:`_helper`), which the token does not
    mark (the watchdog outlives the agent on purpose)."""
    text = os.environ.pop(ENV, None)
    if not text:
        return None
    config = Config.from_json(text)
    mark(config.contact)
    armed, tell = os.pipe()
    agent = os.getpid()
    try:
        pid = os.fork()
    except OSError as e:  # the agent still serves the pool; the client releases it
        print(f"flotilla agent: cannot start the instance watchdog: {e}", file=sys.stderr)
        pid = -1
    if pid == 0:
        try:
            os.close(armed)
            _helper(config, tell, agent)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(0)
    os.close(tell)
    if config.ttl > 0 and not _wait_armed(armed):
        print(
            "flotilla agent: the instance watchdog did not start: this instance will not "
            "end by itself if the client dies (its on-start guard still ends it)",
            file=sys.stderr,
        )
    os.close(armed)
    every = min(5.0, config.ttl / 10) if config.ttl > 0 else 3600.0
    return Contact(config.contact, every, config.ttl)


_ARM_TIMEOUT = 30.0
"""Seconds the agent waits for the watchdog to say it holds its lock (so that the agent
never serves a client before the watchdog is in charge: a client killed at once still
leaves an instance that ends)."""


def _wait_armed(fd: int) -> bool:
    """Whether the watchdog said it is in charge (one byte) within ``_ARM_TIMEOUT`` s."""
    deadline = time.monotonic() + _ARM_TIMEOUT
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                return os.read(fd, 1) == b"1"  # b"": it ended without a word
            except InterruptedError:
                continue
    return False


def _say_armed(fd: int) -> None:
    if fd >= 0:
        try:
            os.write(fd, b"1")
            os.close(fd)
        except OSError:
            pass


# -- the watchdog ----------------------------------------------------------------------------
def watchdog(config: Config, armed: int = -1) -> None:
    """Run ``config.poweroff`` ``config.ttl`` s after the contact file's last modification.
    Returns at once when another watchdog holds the instance's lock (it is in charge).
    ``armed``: a descriptor to write ``1`` on (and close) once a watchdog is in charge."""
    path = config.contact + ".lock"
    lock = _lock(path)
    _say_armed(armed)
    if lock is None:
        return
    last = time.time()  # the agent marked the contact just before it started this process
    while True:
        if not os.path.exists(path):  # removed under it: the boot guard looks for it
            # (a missing one is "no agent started" to it, and it powers the instance off)
            try:
                again = _lock(path)
            except OSError:  # cannot be made now: the one held is kept, the next check tries
                pass
            else:
                os.close(lock)
                if again is None:  # a watchdog started since then holds the new one
                    return
                lock = again
        # a contact file that is gone (removed under it) is no contact: the last time seen
        # still counts, and the agent's next contact makes the file again (mark)
        with contextlib.suppress(OSError):
            last = os.stat(config.contact).st_mtime
        left = last + config.ttl - time.time()
        if left <= 0:
            _log(config, f"no contact from the client since {last:.3f}: {config.poweroff}")
            if _power_off(config):
                return
            time.sleep(config.retry)  # the instance still runs (and costs): try again
            continue
        time.sleep(min(left, 5.0) + 0.01)


def _lock(path: str) -> int | None:
    """The watchdog's lock file (made if it is not there) locked, held until the process
    ends (its descriptor); None when another watchdog holds it (that one is in charge).
    OSError when it cannot be made."""
    fd = _made(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _power_off(config: Config) -> bool:
    """Run the power-off command; whether it succeeded (exit status 0)."""
    import subprocess  # (the watchdog's, when it fires: not at every agent's start)

    try:
        code = subprocess.run(list(config.poweroff), stdin=subprocess.DEVNULL).returncode
    except OSError as e:
        _log(config, f"cannot run the power-off command: {e}")
        return False
    if code != 0:
        _log(config, f"the power-off command failed (exit status {code}): trying again")
    return code == 0


def _log(config: Config, message: str) -> None:
    try:
        with open(config.contact + ".log", "a") as f:
            f.write(f"{time.time():.3f} watchdog: {message}\n")
    except OSError:
        pass


def _daemonize() -> bool:
    """Fork a daemon (new session, stdio on /dev/null); True in the daemon."""
    if os.fork():
        os.wait()
        return False
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    return True


# -- the interruption poller -----------------------------------------------------------------
def poll_interruptions(config: Config, agent: Agent | None = None) -> None:
    """Poll IMDSv2 until an interruption notice comes; announce it on stderr, once.
    ``agent``: return as soon as it ended (None: never)."""
    if config.imds.rstrip("/").endswith(GCE_METADATA):
        return poll_preemption(config, agent)
    token = ""
    expires = 0.0
    while True:
        now = time.monotonic()
        try:
            if not token or now >= expires:
                token = _request(
                    f"{config.imds}/latest/api/token",
                    "PUT",
                    {"X-aws-ec2-metadata-token-ttl-seconds": str(_TOKEN_TTL)},
                )
                expires = now + _TOKEN_TTL - 60
            body = _request(
                f"{config.imds}/latest/meta-data/spot/instance-action",
                "GET",
                {"X-aws-ec2-metadata-token": token},
            )
        except HTTPStatus as e:
            if e.code == 401:
                token = ""  # expired: get another
        except (OSError, ValueError):
            pass  # metadata service unreachable: keep trying
        else:
            try:
                notice = json.loads(body)
            except ValueError:
                notice = {"action": body.strip()}
            os.write(2, NOTICE + json.dumps(notice).encode() + b"\n")
            return
        if _ended(agent, config.poll):
            return


GCE_METADATA = "/computeMetadata/v1"


def poll_preemption(config: Config, agent: Agent | None = None) -> None:
    """Poll Compute Engine's metadata server until ``instance/preempted`` is ``TRUE`` (a
    SPOT instance being taken back); announce it on stderr, once. ``agent``: return as
    soon as it ended (None: never)."""
    url = f"{config.imds.rstrip('/')}/instance/preempted"
    while True:
        try:
            said = _request(url, "GET", {"Metadata-Flavor": "Google"})
        except (OSError, ValueError):
            said = ""  # metadata server unreachable: keep trying
        if said.strip().upper() == "TRUE":
            notice = {
                "action": "preempt",
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            os.write(2, NOTICE + json.dumps(notice).encode() + b"\n")
            return
        if _ended(agent, config.poll):
            return


def _ended(agent: Agent | None, seconds: float) -> bool:
    """Wait ``seconds``, or less when ``agent`` ends meanwhile: whether it ended."""
    if agent is None:
        time.sleep(seconds)
        return False
    return agent.ended(seconds)


class Agent:
    """The helper's agent, watched through its pidfd (readable once it ended; Linux 5.3+),
    or where there is none by asking every second whether it is still the helper's
    parent: the helper ends with its agent without ``PR_SET_PDEATHSIG``, whose one way
    from Python is ``ctypes`` (~3-5 ms of CPU to import, per instance start). It ends
    within one metadata request (at most 2 s) after the agent, instead of at once."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = -1
        with contextlib.suppress(OSError, AttributeError):
            self.fd = os.pidfd_open(pid)

    def gone(self) -> bool:
        """Whether the agent is no longer this process's parent (it ended; checked once
        the pidfd is open, which then names the agent if it is not gone)."""
        return os.getppid() != self.pid

    def ended(self, seconds: float | None) -> bool:
        """Wait up to ``seconds`` (None: until it ends): whether the agent ended."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while deadline is None or (left := deadline - time.monotonic()) > 0:
            step = None if deadline is None else left
            if self.fd >= 0:
                if select.select([self.fd], [], [], step)[0]:
                    return True
            else:
                time.sleep(1.0 if step is None else min(step, 1.0))
                if self.gone():
                    return True
        return False


class HTTPStatus(OSError):
    """A metadata service's answer that is not 2xx (``code``: its status)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"HTTP status {code}")
        self.code = code


def _request(url: str, method: str, headers: dict[str, str], timeout: float = 2.0) -> str:
    """The body of the answer to one HTTP/1.0 request to a metadata service (plain HTTP to
    an address of the instance's own link: ``http://HOST[:PORT]/PATH``, HOST an IPv6
    address in brackets): HTTPStatus when its status is not 2xx, OSError or ValueError
    when it cannot be reached or answers something else. On a bare socket: ``urllib``'s
    HTTP client costs ~27 ms of CPU to import, which every spot instance's start paid; and
    ``_socket``'s, not ``socket``'s, whose import makes its enums (~3 ms of the helper's
    first poll: the agent it is forked from does without it, see ``agent.free_port_block``)."""
    import _socket

    if not url.startswith("http://"):
        raise ValueError(f"not an http:// URL: {url}")
    where, slash, path = url[len("http://") :].partition("/")
    host, port = where, 80
    if where.startswith("["):
        host, _, rest = where[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else 80
    elif ":" in where:
        host, _, number = where.rpartition(":")
        port = int(number)
    lines = [f"{method} {slash}{path or ''} HTTP/1.0", f"Host: {where}", "Content-Length: 0"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append("Connection: close")
    answer = bytearray()
    deadline = time.monotonic() + timeout  # for the whole answer, not per read
    # an IPv6 address comes in brackets; an IPv4 one or a name (metadata.google.internal,
    # resolved as connect does) is IPv4's, as every metadata service answers
    family = _socket.AF_INET6 if ":" in host else _socket.AF_INET
    conn = _socket.socket(family, _socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect((host, port))
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        while len(answer) < (1 << 20) and _body(answer) is None:  # (whole: no wait for EOF)
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            part = conn.recv(65536)
            if not part:
                break
            answer += part
    finally:
        conn.close()
    head, sep, _ = bytes(answer).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/") or not status[1].isdigit():
        raise ValueError(f"not an HTTP answer from {url}: {bytes(answer[:80])!r}")
    code = int(status[1])
    if not 200 <= code < 300:
        raise HTTPStatus(code)
    body = _body(answer, ended=True)
    if body is None:
        raise ValueError(f"the answer from {url} ended early: {bytes(answer[-80:])!r}")
    return body.decode(errors="replace")


def _body(answer: bytes | bytearray, ended: bool = False) -> bytes | None:
    """The body of the HTTP answer ``answer`` once it is whole, else None (its headers,
    its ``Content-Length`` bytes, or its chunks, are not all there). A server may keep
    the connection open after a whole answer, and one that ends early (``ended``: the
    connection closed) is no answer: the caller then tries again, not a truncated
    notice."""
    head, sep, rest = bytes(answer).partition(b"\r\n\r\n")
    if not sep:
        return None
    fields: dict[bytes, bytes] = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip().lower()
    if b"chunked" in fields.get(b"transfer-encoding", b""):
        body = bytearray()
        while True:
            size, crlf, rest = rest.partition(b"\r\n")
            if not crlf:
                return None
            n = int(size.split(b";")[0], 16)  # (ValueError: not HTTP)
            if n == 0:
                return bytes(body)
            if len(rest) < n + 2:
                return None
            body += rest[:n]
            rest = rest[n + 2 :]
    length = fields.get(b"content-length")
    if length is not None:
        n = int(length)  # (ValueError: not HTTP)
        return rest[:n] if len(rest) >= n else None
    return rest if ended else None  # the answer ends with the connection


def _helper(config: Config, armed: int, agent: int) -> None:
    """The agent's fork (:func:`start`): the watchdog, forked first as a daemon (the agent
    may die meanwhile; it says on ``armed`` when it is in charge), then the interruption
    poller, which ends with the agent (``agent``: its pid). It keeps the agent's stderr
    (an interruption notice goes there) and nothing else of it: stdin and stdout on
    /dev/null, every other descriptor closed, signals as in a new process."""
    for sig in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP, _signal.SIGCHLD):
        _signal.signal(sig, _signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    keep = os.dup2(armed, 3, inheritable=False) if armed != 3 else 3
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(4, 1024))
    for fd in fds:
        if fd > 3:
            with contextlib.suppress(OSError):
                os.close(fd)
    if config.ttl > 0 and _daemonize():  # first: the agent may die meanwhile
        watchdog(config, keep)
        os._exit(0)
    os.close(keep)
    watched = Agent(agent)
    if watched.gone():  # it died before the helper watched it
        return
    if config.imds:
        poll_interruptions(config, watched)
    else:
        watched.ended(None)  # nothing to poll: end with the agent
