"""Process checks where there is no /proc (a macOS laptop running the command line): the
``ps`` path of ``_system.procs`` agrees with the /proc path on what runs and what does not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from flotilla._system import procs


@pytest.fixture(params=["proc", "ps"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this system")
    if request.param == "ps" and shutil.which("ps") is None:
        pytest.skip("no ps command (procps) on this system")
    monkeypatch.setattr(procs, "HAS_PROC", request.param == "proc")
    return str(request.param)


def test_a_running_process_is_alive_and_named_by_its_start(way: str) -> None:
    start = procs.start_time(os.getpid())
    assert start > 0 and procs.start_time(os.getpid()) == start
    assert procs.alive(os.getpid(), start)
    assert not procs.alive(os.getpid(), start + 1)  # a reused pid: another process


def test_zombies_and_exited_processes_are_not_alive(way: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    assert not procs.alive(child.pid)  # a zombie
    child.wait()
    assert not procs.alive(child.pid)
    assert procs.wait_gone(child.pid, 0, 1.0)


def test_every_process_is_listed(way: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in set(procs.pids())
    finally:
        child.kill()
        child.wait()
