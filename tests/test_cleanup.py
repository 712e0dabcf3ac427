"""Cleanup: whatever way a pool's block ends, every process, working directory and
shared-memory file it created goes away. Real pools, real processes, no mocks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from _procs import (
    Client,
    assert_all_gone,
    kill_quietly,
    processes_in,
    remove_stale_test_folders,
    session_folder,
    signal_a_thread,
    wait_until,
)

import flotilla as sky
from flotilla._client import shm
from flotilla._system import procs

STOP_WITHIN = 5.0  # leaving the block stops everything within this many seconds
ORPHANS_EXIT_WITHIN = 10.0  # agents notice a vanished client within this many seconds


class Boom(Exception):
    pass


@sky.function
def where() -> tuple[int, int, str]:
    """(agent pid, executor pid, working directory) of the node running this."""
    return os.getppid(), os.getpid(), os.getcwd()


@sky.function
def nap(seconds: float) -> None:
    time.sleep(seconds)


def pids_and_dirs(found: list[tuple[int, int, str]], nodes: int) -> tuple[list[int], list[str]]:
    pids = [pid for agent, executor, _ in found for pid in (agent, executor)]
    dirs = [cwd for _, _, cwd in found]
    assert len(set(pids)) == 2 * nodes, found
    assert len(set(dirs)) == nodes, found
    return pids, dirs


def assert_dirs_removed(dirs: list[str]) -> None:
    assert dirs
    assert [d for d in dirs if os.path.exists(d)] == []


def test_leaving_the_block_normally_stops_everything() -> None:
    pids: list[int] = []
    try:
        with sky.Compute(nodes=2) as pool:  # the default provider, its default temp dirs
            pids, dirs = pids_and_dirs(where() @ pool, 2)
            assert all(Path(d).is_dir() and pool.pool_id in d for d in dirs)
        assert pool.state is sky.PoolState.CLOSED
        assert_all_gone(pids, STOP_WITHIN, "the pool's agents and executors")
        assert_dirs_removed(dirs)
    finally:
        kill_quietly(pids)


@pytest.mark.parametrize("exc_type", [Boom, KeyboardInterrupt])
def test_leaving_the_block_by_exception_stops_everything_even_mid_call(
    tmp_path: Path, exc_type: type[BaseException]
) -> None:
    nodes_dir = tmp_path / "nodes"
    nodes_dir.mkdir()
    pids: list[int] = []
    running: Future[None] | None = None
    try:
        with (
            pytest.raises(exc_type),
            sky.Compute(sky.Local(workdir=str(nodes_dir)), nodes=2) as pool,
        ):
            pids, dirs = pids_and_dirs(where() @ pool, 2)
            running = nap(60) > pool  # still running when the block is left
            raise exc_type
        assert pool.state is sky.PoolState.CLOSED
        assert_all_gone(pids, STOP_WITHIN, "the pool's agents and executors")
        assert wait_until(lambda: not processes_in(nodes_dir), STOP_WITHIN)
        assert_dirs_removed(dirs)
        assert running is not None and running.done()
        assert isinstance(running.exception(), sky.PoolClosedError)
    finally:
        kill_quietly(pids)


@sky.function
def double_and_look(array: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Twice the array, and the pool's shared-memory files this node can see."""
    prefix = f"flotilla-{sky.instance_info().pool_id}-"
    seen = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    return array * 2, seen


def shm_files(pool_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"flotilla-{pool_id}-")]


