"""The SSH provider against real sshd test hosts (network namespaces, see ``_hosts``).

Tests that need the hosts need root; they skip with the reason otherwise.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from _ddp import assert_ddp_averages
from _hosts import Lab, TestHost, keygen, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from _procs import Client, alive, all_pids, assert_all_gone, cmdline, wait_until
from test_layers import NOT_AT_START

import flotilla as sky
from flotilla._errors import ConfigurationError, NodeLostError, ProvisionCause, ProvisionError
from flotilla._providers import bootstrap as _bootstrap
from flotilla._providers import launch as _launch
from flotilla._providers.settings import SSHHost, parse_host
from flotilla._providers.ssh import SSH


@sky.function
def where() -> dict[str, object]:
    """What a node knows about itself."""
    import flotilla

    info = sky.instance_info()
    return {
        "node": info.node,
        "addr": info.addr,
        "head_addr": info.head_addr,
        "peers": [(p.node, p.addr) for p in info.peers],
        "hostname": socket.gethostname(),
        "flotilla": flotilla.__file__,
        "pid": os.getpid(),
    }


@sky.function
def add(a: int, b: int) -> int:
    return a + b


@sky.function
def big(n: int) -> bytes:
    return b"x" * n


@sky.function
def size_of(data: bytes) -> int:
    return len(data)


@sky.function
def block_after(marker: str, seconds: float) -> None:
    """Create ``marker`` (the task started), then sleep."""
    Path(f"{marker}.{sky.instance_info().node}").touch()
    time.sleep(seconds)


@sky.function
def interpreter_view() -> dict[str, object]:
    """This executor's interpreter beside a plain one started here with the same environment:
    their site-packages folders, ``-S``, where ``packaging`` (in site-packages only) is, and
    whether the cyclic garbage collector runs (a start pauses it while it imports)."""
    import gc

    import packaging

    code = "import json, sys; print(json.dumps([sys.path, sys.flags.no_site]))"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    path, no_site = json.loads(plain.stdout)
    return {
        "sites": [p for p in sys.path if p.endswith("-packages")],
        "plain_sites": [p for p in path if p.endswith("-packages")],
        "no_site": sys.flags.no_site,
        "plain_no_site": no_site,
        "packaging": packaging.__file__,
        "gc": gc.isenabled(),
    }


def _hosts3(lab: Lab) -> list[TestHost]:
    return lab.hosts[:3]


# -- configuration (no hosts needed) ----------------------------------------------------------
def test_parse_host_forms() -> None:
    assert parse_host("h") == SSHHost("h")
    assert parse_host("alice@h") == SSHHost("h", user="alice")
    assert parse_host("alice@h:2222") == SSHHost("h", user="alice", port=2222)
    assert parse_host("[fe80::1]:22") == SSHHost("fe80::1", port=22)
    assert parse_host("fe80::1") == SSHHost("fe80::1")
    for bad in ("", "h:port", "alice@", "[fe80::1"):
        with pytest.raises(ConfigurationError):
            parse_host(bad)


def test_host_objects_and_defaults() -> None:
    provider = SSH(["a", SSHHost("b", user="bob", port=2200, private_addr="10.0.0.2")], user="u")
    first, second = (provider.target(h) for h in provider.hosts)
    assert (first.host, first.user, first.port, first.address) == ("a", "u", 22, "a")
    assert (second.host, second.user, second.port, second.address) == (
        "b",
        "bob",
        2200,
        "10.0.0.2",
    )
    assert provider.home == "~/.flotilla"
    with pytest.raises(ConfigurationError):
        SSH([])
    with pytest.raises(ConfigurationError):
        SSH(["a"], port=0)


def test_more_nodes_than_hosts_is_refused_before_connecting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_connect(*args: object, **kwargs: object) -> None:
        raise AssertionError("validate() must refuse before connecting")

    monkeypatch.setattr(_launch, "spawn", no_connect)
    provider = SSH(["192.0.2.1", "192.0.2.2"], connect_timeout=1)
    t0 = time.monotonic()
    with pytest.raises(ConfigurationError, match=r"3 nodes but SSH has 2 host"):
        sky.Compute(provider=provider, nodes=3).open()
    assert time.monotonic() - t0 < 1.0


def test_missing_ssh_client_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh there
    with pytest.raises(ConfigurationError, match=r"OpenSSH's `ssh` client.*apt-get install"):
        sky.Compute(provider=SSH(["192.0.2.1"]), nodes=1).open()


def test_accept_new_needs_a_writable_known_hosts(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    provider = SSH(["192.0.2.1"], known_hosts=blocker / "known_hosts", accept_new_host_keys=True)
    with pytest.raises(ConfigurationError, match=r"file is not a directory"):
        sky.Compute(provider=provider, nodes=1).open()
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    if os.access(folder, os.W_OK):
        return  # root writes anywhere: only the first case applies
    provider = SSH(["192.0.2.1"], known_hosts=folder / "known_hosts", accept_new_host_keys=True)
    with pytest.raises(ConfigurationError, match=r"it is not writable"):
        sky.Compute(provider=provider, nodes=1).open()


def test_bundle_is_deterministic_and_complete() -> None:
    first = _bootstrap.build_bundle(_bootstrap._package_dirs())
    second = _bootstrap.build_bundle(_bootstrap._package_dirs())
    assert first == second
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(first.data)) as z:
        names = z.namelist()
    assert "flotilla/agent.py" in names and "cloudpickle/__init__.py" in names
    assert not [n for n in names if "__pycache__" in n]


# -- real hosts -----------------------------------------------------------------------------
def test_broadcast_rshift_gather_on_three_hosts(ssh_lab: Lab) -> None:
    with sky.Compute(provider=ssh_lab.provider(_hosts3(ssh_lab)), nodes=3) as pool:
        infos = where() @ pool
        assert [i["node"] for i in infos] == [0, 1, 2]
        assert add(2, 3) >> pool == 5
        assert sky.gather(*(add(i, i) for i in range(6))) >> pool == (0, 2, 4, 6, 8, 10)
        assert pool.map(size_of, [b"", b"ab", b"abcd"]) == [0, 2, 4]
        assert big(3 << 20) >> pool == b"x" * (3 << 20)  # a result > 1 MiB: many SSH packets


def test_large_arguments_over_ssh(ssh_lab: Lab) -> None:
    with sky.Compute(provider=ssh_lab.provider(ssh_lab.hosts[:1]), nodes=1) as pool:
        assert size_of(b"y" * (5 << 20)) >> pool == 5 << 20  # written in parts, not joined


def test_instance_info_has_each_hosts_own_address(ssh_lab: Lab) -> None:
    hosts = _hosts3(ssh_lab)
    with sky.Compute(provider=ssh_lab.provider(hosts), nodes=3) as pool:
        infos = where() @ pool
    addrs = [h.addr for h in hosts]
    assert [i["addr"] for i in infos] == addrs
    assert all(i["head_addr"] == addrs[0] for i in infos)
    assert all(i["peers"] == list(enumerate(addrs)) for i in infos)
    assert [i["hostname"] for i in infos] == [h.hostname for h in hosts]
    bundle = _bootstrap.client_bundle()
    assert all(f"/lib/{bundle.hash}/flotilla/" in str(i["flotilla"]) for i in infos)


def assert_a_plain_interpreter(view: dict[str, object]) -> None:
    """``interpreter_view()``'s answer: the executor is the ordinary interpreter."""
    plain = view["plain_sites"]
    assert isinstance(plain, list) and plain, view  # the interpreter has a site-packages
    assert view["sites"] == plain
    assert view["no_site"] == view["plain_no_site"] == 0
    assert any(str(view["packaging"]).startswith(f"{s}/") for s in plain), view
    assert view["gc"] is True, view


