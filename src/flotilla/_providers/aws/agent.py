"""Agents on EC2 instances: their watchdog's settings, interruption notices.

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

from ..._wire.protocol import CLOUD_ENV
from ..._wire.protocol import CLOUD_NOTICE as NOTICE
from ..base import AgentProcess, FramesCallback, GiveUp
from ..cloud.guard import contact_path
from .settings import EFA_ENV, AWSSettings

IMDS = "http://169.254.169.254"


def cloud_env(
    settings: AWSSettings, ident: str, instance: dict[str, Any], efa: bool
) -> dict[str, str]:
    """``FLOTILLA_CLOUD`` for the agent on instance ``ident`` (described by ``instance``):
    its watchdog's settings (see ``_node/cloud.py``; a spot instance's polls the metadata
    service for interruption notices); with ``efa``, the EFA variables."""
    spot = instance.get("InstanceLifecycle") == "spot"
    watchdog = {
        "contact": contact_path(settings.workdir, ident),
        "ttl": settings.ttl,
        "poweroff": list(settings.poweroff_command),
        "imds": IMDS if spot else "",
    }
    env = {CLOUD_ENV: json.dumps(watchdog)}
    if efa:
        env.update(EFA_ENV)
    return env


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
