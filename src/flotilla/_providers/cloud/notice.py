"""Agents on cloud instances that can be taken back (spot, SPOT): interruption notices.

The node's poller (``_node/cloud.py``) writes a notice line on the agent's stderr when the
instance's metadata service announces an interruption (EC2's ``spot/instance-action``,
Compute Engine's ``instance/preempted``); :func:`watch_notices` takes those lines out of
the stream (a stderr filter of the SSH agent) and hands them to the allocation, which
reports the node lost (and replaces it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..._wire.protocol import CLOUD_NOTICE as NOTICE
from ..base import AgentProcess
from ..pipe import PipeAgent


def watch_notices(
    agent: AgentProcess, host: str, on_notice: Callable[[dict[str, Any]], None]
) -> AgentProcess:
    """``agent`` (the SSH agent ``cloud.allocation`` starts) named ``host`` in messages,
    with the interruption notices taken out of its stderr and handed to ``on_notice``."""
    if not isinstance(agent, PipeAgent):
        raise TypeError(f"interruption notices come on an SSH agent's stderr, not {agent!r}")

    def notices(data: bytes) -> bytes:  # whole lines (the SSH agent passes whole lines)
        kept = []
        for line in data.splitlines(keepends=True):
            if line.startswith(NOTICE):
                try:
                    notice = json.loads(line[len(NOTICE) :])
                except ValueError:
                    notice = {}
                on_notice(notice if isinstance(notice, dict) else {})
            else:
                kept.append(line)
        return b"".join(kept)

    agent.host = host
    agent.stderr_filters.append(notices)
    return agent