def test_an_executor_has_the_site_packages_of_a_plain_interpreter(ssh_lab: Lab) -> None:
    """The agent is started from the shipped bundle, but its executors must be the host's
    ordinary interpreter: its site-packages (and ``.pth`` files) on the path, no ``-S`` for
    the processes a task starts (``multiprocessing`` passes the flags on), and its garbage
    collector on (the start pauses it while it imports)."""
    with sky.Compute(provider=ssh_lab.provider(ssh_lab.hosts[:1]), nodes=1) as pool:
        assert_a_plain_interpreter(interpreter_view() >> pool)


@sky.function
def busy_in_c(folder: str) -> int:
    """Write this executor's and its agent's pids to ``folder/busy``, then add up numbers in
    C for hours: the GIL is held all along, so no Python thread could watch the agent."""
    with open(os.path.join(folder, "busy.tmp"), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()} {int('_ctypes' in sys.modules)}")
    os.rename(os.path.join(folder, "busy.tmp"), os.path.join(folder, "busy"))
    return sum(range(10**15))


def test_an_executor_busy_in_c_dies_with_its_agent_without_ctypes(ssh_lab: Lab) -> None:
    """An executor dies with its agent, even one running a function that holds the GIL in
    C code, and without ``ctypes`` (``PR_SET_PDEATHSIG``'s one way from Python, ~3-4 ms
    of CPU per executor start): the kernel SIGKILLs it when its lifeline, a pipe only the
    agent writes to, loses its writer."""
    folder = Path(tempfile.mkdtemp(dir=ssh_lab.shared))
    busy = folder / "busy"
    executor = 0
    try:
        with sky.Compute(provider=ssh_lab.provider(ssh_lab.hosts[:1]), nodes=1) as pool:
            running = pool.submit(busy_in_c(str(folder)))
            assert wait_until(busy.exists, timeout=120), "the busy call never started"
            executor, agent, ctypes_loaded = map(int, busy.read_text().split())
            assert agent == int(pool._nodes[0].hello_info["pid"])
            assert ctypes_loaded == 0
            os.kill(agent, signal.SIGKILL)
            assert_all_gone([agent, executor], 60, "the killed agent and its busy executor")
            with pytest.raises(NodeLostError):
                running.result(timeout=120)
    finally:
        if executor and alive(executor):
            os.kill(executor, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


def test_private_addr_is_what_peers_see(ssh_lab: Lab) -> None:
    host = ssh_lab.hosts[0]
    provider = ssh_lab.provider([host])
    provider.settings = replace(
        provider.settings, hosts=(SSHHost(host.addr, private_addr="192.0.2.77"),)
    )
    with sky.Compute(provider=provider, nodes=1) as pool:
        info = where() >> pool
    assert info["addr"] == "192.0.2.77" and info["peers"] == [(0, "192.0.2.77")]


def test_leaving_the_pool_leaves_no_process(ssh_lab: Lab) -> None:
    hosts = _hosts3(ssh_lab)
    with sky.Compute(provider=ssh_lab.provider(hosts), nodes=3) as pool:
        pids = {i["pid"] for i in where() @ pool}
        running = ssh_lab.agent_pids(hosts)
        assert len(running) == 3  # an agent (and its executor) on every host
        assert pids <= {pid for found in running.values() for pid in found}
    assert ssh_lab.wait_no_agents(hosts, timeout=3.0) == {}


def test_exit_status_of_agents(ssh_lab: Lab) -> None:
    hosts = ssh_lab.hosts[:2]
    with sky.Compute(provider=ssh_lab.provider(hosts), nodes=2) as pool:
        procs = list(pool._procs)
        os.kill(int(pool._nodes[1].hello_info["pid"]), signal.SIGKILL)  # PIDs are shared
        _wait_for(lambda: procs[1].exit_status() is not None)
        assert procs[1].exit_status() == -signal.SIGKILL  # reported by the start command
        with pytest.raises(NodeLostError, match=r"node 1 \(.*\) .*killed by SIGKILL"):
            pool._nodes[1].send([])
        assert add(1, 2) >> pool == 3  # the other node carries on
    assert procs[0].exit_status() == 0  # a clean exit after SHUTDOWN


def test_bootstrap_from_scratch_then_cache_hit(ssh_lab: Lab, tmp_path: Path) -> None:
    workdir = tmp_path / "fresh"
    hosts = _hosts3(ssh_lab)
    uploads = _bootstrap.stats.uploads
    with sky.Compute(provider=ssh_lab.provider(hosts, workdir=str(workdir)), nodes=3) as pool:
        assert add(1, 1) >> pool == 2
    first = _bootstrap.stats.uploads - uploads
    assert first == 3  # each host has a disk of its own
    bundle = _bootstrap.client_bundle()
    for h in hosts:  # in each host's own folder, as one file
        assert h.path(workdir / "lib" / bundle.hash).read_bytes() == bundle.data
        assert not [p for p in h.path(workdir / "lib").iterdir() if p.name.startswith(".tmp")]
    hits = _bootstrap.stats.hits
    with sky.Compute(provider=ssh_lab.provider(hosts, workdir=str(workdir)), nodes=3) as pool:
        assert add(2, 2) >> pool == 4
    assert _bootstrap.stats.uploads - uploads == first  # no new upload
    assert _bootstrap.stats.hits - hits == 3


def test_python_missing_or_too_old(ssh_lab: Lab, tmp_path: Path) -> None:
    host = ssh_lab.hosts[0]
    provider = ssh_lab.provider([host], python="/nonexistent/python3")
    with pytest.raises(ProvisionError) as info:
        sky.Compute(provider=provider, nodes=1).open()
    msg = str(info.value)
    assert msg.startswith(host.addr) and "/nonexistent/python3" in msg
    old = tmp_path / "python3.9"  # this Python, saying it is 3.9, runs the start command's
    host.path(tmp_path).mkdir(parents=True)  # (on the host: its /tmp is its own)
    host.path(old).write_text(  # own check: python3.9 -c CODE ARGS...
        f'#!/bin/sh\nshift\ncode="$1"\nshift\nexec {sys.executable} -c '
        "'import sys; sys.version_info = (3, 9, 18, \"final\", 0); exec(sys.argv.pop(1))' "
        '"$code" "$@"\n'
    )
    host.path(old).chmod(0o755)
    with pytest.raises(ProvisionError, match=r"is Python 3\.9; flotilla needs Python >= 3\.11"):
        sky.Compute(provider=ssh_lab.provider([host], python=str(old)), nodes=1).open()


@pytest.mark.parametrize("how", ["owner", "writable"])
def test_a_workdir_another_user_could_write_is_refused(
    ssh_lab: Lab, tmp_path: Path, how: str
) -> None:
    """A working directory owned by another user, or that others can write, could have
    flotilla's code replaced in it: the start command refuses it before running anything,
    and the error says which directory and how to fix it."""
    host = ssh_lab.hosts[0]
    workdir = tmp_path / "shared"
    seen = host.path(workdir)  # the folder on the host (its /tmp is its own)
    seen.mkdir(parents=True)
    if how == "owner":
        os.chown(seen, 65534, 65534)  # nobody's
    else:
        seen.chmod(0o777)
    provider = ssh_lab.provider([host], workdir=str(workdir))
    problem = {"owner": "belongs to another user", "writable": "can be written by other users"}
    with pytest.raises(ProvisionError) as info:
        sky.Compute(provider=provider, nodes=1).open()
    msg = str(info.value)
    assert msg.startswith(f"{host.addr}: refusing to run flotilla from {workdir}: ")
    assert problem[how] in msg and "workdir=" in msg
    assert list(seen.iterdir()) == []  # nothing was written there
    assert ssh_lab.wait_no_agents([host]) == {}


def test_a_workdir_behind_a_link_is_used_where_it_was_checked(ssh_lab: Lab, tmp_path: Path) -> None:
    """A working directory reached through a symbolic link: the start checks the folder it
    entered and names it by its real path from then on (the bundle, the import path), so a
    link another user owns on the way, pointed elsewhere once the check is done, leads no
    import of the node there."""
    host = ssh_lab.hosts[0]
    real, link = tmp_path / "real", tmp_path / "link"
    host.path(real).mkdir(mode=0o700, parents=True)
    host.path(link).symlink_to(real)  # (the path as the host sees it)
    with sky.Compute(provider=ssh_lab.provider([host], workdir=str(link)), nodes=1) as pool:
        found = str((where() >> pool)["flotilla"])
    assert found.startswith(f"{real}/lib/"), found


def test_a_new_workdir_is_private(ssh_lab: Lab, tmp_path: Path) -> None:
    host = ssh_lab.hosts[0]
    workdir = tmp_path / "new" / "flotilla"
    with sky.Compute(provider=ssh_lab.provider([host], workdir=str(workdir)), nodes=1) as pool:
        assert add(1, 1) >> pool == 2
    assert host.path(workdir).stat().st_mode & 0o777 == 0o700


def test_a_start_runs_no_program_but_the_shell_and_the_interpreter(
    ssh_lab: Lab, tmp_path: Path
) -> None:
    """A node start costs one shell and one Python process (issue 42 item 1): the working
    directory is made, checked and entered by the interpreter, not by ``mkdir`` and ``ls``
    processes. The host's PATH starts with tools that log their runs; a first start (the
    bundle uploaded) and a later one run none of them, and the new workdir is private."""
    spies = ssh_lab.shared / f"spies-{tmp_path.name}"
    spies.mkdir()
    log = spies / "ran"
    for tool in ("mkdir", "ls", "test", "stat", "chmod", "cat", "rm", "mv"):
        real = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True)
        if not real.stdout.strip().startswith("/"):
            continue  # a shell builtin here
        (spies / tool).write_text(
            f'#!/bin/sh\necho {tool} >> {log}\nexec {real.stdout.strip()} "$@"\n'
        )
        (spies / tool).chmod(0o755)
    path = f"{spies}:{os.path.dirname(sys.executable)}:/usr/bin:/bin"
    host = ssh_lab.add_host(env={"PATH": path})
    try:
        workdir = tmp_path / "new" / "spied"
        for _ in range(2):
            with sky.Compute(
                provider=ssh_lab.provider([host], workdir=str(workdir)), nodes=1
            ) as pool:
                assert add(1, 1) >> pool == 2
        assert not log.exists(), log.read_text()
        assert host.path(workdir).stat().st_mode & 0o777 == 0o700
    finally:
        ssh_lab.remove_host(host)


