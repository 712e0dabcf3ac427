"""Pools of many nodes: 128 real sshd test hosts (network namespaces), started, broadcast to
and closed with the client's open files and threads bounded (no thread per node), and
nothing left behind (about 35 s with the lab's construction, on 2 loaded cores)."""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Iterator

import pytest
from _hosts import Lab, lab_unavailable
from _procs import wait_until

import flotilla as sky
from flotilla._client.loop import get_loop

HOSTS = 128

pytestmark = pytest.mark.timeout(900)


@sky.function
def host() -> tuple[int, int, str]:
    info = sky.instance_info()
    return info.node, info.total_nodes, socket.gethostname()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    with Lab() as lab:
        lab.add_hosts(HOSTS)
        yield lab


def test_a_pool_of_128_ssh_hosts_with_bounded_files_and_threads(lab: Lab) -> None:
    get_loop()  # the client's event loop (its epoll and wake-up pipe) outlives pools
    base_fds, base_threads = _fds(), threading.active_count()
    provider = lab.provider(python=sys.executable, connect_timeout=30.0)
    options = sky.Options(start_timeout=600.0)
    with sky.Compute(provider=provider, nodes=HOSTS, options=options) as pool:
        seen = host() @ pool
        assert [(n, t) for n, t, _ in seen] == [(r, HOSTS) for r in range(HOSTS)]
        assert {h for _, _, h in seen} == {h.hostname for h in lab.hosts}
        # above what this process held before (the lab's sshd logs among it): three pipes
        # per node (its ssh process's stdio), and the rest
        assert _fds() - base_fds <= 3 * HOSTS + 64
        assert threading.active_count() - base_threads <= 16  # no thread per node
    assert wait_until(lambda: _fds() <= base_fds, timeout=20), (_fds(), base_fds)
    assert lab.wait_no_agents(timeout=60) == {}
