"""Helpers for tests that watch real processes: liveness, polling, client scripts.

Everything here synchronises by condition (poll a predicate every 20 ms until a deadline),
never by sleeping a fixed time.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

POLL_INTERVAL = 0.02


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` every 20 ms until it is true (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(POLL_INTERVAL)


def _stat_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name is in parentheses and may contain spaces: the state follows the last ')'
    return stat[stat.rindex(")") + 2]


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a zombie has exited, only its entry stays)."""
    state = _stat_state(pid)
    return state is not None and state != "Z"


def alive_among(pids: Iterable[int]) -> list[int]:
    return [pid for pid in pids if alive(pid)]


def assert_all_gone(pids: Iterable[int], timeout: float, what: str = "processes") -> None:
    """Wait up to ``timeout`` s for every pid to be gone; fail naming the survivors."""
    pids = sorted(set(pids))
    assert pids, f"no {what} to watch"
    if not wait_until(lambda: not alive_among(pids), timeout):
        survivors = alive_among(pids)
        details = ", ".join(f"{pid} ({cmdline(pid)!r})" for pid in survivors)
        raise AssertionError(f"{what} still running after {timeout:g} s: {details}")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def agent_above(pid: int) -> int:
    """The flotilla agent process above ``pid`` (its run command), found by parentage: the
    highest ancestor running ``flotilla.agent`` (the executor below it, a fork of the
    agent, has the same command line)."""
    found = 0
    current = pid
    while current > 1:
        if "flotilla.agent" in cmdline(current):
            found = current
        elif found:
            return found
        with open(f"/proc/{current}/stat") as f:
            stat = f.read()
        current = int(stat[stat.rindex(")") + 2 :].split()[1])
    raise AssertionError(f"no flotilla agent above pid {pid} ({cmdline(pid)!r})")


def all_pids() -> list[int]:
    """Every process id on the machine, from /proc."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def processes_in(directory: Path) -> list[int]:
    """Live processes whose working directory is ``directory`` or lies below it.

    Pools started with ``flotilla.Local(workdir=directory)`` run every agent, executor and
    task child in a working directory below ``directory`` (deleted or not), so this finds
    exactly the processes of those pools.
    """
    root = str(directory.resolve())
    found = []
    for pid in all_pids():
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        cwd = cwd.removesuffix(" (deleted)")
        if (cwd == root or cwd.startswith(root + os.sep)) and alive(pid):
            found.append(pid)
    return found


def kill_quietly(pids: Iterable[int]) -> None:
    """SIGKILL processes a test started (through a pool), if any survived a failed test."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def interruptible() -> None:
    """In a child before exec: Ctrl-C (SIGINT) as in a terminal.

    A process started in the background by a non-interactive shell (as CI runners may do)
    inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_a_thread(pid: int, signum: int) -> int:
    """Send ``signum`` to a thread of process ``pid`` other than its main one (``tgkill``);
    that thread's id.

    Linux gives a signal sent to a process (Ctrl-C, ``kill``) to any of its threads that
    does not block it; Python runs its handlers in the main thread only, once that thread
    runs again. This is the delivery a Python program cannot count on being woken by, made
    certain instead of occasional (a busy machine makes it more likely)."""
    import ctypes

    tgkill = ctypes.CDLL(None, use_errno=True).tgkill
    deadline = time.monotonic() + 10
    while True:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        for tid in tids:
            if tgkill(pid, tid, signum) == 0:
                return tid
        if time.monotonic() > deadline:  # (a thread that ended meanwhile: the next one)
            raise AssertionError(f"process {pid} has no thread but its main one: {tids}")
        time.sleep(POLL_INTERVAL)


class Client:
    """A client script run as a subprocess of this interpreter, its stdout read by line.

    A reader thread feeds stdout lines into a queue, so the test can wait for a given line
    with a deadline while the client keeps running.
    """

    def __init__(self, script: str, cwd: Path) -> None:
        path = cwd / "client.py"
        path.write_text(textwrap.dedent(script))
        env = dict(os.environ)
        env.pop("COMPUTE_POOL", None)
        env.pop("PYTHONUNBUFFERED", None)  # a real client's stdout pipe is block-buffered
        self.proc = subprocess.Popen(
            [sys.executable, str(path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            preexec_fn=interruptible,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[bytes] = []
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._queue.put(raw.decode(errors="replace").rstrip("\n"))
        self._queue.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self._stderr.append(raw)

    def expect(self, predicate: Callable[[str], bool], timeout: float = 15.0) -> str:
        """Wait for the next stdout line satisfying ``predicate`` (earlier ones are kept)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"no expected line from the client within {timeout:g} s; "
                    f"stdout so far: {self.lines!r}; stderr: {self.stderr()!r}"
                )
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self._queue.put(None)  # keep reporting the end to later calls
                raise AssertionError(
                    f"the client's stdout ended (exit status {self.proc.poll()}) without the "
                    f"expected line; stdout: {self.lines!r}; stderr: {self.stderr()!r}"
                )
            self.lines.append(line)
            if predicate(line):
                return line

    def wait(self, timeout: float = 15.0) -> int:
        """Wait for the client to exit and for its output to be read; its exit status."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the client did not exit within {timeout:g} s; stderr: {self.stderr()!r}"
            ) from None
        for t in self._threads:
            t.join(timeout)
        return code

    def rest_of_stdout(self) -> list[str]:
        """Every remaining stdout line (call after :meth:`wait`)."""
        while True:
            line = self._queue.get(timeout=5)
            if line is None:
                self._queue.put(None)
                return self.lines
            self.lines.append(line)

    def stderr(self) -> str:
        return b"".join(self._stderr).decode(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """Stop the client if it is still running (test teardown)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


TEST_FOLDER_PREFIX = "flotilla-test-"
_TEST_FOLDER = re.compile(r"flotilla-(?:test-[a-z]+|lab)-(\d+)[a-z]*-")
"""A test's own folder in the temp folder: ``flotilla-test-<kind>-<pid>-...`` (lab
folders: ``flotilla-lab-<pid><letter>-...``, see _hosts.py), the pid being the test
session's."""


def session_folder(kind: str) -> Path:
    """A new folder of this test session in the temp folder (for what needs a short path or
    a place of its own outside tmp_path), named so that :func:`remove_stale_test_folders`
    removes it if the session is killed before its teardown does."""
    return Path(tempfile.mkdtemp(prefix=f"{TEST_FOLDER_PREFIX}{kind}-{os.getpid()}-"))


def remove_stale_test_folders() -> list[str]:
    """Remove the temp folders of test sessions that are gone (killed, timed out before
    their teardown ran); their paths. A session's own and live ones are left alone."""
    tmp = tempfile.gettempdir()
    removed = []
    for name in os.listdir(tmp):
        found = _TEST_FOLDER.match(name)
        if found and not alive(int(found[1])):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            removed.append(os.path.join(tmp, name))
    return removed
