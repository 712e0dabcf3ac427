"""The provider model (flotilla/_providers/base.py) step by step: acquire machines, start an
agent on one, replace the machine at a rank, release everything; states follow the
transitions their enums document. Local on this machine, SSH on the namespace test hosts."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from _procs import assert_all_gone, processes_in
from test_ssh import assert_a_plain_interpreter, interpreter_view

import flotilla as sky
from flotilla._client import lanes as client_lanes
from flotilla._errors import ProvisionError
from flotilla._providers.base import (
    AgentProcess,
    AllocationState,
    Machine,
    MachineState,
    PoolSpec,
    start_agents,
)
from flotilla._providers.local import Local, LocalAllocation
from flotilla._providers.pipe import PipeAgent


def spec(nodes: int) -> PoolSpec:
    return PoolSpec(secrets.token_hex(4), nodes, None, sky.Image(), (), sky.Options())


def pid_of(agent: AgentProcess) -> int:
    assert isinstance(agent, PipeAgent)
    return agent.proc.pid


@pytest.fixture
def nodes_dir(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "nodes"
    yield folder
    for pid in processes_in(folder) if folder.exists() else []:
        os.kill(pid, 9)


# -- Local ---------------------------------------------------------------------------------


def test_local_acquire_start_replace_release(nodes_dir: Path) -> None:
    provider = Local(workdir=str(nodes_dir))
    lost: list[tuple[int, str]] = []

    async def scenario() -> dict[str, Any]:
        allocation = await provider.acquire(spec(2))
        allocation.watch(lambda rank, why: lost.append((rank, why)))
        seen: dict[str, Any] = {"state": allocation.state, "machines": list(allocation.machines)}
        seen["acquired"] = {
            m.ident: allocation.machine_states[m.ident] for m in allocation.machines
        }
        agents = await start_agents(allocation, allocation.machines)
        seen["running"] = [allocation.machine_states[m.ident] for m in allocation.machines]
        seen["cwds"] = [os.readlink(f"/proc/{pid_of(a)}/cwd") for a in agents]
        old = allocation.machines[1]
        allocation.report_lost(1, "its agent was killed")
        seen["lost"] = allocation.machine_states[old.ident]
        await agents[1].terminate()
        new = await allocation.replace(1, "its agent was killed")
        seen["new"], seen["old_folder_exists"] = new, os.path.exists(old.ident)
        seen["after_replace"] = (
            allocation.machine_states[old.ident],
            allocation.machine_states[new.ident],
        )
        [fresh] = await start_agents(allocation, [new])
        seen["fresh_cwd"] = os.readlink(f"/proc/{pid_of(fresh)}/cwd")
        seen["pids"] = [pid_of(agents[0]), pid_of(agents[1]), pid_of(fresh)]
        seen["new_state"] = allocation.machine_states[new.ident]
        for agent in (agents[0], fresh):
            await agent.terminate()
        await allocation.release()
        await allocation.release()  # idempotent
        seen["released"] = (allocation.state, set(allocation.machine_states.values()))
        return seen

    seen = asyncio.run(scenario())
    first: list[Machine] = seen["machines"]
    assert seen["state"] is AllocationState.READY
    assert [m.rank for m in first] == [0, 1] and all(m.address == "127.0.0.1" for m in first)
    assert set(seen["acquired"].values()) == {MachineState.PENDING}
    assert seen["running"] == [MachineState.RUNNING, MachineState.RUNNING]
    assert seen["cwds"] == [m.ident for m in first]  # one work folder per machine
    assert seen["lost"] is MachineState.LOST and lost == [(1, "its agent was killed")]
    new: Machine = seen["new"]
    assert new.rank == 1 and new.ident != first[1].ident
    assert not seen["old_folder_exists"]  # the lost machine's folder went with it
    assert seen["after_replace"] == (MachineState.RELEASED, MachineState.PENDING)
    assert seen["fresh_cwd"] == new.ident  # a new process tree in a new folder
    assert seen["new_state"] is MachineState.RUNNING
    assert seen["released"] == (AllocationState.RELEASED, {MachineState.RELEASED})
    assert_all_gone(seen["pids"], timeout=5, what="agents")
    assert list(nodes_dir.iterdir()) == []  # every folder ever made is gone


class _BrokenRank2(Local):
    """Starts the agents of ranks 0 and 1, then fails to start rank 2's."""

    started: list[int]

    async def acquire(self, spec: PoolSpec) -> LocalAllocation:
        allocation = await super().acquire(spec)
        provider = self
        provider.started = []
        original = allocation.start_agent

        async def start_agent(machine: Machine) -> AgentProcess:
            if machine.rank == 2:  # started last: the others are up by now
                raise ProvisionError("node 2: no agent today")
            agent = await original(machine)
            provider.started.append(pid_of(agent))
            return agent

        allocation.start_agent = start_agent  # type: ignore[method-assign]
        return allocation


