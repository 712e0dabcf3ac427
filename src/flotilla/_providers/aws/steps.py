"""What the modules of an AWS pool share: the release's patience, running independent
API steps at once, telling the user what is launched."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable
from typing import Any

logger = logging.getLogger("flotilla.aws")

RELEASE_TIMEOUT = 600.0
"""Seconds release() keeps checking that instances terminated and the group can go."""


async def run_all(*steps: Awaitable[Any]) -> list[Any]:
    """Run ``steps`` at once; their results. On a failure every step is still awaited
    (nothing runs on unobserved) and the first failure in order is raised."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


async def nothing() -> None:
    return None


def show(message: str) -> None:
    """Tell the user (stderr) what is about to be launched."""
    logger.info("%s", message)
    print(f"flotilla: {message}", file=sys.stderr, flush=True)
