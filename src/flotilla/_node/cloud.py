"""Cloud instance duties of a node: the power-off watchdog and the spot interruption poller.

A cloud provider asks for them by setting ``FLOTILLA_CLOUD`` (JSON, see :class:`Config`) in
the agent's environment. The agent then calls :func:`start` once and :meth:`Contact.touch`
whenever a frame from the client arrives. :func:`start` runs ``python -m
flotilla._node.cloud``, which

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
  ``instance/preempted`` until it says ``TRUE``) until the agent ends (it dies with it),
  and on an interruption notice writes one line to its stderr, which is the agent's, so it
  reaches the client on the agent's stderr stream::

      FLOTILLA_CLOUD NOTICE {"action": "terminate", "time": "2026-11-23T19:00:00Z"}

Standard library only (it runs on the node).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from .._system.procs import die_with_parent
from .._wire.protocol import CLOUD_ENV as ENV
from .._wire.protocol import CLOUD_NOTICE as NOTICE

_TOKEN_TTL = 21600


@dataclass(frozen=True)
class Config:
    """What a cloud provider asks of a node.

    Attributes:
        contact: the contact file (per instance); its mtime is the last client contact.
        ttl: seconds after the last contact when the watchdog powers off (0: no watchdog).
        poweroff: the power-off command (argv).
        imds: base URL of the instance metadata service ("" for no interruption poller).
        poll: seconds between two metadata polls.
        retry: seconds before a power-off command that failed (exit status not 0: the
            API throttled, say) is run again; the instance still runs, and costs.
    """

    contact: str
    ttl: float
    poweroff: tuple[str, ...]
    imds: str = ""
    poll: float = 2.0
    retry: float = 60.0

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
    is removed from the agent's environment: task processes do not inherit it)."""
    text = os.environ.pop(ENV, None)
    if not text:
        return None
    config = Config.from_json(text)
    mark(config.contact)
    armed, tell = os.pipe()
    try:
        subprocess.Popen(
            [sys.executable, "-m", "flotilla._node.cloud"],
            env={**os.environ, ENV: text, _ARMED_FD: str(tell), _AGENT: str(os.getpid())},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(tell,),
        )
    except OSError as e:  # the agent still serves the pool; the client releases it
        print(f"flotilla agent: cannot start the instance watchdog: {e}", file=sys.stderr)
    finally:
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


_ARMED_FD = "FLOTILLA_CLOUD_ARMED"
"""The helper's environment: the descriptor on which the watchdog says it holds its lock
(so the agent never serves a client before the watchdog is in charge: a client killed
at once still leaves an instance that ends)."""
_ARM_TIMEOUT = 30.0
_AGENT = "FLOTILLA_CLOUD_AGENT"
"""The helper's environment: the agent's pid (the helper ends with it, also when the agent
died before the helper got to check: its parent is then already another process)."""


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


def _say_armed() -> None:
    fd = os.environ.pop(_ARMED_FD, "")
    if fd.isdigit():
        try:
            os.write(int(fd), b"1")
            os.close(int(fd))
        except OSError:
            pass


# -- the watchdog ----------------------------------------------------------------------------
def watchdog(config: Config, log: Any = None) -> None:
    """Run ``config.poweroff`` ``config.ttl`` s after the contact file's last modification.
    Returns at once when another watchdog holds the instance's lock (it is in charge)."""
    path = config.contact + ".lock"
    lock = _lock(path)
    _say_armed()
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
def poll_interruptions(config: Config) -> None:
    """Poll IMDSv2 until an interruption notice comes; announce it on stderr, once."""
    if config.imds.rstrip("/").endswith(GCE_METADATA):
        return poll_preemption(config)
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
        except urllib.error.HTTPError as e:
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
        time.sleep(config.poll)


GCE_METADATA = "/computeMetadata/v1"


def poll_preemption(config: Config) -> None:
    """Poll Compute Engine's metadata server until ``instance/preempted`` is ``TRUE`` (a
    SPOT instance being taken back); announce it on stderr, once."""
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
        time.sleep(config.poll)


def _request(url: str, method: str, headers: dict[str, str]) -> str:
    req = urllib.request.Request(url, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=2.0) as resp:
        return str(resp.read().decode())


def main() -> None:
    """Entry point of ``python -m flotilla._node.cloud`` (started by :func:`start`)."""
    config = Config.from_json(os.environ[ENV])
    agent = os.environ.pop(_AGENT, "")
    if config.ttl > 0 and _daemonize():  # first: the agent may die meanwhile
        watchdog(config)
        os._exit(0)
    fd = os.environ.pop(_ARMED_FD, "")  # the watchdog's to write on, not this process's
    if fd.isdigit():
        with contextlib.suppress(OSError):
            os.close(int(fd))
    die_with_parent(exit_status=0, parent=int(agent) if agent.isdigit() else None)
    if config.imds:
        poll_interruptions(config)
    else:
        signal.pause()  # nothing to poll: end with the agent


if __name__ == "__main__":
    main()