def test_provider_start_releases_everything_when_one_agent_fails(nodes_dir: Path) -> None:
    provider = _BrokenRank2(workdir=str(nodes_dir))
    with pytest.raises(ProvisionError, match="node 2: no agent today"):
        asyncio.run(provider.start(spec(3)))
    assert len(provider.started) == 2
    assert_all_gone(provider.started, timeout=5, what="the agents that had started")
    assert list(nodes_dir.iterdir()) == []


def test_a_pool_whose_agent_cannot_start_leaves_nothing(nodes_dir: Path) -> None:
    provider = _BrokenRank2(workdir=str(nodes_dir))
    pool = sky.Compute(provider, nodes=3)
    with pytest.raises(ProvisionError, match="node 2: no agent today"):
        pool.open()
    assert pool.state is sky.PoolState.CLOSED
    assert_all_gone(provider.started, timeout=5, what="the agents that had started")
    assert list(nodes_dir.iterdir()) == []


@sky.function
def lineage() -> dict[str, Any]:
    """Where this executor runs: its agent, the agent's parent and the client above it,
    their command lines, the agent's descriptors, this process's folder and import path."""

    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    def argv(pid: int) -> list[str]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]

    agent = parent(os.getpid())
    server = parent(agent)
    fds = os.listdir(f"/proc/{agent}/fd")
    return {
        "executor": os.getpid(),
        "agent": agent,
        "server": server,
        "client": parent(server),
        "agent_argv": argv(agent),
        "server_argv": argv(server),
        "agent_fds": [os.readlink(f"/proc/{agent}/fd/{fd}") for fd in fds],
        "cwd": os.getcwd(),
        "node_dir": os.environ.get("FLOTILLA_NODE_DIR", ""),
        "path": [os.path.realpath(p) for p in sys.path if p],
    }


