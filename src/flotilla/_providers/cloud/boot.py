"""An instance booting: waiting for its SSH port, and which failures of an agent's start
are those of an instance still booting (tried again until the start timeout).

A cloud instance's sshd comes up some seconds after the instance runs, and may restart
once (cloud-init installing the host key): :func:`wait_port` waits for the port, then an
agent's start that ssh ends as it does on a booting machine (refused, reset, closed
without an answer: :func:`booting`) is tried again by the launch layer
(``RemoteShell.transient``, see ``allocation``).
"""

from __future__ import annotations

import asyncio
import time

from ..._errors import ProvisionCause, ProvisionError
from ..bootstrap import NoAnswer
from ..ssh_shell import REFUSALS

RETRIED = frozenset({ProvisionCause.UNREACHABLE, ProvisionCause.NO_ANSWER})
"""Why an agent did not start on an instance that may still be booting (sshd not up yet or
restarting): the start is tried again until the start timeout."""


def booting(failure: NoAnswer) -> bool:
    """Whether ssh's ``failure`` is one of a machine still booting: one whose cause
    (``SSHShell.explain``) is in :data:`RETRIED`, not a refusal trying again cannot
    change (a wrong host key, a refused login, an unknown name: ``ssh_shell.REFUSALS``)."""
    return not any(refusal in failure.stderr for refusal in REFUSALS)


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
