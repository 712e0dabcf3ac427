"""Agents on EC2 instances: the wait for port 22, what is retried, interruption notices.

An instance is an SSH host whose host key the client generated (``keys``): the agent
starts through ``ssh`` (``ssh_shell``) as on any SSH host (the client's exact flotilla,
shipped by content hash), with the pool's login key and known_hosts, once the instance
answers on port 22.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..._errors import ProvisionCause, ProvisionError
from ..._wire.protocol import CLOUD_NOTICE as NOTICE
from ..base import AgentProcess, FramesCallback, GiveUp

RETRIED = frozenset({ProvisionCause.UNREACHABLE, ProvisionCause.NO_ANSWER})
"""Why an agent did not start on an instance that may still be booting (sshd not up yet or
restarting): the start is tried again until the start timeout."""


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


CONNECTS_AT_ONCE = 3
"""Attempts to reach an instance's port 22 in flight at once: each holds a socket, and the
client's open files per node stay within the three its agent channel holds later."""


async def wait_port(addr: str, port: int, deadline: float, name: str, timeout: float) -> None:
    """Wait until ``addr:port`` accepts a TCP connection (the instance's sshd is up).

    A new attempt starts every 50 ms without waiting for the earlier ones: before the
    instance's network is up an attempt hangs (no ARP answer) until its own timeout, and
    a sequential poll would notice sshd that much later. Once the network is up, a refused
    attempt ends at once: the pace (not the attempts' ends) keeps this from spinning. At
    most :data:`CONNECTS_AT_ONCE` attempts are in flight: while they hang (a booting
    instance, for the boot's 20-60 s), a new one starts as an old one times out, a few
    times a second, not 20 sockets per instance (1280 for 64 instances, past the usual
    soft limit of 1024 open files)."""
    pending: set[asyncio.Task[bool]] = set()
    next_try = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise ProvisionError(
                    f"{name}: SSH (port {port}) did not answer within {timeout:g} s of the "
                    "launch (Options(start_timeout=...) sets the limit; is the security "
                    "group's SSH rule for this machine's address, and private_ips= right?)",
                    cause=ProvisionCause.UNREACHABLE,
                )
            full = len(pending) >= CONNECTS_AT_ONCE
            if now >= next_try and not full:  # at most one new attempt per 50 ms: a
                pending.add(asyncio.create_task(_connects(addr, port, min(1.0, left))))
                next_try = now + 0.05  # refused one ends at once, and must not spin
                full = len(pending) >= CONNECTS_AT_ONCE
            # all in flight: until one ends (each within 1 s) or the deadline
            pause = max(0.0, (deadline if full else min(next_try, deadline)) - time.monotonic())
            if not pending:
                await asyncio.sleep(pause)
                continue
            done, pending = await asyncio.wait(
                pending, timeout=pause, return_when=asyncio.FIRST_COMPLETED
            )
            if any(t.result() for t in done):
                return
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _connects(addr: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``addr:port`` succeeds within ``timeout`` s."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(addr, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True