def _fds(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []


def test_a_local_pools_agents_are_forked_by_its_fork_server(nodes_dir: Path) -> None:
    """A local pool's agents are forked by one fork server, a child of the client (one
    interpreter's start for all of them): each in a session of its own, with its own
    folder, environment and import path, shown as ``python -m flotilla.agent``, holding
    none of the server's descriptors (its socket: its only socket is its lane socket, see
    ``_node/lanes.py``); an agent killed takes its executor with it, and the server ends
    with the pool."""
    with sky.Compute(provider=Local(workdir=str(nodes_dir)), nodes=2) as pool:
        seen = lineage() @ pool
        assert len({s["agent"] for s in seen}) == 2
        servers = {s["server"] for s in seen}
        assert len(servers) == 1
        for s in seen:
            assert s["client"] == os.getpid()
            assert s["server_argv"][1:3] == ["-m", "flotilla._node.forkserver"]
            assert s["agent_argv"][1:] == ["-m", "flotilla.agent"]
            assert os.getsid(s["agent"]) == s["agent"]
            sockets = {fd for fd in s["agent_fds"] if fd.startswith("socket:")}
            assert len(sockets) == 1  # its lane socket
            server = {os.readlink(f"/proc/{s['server']}/fd/{fd}") for fd in _fds(s["server"])}
            assert not sockets & server
            assert os.path.realpath(s["node_dir"]) == s["cwd"]
            assert os.path.join(s["cwd"], ".flotilla-lib") in s["path"]
        first = seen[0]
        os.kill(first["agent"], signal.SIGKILL)
        assert_all_gone([first["agent"], first["executor"]], 60, "the killed agent and executor")
    assert_all_gone([*servers, *(s["executor"] for s in seen)], 60, "the fork server, executors")


def test_a_local_executor_has_the_site_packages_of_a_plain_interpreter(nodes_dir: Path) -> None:
    """A local agent is forked from the fork server, its executors from the agent: they
    must still be the ordinary interpreter (its site-packages and ``.pth`` files, no
    ``-S`` passed on to the processes a task starts)."""
    with sky.Compute(provider=Local(workdir=str(nodes_dir)), nodes=1) as pool:
        assert_a_plain_interpreter(interpreter_view() >> pool)


# -- SSH -------------------------------------------------------------------------------------


def test_ssh_spare_hosts_then_reconnection(ssh_lab: Lab) -> None:
    spare = ssh_lab.add_host()
    hosts = [*ssh_lab.hosts[:2], spare]
    provider = ssh_lab.provider(hosts)
    pool_spec = spec(2)
    provider.validate(pool_spec)

    async def scenario() -> dict[str, Any]:
        allocation = await provider.acquire(pool_spec)
        seen: dict[str, Any] = {"hosts": [m.host for m in allocation.machines]}
        agents = await start_agents(allocation, allocation.machines)
        old = allocation.machines[1]
        await agents[1].terminate()
        first = await allocation.replace(1, "lost")  # the spare
        [on_spare] = await start_agents(allocation, [first])
        await on_spare.terminate()
        second = await allocation.replace(1, "lost again")  # no spare left: the same host
        [again] = await start_agents(allocation, [second])
        seen["replacements"] = [first, second]
        seen["agents"] = [on_spare.host, again.host]
        seen["states"] = [allocation.machine_states[m.ident] for m in (old, first, second)]
        await again.terminate()
        await agents[0].terminate()
        await allocation.release()
        seen["released"] = set(allocation.machine_states.values())
        return seen

    try:
        seen = asyncio.run(scenario())
        assert seen["hosts"] == [hosts[0].addr, hosts[1].addr]
        first, second = seen["replacements"]
        assert (first.rank, first.host) == (1, spare.addr)
        assert (second.rank, second.host) == (1, spare.addr)  # reconnected
        assert first.ident != second.ident  # each machine of the history has its own ident
        assert seen["agents"] == [spare.addr, spare.addr]
        assert seen["states"] == [
            MachineState.RELEASED,
            MachineState.RELEASED,
            MachineState.RUNNING,
        ]
        assert seen["released"] == {MachineState.RELEASED}
        assert ssh_lab.wait_no_agents(hosts, timeout=5.0) == {}
    finally:
        ssh_lab.remove_host(spare)


# -- resource requests (vcpus=, memory_gb=) -------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vcpus": 0}, "vcpus must be a positive number"),
        ({"vcpus": -2}, "vcpus must be a positive number"),
        ({"vcpus": "4"}, "vcpus must be a positive number"),
        ({"vcpus": True}, "vcpus must be a positive number"),
        ({"memory_gb": float("nan")}, "memory_gb must be a positive number"),
        ({"memory_gb": float("inf")}, "memory_gb must be a finite number"),
    ],
)
def test_resource_requests_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sky.Compute(**kwargs)


@sky.function
def _pid() -> int:
    return os.getpid()


class _Recording(Local):
    """The local provider, keeping the spec it was asked to validate."""

    seen: list[PoolSpec]

    def validate(self, spec: PoolSpec) -> None:
        self.seen = [*getattr(self, "seen", []), spec]
        super().validate(spec)


def test_resource_requests_reach_the_provider(nodes_dir: Path) -> None:
    provider = _Recording(workdir=str(nodes_dir))
    with sky.Compute(provider=provider, nodes=1, vcpus=1, memory_gb=0.25) as pool:
        assert (_pid() >> pool) != os.getpid()
    assert {(s.vcpus, s.memory_gb) for s in provider.seen} == {(1.0, 0.25)}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vcpus": (os.cpu_count() or 1) + 1}, "CPU"),
        ({"memory_gb": 1 << 20}, "GiB"),
    ],
)
def test_local_refuses_more_than_this_machine_has(
    nodes_dir: Path, kwargs: dict[str, Any], message: str
) -> None:
    """Refused before anything starts: no node folder is made."""
    from flotilla._errors import ConfigurationError

    pool = sky.Compute(provider=Local(workdir=str(nodes_dir)), nodes=2, **kwargs)
    with pytest.raises(ConfigurationError, match=f"{message}.*the local provider runs on this"):
        pool.open()
    assert not nodes_dir.exists() or not any(nodes_dir.iterdir())
    assert pool.state is sky.PoolState.NEW


