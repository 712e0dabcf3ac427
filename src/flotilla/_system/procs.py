"""This machine's processes, read from ``/proc``: one walk for the node side and the command
line (is a daemon still the same process; kill what a job or a local cluster left behind).

On Linux everything is read from ``/proc``. Where there is none (a macOS laptop running
the command line), whether a process runs and when it started come from ``ps`` (POSIX),
so that a cluster's daemon is not taken for gone; the rest (working directories,
environments) is Linux's, as the node side is. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

TYPE_CHECKING = False
if TYPE_CHECKING:
    import re
    import signal as _signal  # (typeshed has no _signal: signal's names, its types)
    import subprocess
else:
    import _signal  # signal.py's C module: the same calls and SIG* ints, without its enums

HAS_PROC = os.path.isdir("/proc/self")


def pids() -> Iterator[int]:
    """Every process id on this machine except this process's own."""
    me = os.getpid()
    if not HAS_PROC:
        yield from (p for p in _ps_pids() if p != me)
        return
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            yield int(entry)


def start_time(pid: int) -> int:
    """The start time of ``pid``; 0 when there is no such process or it is a zombie (it
    has exited; only its entry is left). Compare it, do not show it: clock ticks since boot
    from ``/proc``, seconds since the epoch from ``ps`` elsewhere."""
    if not HAS_PROC:
        return _ps_start(pid)
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return 0
    # the command name is in parentheses and may hold spaces: the fields follow the last ')'
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[19]) if fields[0] != "Z" else 0


def alive(pid: int, start: int = 0) -> bool:
    """Whether ``pid`` runs (not a zombie) and, when ``start`` is given, is the same process
    (its pid was not reused)."""
    began = start_time(pid)
    return began != 0 and (start == 0 or began == start)


OWNER = r"(\d+)\.(\d+)\.(\d+)"
"""What :func:`owner_tag` looks like, as a regular expression (groups: pid, start time,
pid namespace)."""


def owner_tag() -> str:
    """``<pid>.<start time>.<pid namespace>`` of this process. Files and folders that must
    not outlive it (shared-memory files, local node folders) carry it in their names, and
    whoever finds one of a gone owner removes it (:func:`of_gone_owners`). The start time
    tells the owner from a later process with the same id; the pid namespace says where
    the id means something."""
    global _tag
    pid = os.getpid()
    if not _tag.startswith(f"{pid}."):  # first call, or a forked child
        _tag = f"{pid}.{start_time(pid)}.{_pid_namespace()}"
    return _tag


_tag = ""


def of_gone_owners(names: list[str], pattern: re.Pattern[str]) -> list[str]:
    """The ``names`` whose owner is gone: ``pattern`` matches a name's start, its first
    three groups being an :data:`OWNER` tag. Owners in another pid namespace are never
    taken for gone (their ids cannot be checked from here)."""
    ours = _pid_namespace()
    gone: dict[tuple[int, int], bool] = {}  # a live owner may have many files
    out = []
    for name in names:
        found = pattern.match(name)
        if found is None or int(found[3]) != ours:
            continue
        key = (int(found[1]), int(found[2]))
        if key not in gone:
            gone[key] = not alive(*key)
        if gone[key]:
            out.append(name)
    return out


def _pid_namespace() -> int:
    """An identifier of this process's pid namespace (0 where there is none to read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def wait_gone(pid: int, start: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for a process (not our child) to exit; True when it did."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while alive(pid, start):
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)  # not our child: nothing to wait on but its /proc entry
        delay = min(delay * 2, 0.05)
    return True


def cwd(pid: int) -> str | None:
    """The working directory of ``pid`` (None: gone, or not ours to read)."""
    try:
        return os.readlink(f"/proc/{pid}/cwd").removesuffix(" (deleted)")
    except OSError:
        return None


def has_env(pid: int, prefix: bytes) -> bool:
    """Whether an entry (``NAME=value``) of ``pid``'s environment starts with ``prefix``."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return env.startswith(prefix) or b"\0" + prefix in env  # (no split: every process is read)