@sky.function
def agent_stdin_pipe_size() -> int:
    """The length of the pipe the node's agent reads its stdin from (the session's sshd
    writes the bundle and every frame into it). The agent is the executor's ancestor whose
    parent is the start command's shell."""
    import fcntl

    pid = os.getpid()
    while True:
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{parent}/comm") as f:
            if f.read().strip() in ("sh", "dash", "bash"):
                break
        pid = parent
    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)  # the same pipe
    try:
        return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(fd)


def test_an_agent_reads_its_stdin_through_a_long_pipe(ssh_lab: Lab, tmp_path: Path) -> None:
    """A start makes its stdin pipe ``bootstrap.PIPE_SIZE`` long, before the bundle comes
    (Linux's default, 64 KiB, made the host's sshd buffer and copy the rest of the bundle
    over and over), on a first start and on a later one."""
    workdir = str(tmp_path / "pipe")
    for _ in range(2):  # a first start (the bundle uploaded), then a later one
        with sky.Compute(provider=ssh_lab.provider(ssh_lab.hosts[:1], workdir=workdir)) as pool:
            assert agent_stdin_pipe_size() >> pool == _bootstrap.PIPE_SIZE


_LOADED_PROBE = """
def loaded(names):
    import sys
    ours = set(sys.modules)  # the agent's start, the executor's, this call's
    import subprocess
    fresh = subprocess.run(
        [sys.executable, "-c", "import sys; print(*sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    theirs = set(fresh.stdout.split())  # the interpreter's own start (its site's .pth files)
    return sorted(m for m in ours - theirs if m in names or m.split(".")[0] in names)
"""


