"""Agents on EC2 instances: interruption notices.

An instance is an SSH host whose host key the client generated (``cloud.keys``): the
agent starts through ``ssh`` as on any cloud instance (``cloud.allocation``, the client's
exact flotilla shipped by content hash), with the pool's login key and known_hosts, once
the instance answers on port 22; spot interruption notices come on its stderr.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from ..._wire.protocol import CLOUD_NOTICE as NOTICE
from ..base import AgentProcess, FramesCallback, GiveUp


class AWSAgent(AgentProcess):
    """An agent on an instance: the SSH agent, with interruption notices taken out of its
    stderr and handed to ``on_notice``."""

    def __init__(
        self, inner: AgentProcess, host: str, on_notice: Callable[[dict[str, Any]], None]
    ) -> None:
        self.inner = inner
        self.address = inner.address
        self.host = host
        self.on_notice = on_notice

    def write(self, parts: Sequence[Any], give_up: GiveUp | None = None) -> None:
        self.inner.write(parts, give_up)

    def try_write(self, data: bytes) -> bool:
        return self.inner.try_write(data)

    def start_reading(
        self,
        loop: asyncio.AbstractEventLoop,
        on_frames: FramesCallback,
        on_stderr: Callable[[bytes], None],
    ) -> None:
        def filtered(data: bytes) -> None:  # whole lines (the SSH agent passes whole lines)
            kept = []
            for line in data.splitlines(keepends=True):
                if line.startswith(NOTICE):
                    try:
                        notice = json.loads(line[len(NOTICE) :])
                    except ValueError:
                        notice = {}
                    self.on_notice(notice if isinstance(notice, dict) else {})
                else:
                    kept.append(line)
            if kept:
                on_stderr(b"".join(kept))

        self.inner.start_reading(loop, on_frames, filtered)

    async def wait(self, timeout: float) -> int | None:
        return await self.inner.wait(timeout)

    async def terminate(self) -> None:
        await self.inner.terminate()

    def exit_status(self) -> int | None:
        return self.inner.exit_status()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
