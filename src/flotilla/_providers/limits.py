"""What this machine can hold: local pools that cannot fit are refused before they start.

A local node is two processes (agent and executor) and a few pipes held by the client. A
request past the machine's limits (``num_nodes: 100000000000``) would otherwise start
agents until the client runs out of file descriptors or memory, then take minutes to
unwind. :func:`check_local_capacity` refuses it up front, naming the limit and the fix;
:func:`out_of_files` turns an ``EMFILE``/``ENFILE`` met later (other code holding files)
into a :class:`ProvisionError` with the same advice.

The per-node costs were measured on this project's machine (Python 3.11, local provider):
3 descriptors held by the client per node, 32 MB resident for a node's two processes.
"""

from __future__ import annotations

import errno
import logging
import os
import resource

from .._errors import ConfigurationError, ProvisionError

logger = logging.getLogger("flotilla")

FDS_PER_NODE = 4
"""Descriptors the client holds per node (3 measured, local and SSH: the agent's (or its
``ssh`` process's) stdin, stdout, stderr; one spare)."""
FDS_RESERVE = 64
"""Descriptors kept free for everything else the client opens."""
MEMORY_PER_NODE = 32 * 1024 * 1024
"""Resident memory of an idle local node (agent + executor), in bytes."""

_FD_FIX = (
    "raise the limit of open files (`ulimit -n {want}` in the shell that starts the pool, "
    "up to the hard limit `ulimit -Hn`; as root or in /etc/security/limits.conf beyond "
    "it), or ask for fewer nodes"
)


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def ensure_open_files(nodes: int, kind: str = "") -> None:
    """Make room for a pool of ``nodes`` (any provider: each node's agent channel is three
    pipes held here; ``kind``, the provider's name, for the message) in this process's
    limit of open files: the soft limit is raised towards the hard limit when it is too low
    (and a line logged saying so); a ConfigurationError when even the hard limit is too
    low."""
    need_fds = _open_fds() + nodes * FDS_PER_NODE + FDS_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and need_fds > soft:
        if hard == resource.RLIM_INFINITY or need_fds <= hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need_fds, hard))
            logger.info(
                "raised this process's soft limit of open files from %d to %d for %d nodes",
                soft,
                need_fds,
                nodes,
            )
        else:
            raise ConfigurationError(
                f"{nodes} {kind + ' ' if kind else ''}nodes need about {need_fds} open files "
                "in this process, "
                f"but its limit is {soft} (hard limit {hard}): " + _FD_FIX.format(want=need_fds)
            )


def check_local_capacity(nodes: int) -> None:
    """Refuse (ConfigurationError) a local pool of ``nodes`` that this machine cannot
    hold: open files (see :func:`ensure_open_files`), processes and memory."""
    ensure_open_files(nodes, "local")
    procs_soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if procs_soft != resource.RLIM_INFINITY and 2 * nodes > procs_soft:
        raise ConfigurationError(
            f"{nodes} local nodes need {2 * nodes} processes, but this user may run at most "
            f"{procs_soft} (`ulimit -u`): raise it or ask for fewer nodes"
        )
    available = _available_memory()
    if available is not None and nodes * MEMORY_PER_NODE > available:
        fit = max(available // MEMORY_PER_NODE, 0)
        raise ConfigurationError(
            f"{nodes} local nodes need about {nodes * MEMORY_PER_NODE / 2**30:.1f} GiB of "
            f"memory (32 MB each, idle), but {available / 2**30:.1f} GiB is available: ask "
            f"for at most {fit} nodes, or use a provider with more machines"
        )


def out_of_files(error: BaseException) -> ProvisionError | None:
    """A ProvisionError with advice when ``error`` is EMFILE/ENFILE (too many open
    files), else None."""
    if not isinstance(error, OSError) or error.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    which = "this process" if error.errno == errno.EMFILE else "the whole machine"
    return ProvisionError(
        f"too many open files in {which} (limit {soft}) while starting the nodes: "
        + _FD_FIX.format(want=max(2 * soft, 1024))
    )
