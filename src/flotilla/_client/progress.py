"""Start-up progress per node: provisioning, environment, starting, with timings.

On a terminal, one status line is redrawn in place; otherwise plain log lines are written
for the slow phases only (environment builds). Everything shown is redacted of secrets.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable
from typing import TextIO

from .._redaction import redact


class Progress:
    def __init__(
        self, nodes: int, secrets: Iterable[str] = (), stream: TextIO | None = None
    ) -> None:
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.secrets = list(secrets)
        self.started = time.monotonic()
        self.phase = ["provisioning"] * nodes
        self.since = [self.started] * nodes
        self.lock = threading.Lock()
        self.drawn = False
        self.build_started: dict[int, float] = {}

    def set_phase(self, node: int, phase: str) -> None:
        with self.lock:
            self.phase[node], self.since[node] = phase, time.monotonic()
            self._draw()

    def build_output(self, node: int, data: bytes) -> None:
        for line in data.decode(errors="replace").splitlines():
            if line.startswith("::step "):
                name = line[7:].strip()
                if name == "done":
                    took = time.monotonic() - self.build_started.get(node, self.started)
                    self._emit(f"flotilla: node {node}: environment built in {took:.1f} s")
                    continue
                self.build_started.setdefault(node, time.monotonic())
                self.set_phase(node, f"environment ({name})")
                if not self.live:
                    self._emit(f"flotilla: node {node}: building environment: {name}")

    def finish(self) -> None:
        with self.lock:
            if self.live and self.drawn:
                total = time.monotonic() - self.started
                self._write(
                    f"\r\x1b[2Kflotilla: {len(self.phase)} node(s) ready in {total:.1f} s\n"
                )
                self.drawn = False

    def _draw(self) -> None:
        if not self.live or time.monotonic() - self.started < 0.5:
            return
        now = time.monotonic()
        parts = [
            f"node {i}: {p} {now - t:.1f}s"
            for i, (p, t) in enumerate(zip(self.phase, self.since, strict=True))
        ]
        self._write("\r\x1b[2Kflotilla: " + " | ".join(parts))
        self.drawn = True

    def _emit(self, line: str) -> None:
        if self.live and self.drawn:
            self._write("\r\x1b[2K")
        self._write(line + "\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(redact(text, self.secrets))
            self.stream.flush()
        except (OSError, ValueError):
            pass