def test_a_nodes_first_call_finds_none_of_what_a_start_does_without(ssh_lab: Lab) -> None:
    """On an SSH node (the start command, the agent, its executor), a first call sent by
    value (a module of no file: rebuilt without cloudpickle) finds none of the modules a
    node's start does without (``NOT_AT_START``: typing, dataclasses, runpy, cloudpickle...)
    in its executor, but for those its interpreter's own start imports."""
    namespace: dict[str, Any] = {"__name__": "flotilla_test_probe"}
    exec(_LOADED_PROBE, namespace)
    with sky.Compute(provider=ssh_lab.provider(ssh_lab.hosts[:1]), nodes=1) as pool:
        assert sky.function(namespace["loaded"])(NOT_AT_START) >> pool == []


def test_unknown_host_key_is_refused_with_fingerprint(ssh_lab: Lab, tmp_path: Path) -> None:
    host = ssh_lab.hosts[0]
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(ProvisionError) as info:
        sky.Compute(provider=ssh_lab.provider([host], known_hosts=str(empty)), nodes=1).open()
    msg = str(info.value)
    fingerprint = _fingerprint(host)
    assert msg.startswith(f"{host.addr}: REFUSED: unknown host key")
    assert info.value.cause is ProvisionCause.IDENTITY
    assert fingerprint in msg
    assert "accept_new_host_keys=True" in msg and f"ssh-keyscan {host.addr} >> {empty}" in msg
    assert empty.read_text() == ""


