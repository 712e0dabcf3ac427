"""A real terminal for tests: a private tmux server running one command in a pane of a
given size, whose screen is read with ``capture-pane``."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def ensure_tmux() -> str:
    """The tmux binary, installed with apt-get when missing (skips when it cannot be)."""
    found = shutil.which("tmux")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.skip("tmux is not installed and installing it needs root (apt-get install tmux)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "tmux"]
    if subprocess.run(install, capture_output=True, env=env).returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, env=env)
        if subprocess.run(install, capture_output=True, env=env).returncode != 0:
            pytest.skip("tmux is not installed and apt-get could not install it")
    found = shutil.which("tmux")
    if not found:
        pytest.skip("tmux was installed but is not on PATH")
    return found


class Terminal:
    """One tmux pane (``width`` x ``height``) running ``argv``; ended by :meth:`close`."""

    def __init__(self, argv: list[str], width: int, height: int, folder: Path) -> None:
        self.tmux = ensure_tmux()
        self.socket = str(folder / f"tmux-{os.getpid()}-{time.monotonic_ns()}")
        # keep the pane after the command exits so that its last screen can be read
        command = " ".join(shlex.quote(a) for a in argv)
        self._run(
            "new-session", "-d", "-x", str(width), "-y", str(height), "-s", "t",
            f"{command}; echo '[exited]'; sleep 600",
        )  # fmt: skip

    def _run(self, *args: str) -> str:
        proc = subprocess.run(
            [self.tmux, "-S", self.socket, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            # the pane's size is the terminal's: a COLUMNS/LINES inherited (pytest-xdist's
            # workers are given 80x24) would override it for rich
            env={
                **{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
                "TERM": "xterm-256color",
            },
        )
        if proc.returncode != 0:
            raise RuntimeError(f"tmux {args[0]}: {proc.stderr.strip()}")
        return proc.stdout

    def screen(self, colors: bool = False) -> str:
        return self._run("capture-pane", "-p", *(["-e"] if colors else []), "-t", "t")

    def wait_for(
        self, check: Callable[[str], bool], what: str, timeout: float = 30.0, colors: bool = False
    ) -> str:
        """The screen once ``check(screen)`` holds (polled); fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen(colors)
            if check(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"the terminal never showed {what}; it shows:\n{text}")
            time.sleep(0.05)  # polling the screen, not waiting in place of a condition

    def keys(self, *keys: str) -> None:
        self._run("send-keys", "-t", "t", *keys)

    def close(self) -> None:
        subprocess.run([self.tmux, "-S", self.socket, "kill-server"], capture_output=True)
        with contextlib.suppress(OSError):
            os.unlink(self.socket)