def test_a_terminated_agents_descriptors_leave_no_watch_behind() -> None:
    """An agent terminated while the loop still watched its stderr (a start that failed:
    no start_reading yet), then a new agent given the same descriptor numbers: the new
    one's stderr, ssh's own words on why it failed, is read (it was lost: the stale
    watch kept the new pipe out of epoll, and the error said only 'exit status 255')."""
    from flotilla._providers.pipe import spawn

    async def run() -> tuple[bool, bytes]:
        loop = asyncio.get_running_loop()
        first = PipeAgent(spawn(["sh", "-c", "exec sleep 60"]), "a", "a")
        first._read_stderr(loop)
        first.proc.kill()
        first.proc.wait()  # ended, its end of stream not yet seen by the loop
        await first.terminate()
        await first.terminate()  # twice (a failed start, then the cleanup): harmless
        second = PipeAgent(spawn(["sh", "-c", "echo said >&2"]), "b", "b")
        reused = second._err in (first._out, first._err)
        assert await second.read_line(b"X") is None
        await second.stderr_ended(10)
        await second.terminate()
        return reused, second.err_tail

    reused, said = asyncio.run(run())
    assert reused  # the scenario: the new agent got a number the first one had watched
    assert said == b"said\n"


@sky.function
def pause(seconds: float) -> float:
    import time

    time.sleep(seconds)
    return seconds


def test_a_lone_calls_waiter_sleeps_at_once_after_a_slow_answer() -> None:
    """``>>``'s waiter polls without sleeping for a while first (at most SPIN s), but only
    while answers came that soon: after a slow call it sleeps at once (no CPU spent
    spinning)."""
    from flotilla._providers import pipe

    with sky.Compute(nodes=1) as pool:
        proc = pool._nodes[0].proc
        assert isinstance(proc, PipeAgent) and proc._answered <= pipe.SPIN  # a new pool spins
        assert pause(20 * pipe.SPIN) >> pool == 20 * pipe.SPIN
        assert proc._answered > pipe.SPIN
        assert proc._spin_window() == 0.0