def test_changed_host_key_is_always_refused(ssh_lab: Lab, tmp_path: Path) -> None:
    host = ssh_lab.hosts[0]
    other = keygen(tmp_path / "otherkey", "other")
    known = tmp_path / "known_hosts"
    known.write_text(f"{host.addr} {' '.join(other.split()[:2])}\n")
    provider = ssh_lab.provider([host], known_hosts=str(known), accept_new_host_keys=True)
    with pytest.raises(ProvisionError) as info:
        sky.Compute(provider=provider, nodes=1).open()
    msg = str(info.value)
    assert msg.startswith(f"{host.addr}: REFUSED: the host key changed")
    assert info.value.cause is ProvisionCause.IDENTITY
    assert _fingerprint(host) in msg and "ssh-keygen -R" in msg
    assert known.read_text().count("\n") == 1  # nothing recorded


def test_accept_new_host_keys_records_the_key(ssh_lab: Lab, tmp_path: Path) -> None:
    hosts = _hosts3(ssh_lab)
    known = tmp_path / "ssh" / "known_hosts"  # neither the file nor its folder exist yet
    provider = ssh_lab.provider(hosts, known_hosts=str(known), accept_new_host_keys=True)
    with sky.Compute(provider=provider, nodes=3) as pool:
        assert add(1, 2) >> pool == 3
    lines = known.read_text().splitlines()
    assert len(lines) == 3
    for h in hosts:  # recorded as ssh records keys (hashed or not, per the ssh config)
        found = subprocess.run(
            ["ssh-keygen", "-F", h.addr, "-f", str(known)], capture_output=True, text=True
        ).stdout
        assert " ".join(h.pubkey.split()[:2]) in found
    with sky.Compute(provider=ssh_lab.provider(hosts, known_hosts=str(known)), nodes=3) as pool:
        assert add(2, 2) >> pool == 4  # pinned now, no prompt needed
    assert known.read_text().splitlines() == lines


