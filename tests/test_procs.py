"""Client-side process checks: /proc on Linux, psutil elsewhere (as on macOS); both agree."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flotilla.cli import state


@pytest.fixture(params=["proc", "portable"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this system")
    monkeypatch.setattr(state, "_PROC", request.param == "proc")
    return str(request.param)


def test_a_running_process_is_alive_and_named_by_its_start(way: str) -> None:
    start = state.process_start(os.getpid())
    assert start > 0 and state.process_start(os.getpid()) == start
    assert state.process_alive(os.getpid(), start)
    assert not state.process_alive(os.getpid(), start + 1)  # a reused pid: another process


def test_zombies_and_exited_processes_are_not_alive(way: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    assert not state.process_alive(child.pid)  # a zombie
    child.wait()
    assert not state.process_alive(child.pid)
    assert state.wait_gone(child.pid, 0, 1.0)