def test_a_lone_calls_answer_waits_for_its_caller_not_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller held up right after writing its call (preempted on a busy machine) finds
    the answer waiting for it: the loop's thread never takes a lone call's answer (it
    would then have to wake the caller: two more wake-ups per call), however late the
    caller comes to read it."""
    import fcntl
    import termios
    import threading

    from _procs import wait_until

    from flotilla._client.dispatch import Dispatcher
    from flotilla._wire.frames import HEADER, Kind, frame
    from flotilla._wire.serialize import encode, pickle_obj

    answer = HEADER.size + sum(  # STARTED, then the RESULT of pause(0.0)
        len(p) for p in frame(Kind.RESULT, 1, b"\0", *encode(pickle_obj(0.0)))
    )
    monkeypatch.setattr(client_lanes, "send", lambda *_: None)  # the agent's way
    with sky.Compute(nodes=1) as pool:
        assert pause(0.0) >> pool == 0.0  # (the function is on the node now)
        settled_in: list[int] = []
        real_settle, real_write = Dispatcher.settle, PipeAgent.write

        def settle(self: Dispatcher, sub: Any, **kw: Any) -> None:
            settled_in.append(threading.get_ident())
            real_settle(self, sub, **kw)

        def unread(agent: PipeAgent) -> int:
            size = bytearray(4)
            fcntl.ioctl(agent._out, termios.FIONREAD, size)
            return int.from_bytes(size, sys.byteorder)

        def write(self: PipeAgent, parts: Any, give_up: Any = None) -> None:
            real_write(self, parts, give_up)  # then the caller is held up until the answer
            assert wait_until(lambda: bool(settled_in) or unread(self) >= answer, 60)

        monkeypatch.setattr(Dispatcher, "settle", settle)
        monkeypatch.setattr(PipeAgent, "write", write)
        assert pause(0.0) >> pool == 0.0
        monkeypatch.undo()
        assert settled_in == [threading.get_ident()]


def test_a_lone_call_interrupted_before_its_read_leaves_the_stream_to_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C between a lone call's write and its read (the waiter held its node's stream
    for itself): the loop reads that node again, so the next call, the pool's close and
    its results go on."""
    from flotilla._client.node import Node

    monkeypatch.setattr(client_lanes, "send", lambda *_: None)  # the agent's way
    with sky.Compute(nodes=1) as pool:
        assert pause(0.0) >> pool == 0.0

        def interrupted(self: Node, future: Any) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(Node, "wait_direct", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pause(0.0) >> pool
        monkeypatch.undo()
        assert (pause(0.0) > pool).result(timeout=60) == 0.0  # read by the loop


def _watched(agent: PipeAgent) -> bool:
    """Whether the loop's epoll set watches ``agent``'s stdout (the kernel's list of it:
    ``/proc/self/fdinfo`` of the epoll descriptor)."""
    from flotilla._providers.pipe import _epoll_of

    assert agent._loop is not None
    epoll = _epoll_of(agent._loop)
    assert epoll is not None
    lines = Path(f"/proc/self/fdinfo/{epoll.fileno()}").read_text().splitlines()
    return any(line.split()[1] == str(agent._out) for line in lines if line.startswith("tfd:"))


def test_a_call_for_the_loop_after_lone_calls_gives_it_the_stream_back() -> None:
    """Lone calls leave the loop's watch of their node's stream off between them
    (``PipeAgent.watch``); a call whose answer is the loop's (``>``) puts it back as it is
    sent, not at the next heartbeat tick, a quarter second later."""
    with sky.Compute(nodes=1) as pool:
        agent = pool._nodes[0].proc
        assert isinstance(agent, PipeAgent)
        for _ in range(3):
            assert pause(0.0) >> pool == 0.0
        fut = pause(0.5) > pool
        assert _watched(agent)
        assert fut.result(timeout=60) == 0.5
        assert pause(0.0) >> pool == 0.0  # the lone calls go on


def test_a_node_lost_after_lone_calls_is_heard_without_a_call() -> None:
    """After lone calls (the loop's watch of the stream left off between them), the loop
    still hears its node: the agent killed, its end of stream is read by the next
    heartbeat tick's look, not left for a next call or the silence timeout (ten minutes
    here)."""
    from _procs import wait_until

    with sky.Compute(nodes=1, options=sky.Options(heartbeat_timeout=600)) as pool:
        node = pool._nodes[0]
        for _ in range(3):
            assert pause(0.0) >> pool == 0.0
        os.kill(int(node.hello_info["pid"]), signal.SIGKILL)
        assert wait_until(lambda: node.ended, 120)


def _runnable() -> int:
    """Threads the kernel counts runnable right now, machine-wide (/proc/loadavg)."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])


def test_a_waiter_counts_the_cores_it_may_run_on() -> None:
    """A process allowed one core (a container's share, ``taskset``) has no idle core as
    soon as one other thread is runnable, however many the machine has: its waiter
    compares the runnable threads with its own cores, not the machine's."""
    import sys

    probe = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from flotilla._providers import pipe; print(pipe._CORES)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_a_lone_calls_waiter_does_not_spin_on_a_busy_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With two busy-loop processes per core no core is idle: a lone call's waiter sleeps
    in ``poll`` at once (never a ``poll(0)`` spin), leaving the CPU to the node that has to
    answer; even a new pool's first call, whose waiter would spin on an idle machine."""
    import select
    import sys
    import threading

    from _procs import wait_until

    from flotilla._providers import pipe

    cores = os.cpu_count() or 1
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(2 * cores)
    ]
    try:
        assert wait_until(lambda: _runnable() > 2 * cores, 60)  # the loops run
        with sky.Compute(nodes=1) as pool:
            waiter = threading.get_ident()
            spins: list[float] = []
            sleeps: list[float] = []
            real_poll = select.poll

            class Watched:  # the real poll, noting this thread's waits
                def __init__(self) -> None:
                    self._poll = real_poll()

                def register(self, fd: int, events: int) -> None:
                    self._poll.register(fd, events)

                def poll(self, timeout: float | None = None) -> list[tuple[int, int]]:
                    if threading.get_ident() == waiter and timeout is not None:
                        (spins if timeout == 0 else sleeps).append(timeout)
                    return self._poll.poll(timeout)

            monkeypatch.setattr(pipe.select, "poll", Watched)
            for _ in range(5):  # until the waiter read the answer itself (not the loop)
                assert pause(0.1) >> pool == 0.1
                if sleeps:
                    break
            monkeypatch.undo()
            assert sleeps, "the waiter never read the stream itself"
            assert not spins
    finally:
        for p in loops:
            p.kill()
            p.wait()
