"""Agents on cloud instances that can be taken back (spot, SPOT): interruption notices.

The node's poller (``_node/cloud.py``) writes a notice line on the agent's stderr when the
instance's metadata service announces an interruption (EC2's ``spot/instance-action``,
Compute Engine's ``instance/preempted``); :class:`NoticeAgent` takes those lines out of the
stream and hands them to the allocation, which reports the node lost (and replaces it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from ..._wire.protocol import CLOUD_NOTICE as NOTICE
from ..base import AgentProcess, FramesCallback, GiveUp


class NoticeAgent(AgentProcess):
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
