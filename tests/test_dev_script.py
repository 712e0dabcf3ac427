"""``./dev``: alone (or ``help``) it prints its commands and exits 0; unknown commands fail."""

from __future__ import annotations

import subprocess
from pathlib import Path

DEV = Path(__file__).resolve().parent.parent / "dev"


def test_dev_alone_prints_help_and_succeeds() -> None:
    for argv in ([], ["help"], ["--help"]):
        proc = subprocess.run([str(DEV), *argv], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert "./dev demo" in proc.stdout and "./dev test" in proc.stdout


def test_dev_unknown_command_fails_with_the_help() -> None:
    proc = subprocess.run([str(DEV), "nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown command 'nope'" in proc.stderr and "./dev demo" in proc.stderr