def test_unreachable_host_fails_within_connect_timeout(ssh_lab: Lab) -> None:
    addr = ssh_lab.unused_addr()
    good = ssh_lab.hosts[0].addr
    provider = ssh_lab.provider(connect_timeout=1.5)
    provider.settings = replace(provider.settings, hosts=(SSHHost(good), SSHHost(addr)))
    start_timeout = 60.0
    t0 = time.monotonic()
    with pytest.raises(ProvisionError) as info:
        options = sky.Options(start_timeout=start_timeout)
        sky.Compute(provider=provider, nodes=2, options=options).open()
    elapsed = time.monotonic() - t0
    assert str(info.value).startswith(f"{addr}: cannot connect over SSH (port 22)")
    assert info.value.cause is ProvisionCause.UNREACHABLE  # ssh's connect timeout ended it
    assert elapsed < start_timeout, elapsed  # ...not the start timeout (loaded machines vary)
    assert ssh_lab.wait_no_agents(ssh_lab.hosts[:1], timeout=3.0) == {}  # the good one stopped


def test_refused_port_names_the_host(ssh_lab: Lab) -> None:
    host = ssh_lab.hosts[0]
    provider = ssh_lab.provider([host], port=2)
    with pytest.raises(
        ProvisionError, match=rf"^{host.addr}: cannot connect over SSH \(port 2\)"
    ) as info:
        sky.Compute(provider=provider, nodes=1).open()
    assert info.value.cause is ProvisionCause.UNREACHABLE


def _started(marker: str, hosts: list[TestHost]) -> bool:
    """Whether node K wrote ``{marker}.K`` on its host (hosts[K], in its own /tmp), for all."""
    return all(h.path(f"{marker}.{n}").exists() for n, h in enumerate(hosts))


def test_host_dying_mid_task_names_the_node(ssh_lab: Lab, tmp_path: Path) -> None:
    doomed = ssh_lab.add_host()
    hosts = [*ssh_lab.hosts[:2], doomed]
    marker = str(tmp_path / "started")
    for h in hosts:  # the folder on each host (its /tmp is its own)
        h.path(tmp_path).mkdir(parents=True, exist_ok=True)
    try:
        options = sky.Options(shutdown_grace=1.0)
        provider = ssh_lab.provider(hosts)
        with (
            concurrent.futures.ThreadPoolExecutor(1) as ex,
            sky.Compute(provider=provider, nodes=3, options=options) as pool,
        ):
            fut = ex.submit(lambda: block_after(marker, 120) @ pool)
            _wait_for(lambda: _started(marker, hosts))
            cut = time.monotonic()
            ssh_lab.link_down(doomed)
            with pytest.raises(NodeLostError) as info:
                fut.result(timeout=30)
            detected = time.monotonic() - cut
        err = info.value
        assert err.node == 2 and f"node 2 ({doomed.addr})" in str(err)
        assert "SSH connection" in str(err) and err.exitcode == 255
        assert detected < 12, detected  # keepalive: 3 unanswered probes 2 s apart
        assert ssh_lab.wait_no_agents(hosts[:2], timeout=5.0) == {}
    finally:
        ssh_lab.remove_host(doomed)


