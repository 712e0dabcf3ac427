"""Setting environment variables for the life of a plugin's ``around_process`` context."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .._info import ENV_VAR, InstanceInfo


@contextmanager
def environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` (a variable whose value is None: removed);
    restore the previous values on exit."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def unless_set(values: Mapping[str, str]) -> dict[str, str]:
    """The entries of ``values`` whose variable the user has not set already."""
    return {key: value for key, value in values.items() if key not in os.environ}


def host_port(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def global_rank(info: InstanceInfo) -> int:
    """This process's rank in the pool: ``node * procs_per_node + local_rank``."""
    return info.node * info.procs_per_node + info.local_rank


def world_size(info: InstanceInfo) -> int:
    """Processes in the pool: ``total_nodes * procs_per_node``."""
    return info.total_nodes * info.procs_per_node


def group_setting(key: str, default: Any) -> Any:
    """A setting the executor puts in this process's ``COMPUTE_POOL`` beside the
    :class:`InstanceInfo` fields, for a group's rendezvous: ``generation`` (the group's
    restarts so far) and ``start_timeout`` (the pool's, in seconds); ``default`` outside
    an executor, or when it is not there."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return default
    try:
        value = json.loads(raw).get(key, default)
    except (ValueError, AttributeError):
        return default
    return default if value is None else value
