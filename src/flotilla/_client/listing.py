"""A running pool's entry in ``$FLOTILLA_HOME/pools`` (``<pid>-<pool id>.json``: its view,
its process and program), so that ``flotilla top`` lists the Python pools of this user
that run. Rewritten every 2 s while the pool runs (with metrics on), removed when it
closes; an entry whose process is gone is ignored (and removed) by ``top``. Best effort:
a pool never fails for its entry."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from .._system import procs
from .._system.private import flotilla_home, private_dir

EVERY = 2.0
"""Seconds between two writes of a pool's entry."""


def folder() -> Path:
    return flotilla_home() / "pools"


class Listing:
    """One pool's entry (see the module docstring)."""

    def __init__(self, pool_id: str) -> None:
        self.path = folder() / f"{os.getpid()}-{pool_id}.json"
        self.due = 0.0
        self.broken = False
        self.made = False
        self.head = {
            "pid": os.getpid(),
            "pid_start": procs.start_time(os.getpid()),
            "program": " ".join(sys.argv)[:200],
        }

    def write(self, now: float, view: dict[str, Any]) -> None:
        if self.broken or now < self.due:
            return
        self.due = now + EVERY
        try:
            if not self.made:
                private_dir(flotilla_home())
                private_dir(self.path.parent)
                self.made = True
            fd, tmp = tempfile.mkstemp(prefix=".pool.", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({**self.head, **view}, f)
            os.replace(tmp, self.path)
        except Exception:
            self.broken = True
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def running() -> list[dict[str, Any]]:
    """The entries of this user's running pools (those of gone processes are removed)."""
    out = []
    try:
        names = sorted(os.listdir(folder()))
    except OSError:
        return []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = folder() / name
        try:
            with open(path, encoding="utf-8") as f:
                entry = json.load(f)
        except (OSError, ValueError):
            continue
        if not procs.alive(int(entry.get("pid", 0)), int(entry.get("pid_start", 0))):
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        out.append(entry)
    return out