def test_killed_agent_host_names_the_node(ssh_lab: Lab, tmp_path: Path) -> None:
    doomed = ssh_lab.add_host()
    hosts = [ssh_lab.hosts[0], doomed]
    marker = str(tmp_path / "started")
    for h in hosts:  # the folder on each host (its /tmp is its own)
        h.path(tmp_path).mkdir(parents=True, exist_ok=True)
    try:
        with (
            concurrent.futures.ThreadPoolExecutor(1) as ex,
            sky.Compute(provider=ssh_lab.provider(hosts), nodes=2) as pool,
        ):
            fut = ex.submit(lambda: block_after(marker, 120) @ pool)
            _wait_for(lambda: _started(marker, hosts))
            ssh_lab.kill_all(doomed)  # sshd, session, agent, executor: the host is gone
            with pytest.raises(NodeLostError, match=rf"node 1 \({doomed.addr}\)"):
                fut.result(timeout=30)
        assert ssh_lab.wait_no_agents(hosts[:1], timeout=5.0) == {}
    finally:
        ssh_lab.remove_host(doomed)


def test_killed_client_leaves_nothing_on_the_hosts(ssh_lab: Lab, tmp_path: Path) -> None:
    hosts = ssh_lab.hosts[:2]
    script = f"""
        import sys, threading
        import flotilla as sky

        @sky.function
        def nap():
            print("napping", flush=True)
            import time; time.sleep(120)

        provider = sky.SSH({[h.addr for h in hosts]!r}, user="root",
                           key={str(ssh_lab.client_key)!r},
                           known_hosts={str(ssh_lab.known_hosts)!r},
                           workdir={str(ssh_lab.tmp / "workdir")!r}, python=sys.executable)
        with sky.Compute(provider=provider, nodes=2) as pool:
            threading.Thread(target=lambda: nap() @ pool, daemon=True).start()
            threading.Event().wait()
    """
    client = Client(script, tmp_path)
    try:
        client.expect(lambda line: line.endswith("napping"), timeout=30)
        client.expect(lambda line: line.endswith("napping"), timeout=30)
        assert len(ssh_lab.agent_pids(hosts)) == 2
        ssh_pids = [p for p in all_pids() if str(ssh_lab.client_key) in cmdline(p)]
        assert len(ssh_pids) == 2  # one ssh process per host
        client.signal(signal.SIGKILL)
        assert client.wait() == -signal.SIGKILL
        assert ssh_lab.wait_no_agents(hosts, timeout=10.0) == {}
        assert_all_gone(ssh_pids, 10.0, "ssh processes of a killed client")
    finally:
        client.kill()


def test_writes_from_many_threads(ssh_lab: Lab) -> None:
    hosts = _hosts3(ssh_lab)
    with sky.Compute(provider=ssh_lab.provider(hosts), nodes=3) as pool:
        results: list[int] = []
        lock = threading.Lock()

        def client(k: int) -> None:
            for i in range(20):
                value = add(k, i) >> pool
                with lock:
                    results.append(value)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(results) == sorted(k + i for k in range(6) for i in range(20))


# -- plugins ----------------------------------------------------------------------------------
def test_ddp_across_three_hosts(ssh_lab: Lab) -> None:
    pytest.importorskip("torch")
    plugins = pytest.importorskip("flotilla.plugins")
    if not hasattr(plugins, "torch"):
        pytest.skip("flotilla.plugins.torch is not available")
    hosts = _hosts3(ssh_lab)
    provider = ssh_lab.provider(hosts, python=sys.executable)  # the interpreter with torch
    with sky.Compute(provider=provider, nodes=3, plugins=[plugins.torch()]) as pool:
        assert_ddp_averages(pool, 3)
    assert ssh_lab.wait_no_agents(hosts, timeout=5.0) == {}


# -- helpers ----------------------------------------------------------------------------------
def _fingerprint(host: TestHost) -> str:
    out = subprocess.run(
        ["ssh-keygen", "-lf", "-"], input=host.pubkey, capture_output=True, text=True, check=True
    ).stdout
    return out.split()[1]  # "256 SHA256:... comment (ED25519)"


def _wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
