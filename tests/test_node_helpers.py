"""The node side's machine helpers shared with the command line: file locks
(``_system/locks.py``) and the ``/proc`` walk (``_system/procs.py``), on real processes."""

from __future__ import annotations

import fcntl
import os
import secrets
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from _procs import wait_until

from flotilla._errors import ConfigurationError
from flotilla._system import locks, procs

SRC = str(Path(locks.__file__).parents[2])


def _holder(path: Path) -> subprocess.Popen[str]:
    """A process that takes ``locks.exclusive(path)``, says so, and holds it until its
    stdin closes."""
    code = textwrap.dedent(
        f"""
        import sys
        from flotilla._system import locks
        with locks.exclusive({str(path)!r}):
            print("held", flush=True)
            sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def _free(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_an_exclusive_lock_excludes_other_processes_and_dies_with_its_holder(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x.lock"
    holder = _holder(path)
    try:
        assert oct(path.stat().st_mode & 0o777) == oct(0o600)
        assert not _free(path)
        holder.kill()  # kill -9: the kernel releases the lock
        holder.wait()
        assert _free(path)
        with locks.exclusive(path):
            assert not _free(path)  # flock is per open file: another open of ours waits too
        assert _free(path)
    finally:
        holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout):
            if stream is not None:
                stream.close()


def test_named_locks_live_in_a_folder_private_to_the_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "shared-tmp"))  # not used
    monkeypatch.setenv("FLOTILLA_HOME", str(tmp_path / "home"))
    with locks.named("/data/shared"):
        folder = tmp_path / "home" / "locks"
        assert oct(folder.stat().st_mode & 0o777) == oct(0o700)
        [lock] = folder.iterdir()
        assert not _free(lock)  # held by us through another open file
    assert _free(lock)
    folder.chmod(0o777)  # others could plant files there: refused
    with pytest.raises(ConfigurationError, match="writable by others"), locks.named("/x"):
        pass


@pytest.fixture
def marked() -> Iterator[tuple[bytes, list[subprocess.Popen[bytes]]]]:
    """A marker variable and a list to put processes started with it in (killed after)."""
    started: list[subprocess.Popen[bytes]] = []
    yield f"FLOTILLA_TEST_MARK={secrets.token_hex(8)}".encode(), started
    for proc in started:
        proc.kill()
        proc.wait()


def test_kill_all_finds_processes_by_environment_and_what_they_forked(
    tmp_path: Path, marked: tuple[bytes, list[subprocess.Popen[bytes]]]
) -> None:
    mark, started = marked
    name, _, value = mark.decode().partition("=")
    pidfile = tmp_path / "child.pid"
    # the child leaves the process group and session: only its environment finds it
    script = f"setsid sleep 300 & echo $! > {pidfile}; exec sleep 300"
    proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env={**os.environ, name: value})
    started.append(proc)
    assert wait_until(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
    child = int(pidfile.read_text())
    assert procs.alive(proc.pid) and procs.alive(child)
    assert procs.cwd(proc.pid) == str(tmp_path)
    assert procs.has_env(proc.pid, mark) and not procs.has_env(os.getppid(), mark)
    start = procs.start_time(proc.pid)
    assert procs.alive(proc.pid, start) and not procs.alive(proc.pid, start + 1)

    assert procs.kill_all(lambda pid: procs.has_env(pid, mark)) == 2
    proc.wait()
    assert procs.wait_gone(child, 0, 10.0)  # reaped by init once killed
    assert not procs.alive(proc.pid, start)
    assert procs.kill_all(lambda pid: procs.has_env(pid, mark)) == 0


def test_kill_all_removes_the_multiprocessing_semaphores_of_what_it_killed(
    tmp_path: Path, marked: tuple[bytes, list[subprocess.Popen[bytes]]]
) -> None:
    """A spawn-started multiprocessing program (a Dask worker's nanny) killed with its
    resource tracker would leave its semaphores and shared memory in /dev/shm for good."""
    mark, started = marked
    name, _, value = mark.decode().partition("=")
    code = textwrap.dedent(
        """
        import multiprocessing, multiprocessing.shared_memory, sys, time
        ctx = multiprocessing.get_context("spawn")
        lock = ctx.Lock()
        block = multiprocessing.shared_memory.SharedMemory(create=True, size=4096)
        print(lock._semlock.name, block.name, flush=True)
        time.sleep(300)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        cwd=tmp_path,
        env={**os.environ, name: value},
    )
    started.append(proc)
    assert proc.stdout is not None
    semaphore, block = proc.stdout.readline().decode().split()
    paths = [Path("/dev/shm") / f"sem.{semaphore.lstrip('/')}", Path("/dev/shm") / block]
    assert all(p.exists() for p in paths)

    assert procs.kill_all(lambda pid: procs.has_env(pid, mark)) >= 2  # with its tracker
    proc.wait()
    assert [p for p in paths if p.exists()] == []