TRACKER_GRACE = 2.0
"""Seconds :func:`kill_all` leaves a multiprocessing resource tracker to exit by itself."""


def kill_all(match: Callable[[int], bool], rounds: int = 10) -> int:
    """SIGKILL every process (this one excepted) for which ``match(pid)`` is true, walking
    again for what they forked meanwhile (at most ``rounds`` walks); the number killed.

    A multiprocessing resource tracker among them (Dask's nanny, a DataLoader with spawned
    workers start one) is killed last: once the processes it served are gone it removes the
    named semaphores and shared memory they left and exits; killed with them, it would
    leave those in ``/dev/shm`` for good. It gets :data:`TRACKER_GRACE` seconds to do so."""
    killed: set[int] = set()
    trackers: set[int] = set()
    for _ in range(rounds):
        found = 0
        for pid in pids():
            if pid in trackers or not match(pid) or not alive(pid):  # a zombie is dead
                continue
            if _is_tracker(pid):
                trackers.add(pid)
                continue
            with contextlib.suppress(OSError):
                os.kill(pid, _signal.SIGKILL)
                # SIGKILL takes effect a moment later: the next walk may see it again
                found += pid not in killed
                killed.add(pid)
        if not found:
            break
    deadline = time.monotonic() + TRACKER_GRACE
    while any(alive(pid) for pid in trackers) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in trackers:
        if alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, _signal.SIGKILL)
                killed.add(pid)
    return len(killed | trackers)


def _is_tracker(pid: int) -> bool:
    """Whether ``pid`` is a multiprocessing resource tracker (``python -c 'from
    multiprocessing.resource_tracker import main; main(FD)'``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker import main" in f.read()
    except OSError:
        return False


def die_with_parent(
    sig: int = _signal.SIGKILL, exit_status: int | None = 1, parent: int | None = None
) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux's
    ``PR_SET_PDEATHSIG``; nothing elsewhere). Called in a child right after it was forked,
    so that it never outlives the process that started it. When the parent is already gone
    by then, exit with ``exit_status`` (None: carry on; a ``preexec_fn`` must). ``parent``:
    the pid of the process that started this one, when this is called after an exec (that
    parent may be gone before: this process's parent is then already another one)."""
    parent = os.getppid() if parent is None else parent
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if exit_status is not None and os.getppid() != parent:
        os._exit(exit_status)


def last_words(proc: subprocess.Popen[bytes], timeout: float, data: bytes | None = None) -> str:
    """Wait up to ``timeout`` s for ``proc`` to end (killed when it has not by then), ``data``
    written to its stdin and its output read meanwhile; the last line of its stderr (''
    when none). Its exit status is then ``proc.returncode``."""
    import subprocess  # here: the agent's start does not need it

    try:
        _, err = proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    lines = (err or b"").decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def _ps(*args: str) -> str:
    import subprocess  # here: the agent's start does not need it

    try:
        done = subprocess.run(
            ["ps", *args], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}
        )
    except OSError:
        return ""
    return done.stdout if done.returncode == 0 else ""


def _ps_pids() -> list[int]:
    return [int(w) for w in _ps("-A", "-o", "pid=").split() if w.isdigit()]


def _ps_start(pid: int) -> int:
    """``ps``'s view of ``pid``: its start time in seconds since the epoch (0: none or a
    zombie). ``lstart`` is ``Mon Nov 23 19:13:47 2026`` on Linux, macOS and the BSDs."""
    if pid <= 0:
        return 0
    fields = _ps("-o", "stat=,lstart=", "-p", str(pid)).split()
    if len(fields) < 6 or fields[0].startswith("Z"):
        return 0
    try:
        return int(time.mktime(time.strptime(" ".join(fields[1:6]), "%a %b %d %H:%M:%S %Y")))
    except ValueError:
        return 0