def test_no_shared_memory_files_remain_after_a_large_broadcast() -> None:
    array = np.arange(20 * 1024 * 1024 // 8, dtype=np.float64)  # 20 MB
    with sky.Compute(nodes=2) as pool:
        results = double_and_look(array) @ pool
    for doubled, seen in results:
        np.testing.assert_array_equal(doubled, array * 2)
        assert seen, "the 20 MB argument did not travel through shared memory"
        owner = f"flotilla-{pool.pool_id}-{os.getpid()}."
        assert all(name.startswith(owner) for name in seen), seen  # they say whose they are
    assert shm_files(pool.pool_id) == []


def test_the_sweep_removes_only_the_files_of_gone_clients() -> None:
    """A pool start removes the shared-memory files whose client is gone; a live client's
    stay, and so do those of clients in another pid namespace (their pids mean nothing)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    start = procs.start_time(os.getpid())
    here = os.stat("/proc/self/ns/pid").st_ino
    names = {
        "gone": f"flotilla-0badc0de-{gone.pid}.{start}.{here}-probe",
        "live": f"flotilla-0badc0de-{os.getpid()}.{start}.{here}-probe",
        "reused pid": f"flotilla-0badc0de-{os.getpid()}.{start + 1}.{here}-probe",
        "elsewhere": f"flotilla-0badc0de-{gone.pid}.{start}.{here + 1}-probe",
    }
    for name in names.values():
        Path("/dev/shm", name).touch()
    try:
        removed = shm.sweep()
        assert names["gone"] in removed and names["reused pid"] in removed
        left = {k for k, name in names.items() if Path("/dev/shm", name).exists()}
        assert left == {"live", "elsewhere"}
    finally:
        for name in names.values():
            Path("/dev/shm", name).unlink(missing_ok=True)


# -- the client process goes away ------------------------------------------------------

CLIENT = """
    import json, os, time
    import flotilla as sky

    @sky.function
    def where():
        return os.getppid(), os.getpid(), os.getcwd()

    @sky.function
    def nap():
        print("napping")
        time.sleep(60)

    with sky.Compute(sky.Local(workdir=NODES_DIR), nodes=2) as pool:
        print(json.dumps(where() @ pool), flush=True)
        nap() >> pool
    print("the block ended normally", flush=True)
"""


def start_client(tmp_path: Path) -> tuple[Client, Path]:
    nodes_dir = tmp_path / "nodes"
    nodes_dir.mkdir()
    return Client(CLIENT.replace("NODES_DIR", repr(str(nodes_dir))), tmp_path), nodes_dir


@pytest.mark.parametrize("to", ["process", "thread"])
def test_ctrl_c_in_the_client_stops_everything(tmp_path: Path, to: str) -> None:
    """Ctrl-C during a call: also when the signal reaches a thread other than the main one
    (``to="thread"``), which Linux may choose and which does not wake the main thread."""
    client, nodes_dir = start_client(tmp_path)
    pids: list[int] = []
    try:
        first = client.expect(lambda line: line.startswith("[["))
        pids, dirs = pids_and_dirs([tuple(x) for x in json.loads(first)], 2)
        client.expect(lambda line: line.endswith(") napping"))  # the long call is running
        if to == "thread":
            signal_a_thread(client.proc.pid, signal.SIGINT)
        else:
            client.signal(signal.SIGINT)
        assert_all_gone(pids, STOP_WITHIN, "the pool's agents and executors")
        code = client.wait()
        assert code == -signal.SIGINT  # it ends as an interrupted program (130 in a shell)
        assert "Traceback" not in client.stderr()  # one line, no trace of the waits
        assert "flotilla: interrupted (Ctrl-C); the pool was closed" in client.stderr()
        assert "the block ended normally" not in client.rest_of_stdout()
        assert wait_until(lambda: not processes_in(nodes_dir), STOP_WITHIN)
        assert_dirs_removed(dirs)
    finally:
        client.kill()
        kill_quietly(pids)
        kill_quietly(processes_in(nodes_dir))


def test_agents_and_executors_exit_when_the_client_is_killed(tmp_path: Path) -> None:
    client, nodes_dir = start_client(tmp_path)
    pids: list[int] = []
    try:
        first = client.expect(lambda line: line.startswith("[["))
        pids, _ = pids_and_dirs([tuple(x) for x in json.loads(first)], 2)
        client.expect(lambda line: line.endswith(") napping"))
        client.signal(signal.SIGKILL)
        assert client.wait() == -signal.SIGKILL
        assert_all_gone(pids, ORPHANS_EXIT_WITHIN, "agents and executors of a killed client")
        assert wait_until(lambda: not processes_in(nodes_dir), ORPHANS_EXIT_WITHIN)
    finally:
        client.kill()
        kill_quietly(pids)
        kill_quietly(processes_in(nodes_dir))


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_a_local_pools_fork_server_ends_with_its_client(tmp_path: Path, sig: int) -> None:
    """The fork server the local pool's agents were forked from (their parent) ends with
    them when the client is interrupted (Ctrl-C) or killed: it outlives no pool."""
    client, nodes_dir = start_client(tmp_path)
    pids: list[int] = []
    try:
        first = client.expect(lambda line: line.startswith("[["))
        pids, _ = pids_and_dirs([tuple(x) for x in json.loads(first)], 2)
        servers = {parent_of(agent) for agent, _, _ in json.loads(first)}
        assert len(servers) == 1 and parent_of(*servers) == client.proc.pid, servers
        pids.extend(servers)
        client.expect(lambda line: line.endswith(") napping"))
        client.signal(sig)
        assert client.wait() == -sig
        assert_all_gone(pids, ORPHANS_EXIT_WITHIN, "the fork server, agents and executors")
    finally:
        client.kill()
        kill_quietly(pids)
        kill_quietly(processes_in(nodes_dir))


STARTING_CLIENT = """
    import os, time
    from pathlib import Path
    import flotilla as sky

    class Stall(sky.Plugin):
        '''Holds the pool's start on the nodes: each executor says where it is, then waits.'''

        def around_process(self, info):
            Path(MARKS, f"{os.getppid()}.{os.getpid()}").touch()
            time.sleep(60)

    with sky.Compute(sky.Local(workdir=NODES_DIR), nodes=2, plugins=[Stall()]) as pool:
        print("started", flush=True)
"""


def test_what_a_client_killed_with_its_agents_during_the_start_left_goes_at_the_next_start(
    tmp_path: Path,
) -> None:
    """The client, its agents and executors are killed with SIGKILL together (an OOM or
    cgroup kill: nobody cleans up) while the nodes start: the next pool start removes the
    shared-memory probe and the node folders they left."""
    marks, nodes_dir = tmp_path / "marks", tmp_path / "nodes"
    marks.mkdir()
    nodes_dir.mkdir()
    script = STARTING_CLIENT.replace("MARKS", repr(str(marks)))
    client = Client(script.replace("NODES_DIR", repr(str(nodes_dir))), tmp_path)
    pids: list[int] = []
    try:
        assert wait_until(lambda: len(list(marks.iterdir())) == 2, timeout=30), client.stderr()
        pids = [int(pid) for mark in marks.iterdir() for pid in mark.name.split(".")]
        owner = f"-{client.proc.pid}."
        left = [n for n in os.listdir("/dev/shm") if n.startswith("flotilla-") and owner in n]
        assert [n.rsplit("-", 2)[1] for n in left] == ["probe"]  # the start is under way
        kill_quietly([client.proc.pid, *pids])
        assert client.wait() == -signal.SIGKILL
        assert_all_gone(pids, STOP_WITHIN, "the killed client's agents and executors")
        # The probe is in the machine's /dev/shm: a pool that another test (another
        # pytest-xdist worker) starts meanwhile may sweep it first, which is the behaviour
        # under test. The node folders are this test's own: only its pool start sweeps them.
        assert len(list(nodes_dir.iterdir())) == 2  # nobody cleaned up
        with sky.Compute(sky.Local(workdir=str(nodes_dir)), nodes=1) as pool:
            assert (where() >> pool)[2]
        assert not (Path("/dev/shm") / left[0]).exists()
        assert list(nodes_dir.iterdir()) == []
    finally:
        client.kill()
        kill_quietly(pids)
        kill_quietly(processes_in(nodes_dir))


def test_the_temp_folders_of_a_killed_test_session_go_at_the_next_session_start() -> None:
    """A test session killed before its teardown leaves its own temp folder; the next
    session's start (conftest.py) removes it, and leaves a live session's alone."""
    killed = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); from _procs import session_folder; "
            "print(session_folder('killed'), flush=True); sys.stdin.read()",
            str(Path(__file__).parent),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ours = session_folder("live")
    try:
        assert killed.stdout is not None
        theirs = Path(killed.stdout.readline().strip())
        assert theirs.is_dir() and f"-{killed.pid}-" in theirs.name
        killed.kill()
        killed.wait()
        removed = remove_stale_test_folders()
        assert str(theirs) in removed and not theirs.exists()
        assert ours.is_dir()
    finally:
        killed.kill()
        killed.wait()
        shutil.rmtree(ours, ignore_errors=True)
