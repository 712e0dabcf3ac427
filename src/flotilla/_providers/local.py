"""The local provider: every node is an agent process tree on this machine."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import socket
import sys
import tempfile

from .._errors import ConfigurationError, ProvisionError
from .._image import is_installed
from .._system import procs
from .._wire.lanes import VAR as LANES_VAR
from .base import (
    AgentProcess,
    Allocation,
    Machine,
    PoolSpec,
    Provider,
)
from .bootstrap import node_packages, running_bundle
from .forks import ForkedAgent, ForkServer
from .limits import check_local_capacity, out_of_files
from .options import provider_init
from .pipe import PipeAgent, spawn
from .settings import LocalSettings

logger = logging.getLogger("flotilla")


class Local(Provider):
    """Run the nodes as local processes (the default provider).

    Each node is a separate agent process tree with its own working directory; node
    addresses are 127.0.0.1. By default the agents use this interpreter (its installed
    packages), flotilla and cloudpickle as this client has them, and the user's own code
    folders of the client's ``sys.path`` (never the client's standard library or
    site-packages: another interpreter could not load them), so a pool starts in a
    fraction of a second. The agents are forked by one fork server per pool (see
    ``forks``): one interpreter's start and imports for all of them.

    Args: the fields of :class:`LocalSettings` (``python``: another interpreter must be the
    client's Python minor version, or the pool is refused), and ``keep_folders``: name the
    nodes' folders ``node0``, ``node1``... in ``workdir`` and keep them when the pool closes:
    a later pool with the same ``workdir`` finds what the nodes left there (``flotilla
    stop`` / ``start``).
    """

    name = "local"
    settings: LocalSettings
    shares_filesystem = True
    elastic = True

    @provider_init(LocalSettings)
    def __init__(self) -> None:
        self.keep_folders = self.settings.keep_folders
        self.python = self.settings.python or sys.executable
        self.workdir = self.settings.workdir
        self.home = os.environ.get("FLOTILLA_HOME", "~/.flotilla")

    def validate(self, spec: PoolSpec) -> None:
        """Every node runs on this machine: each one's GPUs, CPUs and memory must fit it.
        (The nodes share it; a request is what one node may use, as on any provider.)"""
        check_local_capacity(spec.most)  # files, processes, memory: before anything starts
        cpus = os.cpu_count() or 1
        if spec.vcpus is not None and spec.vcpus > cpus:
            raise ConfigurationError(
                f"vcpus={spec.vcpus:g} per node requested but this machine has {cpus} CPU(s); "
                f"the local provider runs on this machine only: ask for at most {cpus}, or "
                "use a provider with larger machines"
            )
        mem = memory_gb()
        if spec.memory_gb is not None and mem and spec.memory_gb > mem:
            raise ConfigurationError(
                f"memory_gb={spec.memory_gb:g} per node requested but this machine has "
                f"{mem:.1f} GiB; the local provider runs on this machine only: ask for at "
                "most that, or use a provider with larger machines"
            )
        acc = spec.accelerator
        if acc is not None:
            have = local_gpu_count()
            if have < acc.count:
                raise ConfigurationError(
                    f"accelerator {acc} requested but this machine has {have} GPU(s); "
                    f"the local provider runs on this machine only: drop `accelerator=` "
                    f"or use a provider that has {acc.name} GPUs"
                )

    async def acquire(self, spec: PoolSpec) -> LocalAllocation:
        """One fresh work folder per node: a local "machine" is a process tree there."""
        if self.workdir is not None:
            try:
                os.makedirs(self.workdir, exist_ok=True)
            except OSError as e:
                raise ProvisionError(
                    f"cannot create the nodes' work folder {self.workdir!r}: {e}"
                ) from e
        await asyncio.get_running_loop().run_in_executor(None, self.remove_leftovers)
        allocation = LocalAllocation(self, spec)
        try:
            allocation.machines = [allocation.new_machine(r) for r in range(spec.nodes)]
            await allocation.forks_ready()
        except BaseException:
            await allocation.release()
            raise
        return allocation

    def remove_leftovers(self) -> list[str]:
        """Remove the node folders of gone clients (their agents were killed with them, by
        an OOM or cgroup kill, before they could remove their own); their paths."""
        parent = self.workdir or tempfile.gettempdir()
        try:
            names = os.listdir(parent)
        except OSError:
            return []
        removed = [os.path.join(parent, n) for n in procs.of_gone_owners(names, _NODE_DIR)]
        for folder in removed:
            _remove(folder)
        return removed


_NODE_DIR = re.compile(rf"flotilla-[0-9a-f]+-{procs.OWNER}-node\d+-")
"""A node folder's name: its pool, its client (the owner), its rank."""


class LocalAllocation(Allocation):
    """Work folders on this machine; an agent is a child process in one of them."""

    def __init__(self, provider: Local, spec: PoolSpec) -> None:
        super().__init__(spec, [])
        self.provider = provider
        self.env = dict(os.environ)
        self.env.pop("COMPUTE_POOL", None)
        self.user_path = user_code_path()
        self._folders: list[str] = []  # every folder ever made, removed at release
        self.forks: ForkServer | None = None  # the agents' fork server (see forks.py)
        root = None if provider.keep_folders else compiled_root()
        if root is not None:  # started now: it warms up while the folders are made
            try:
                self.forks = ForkServer(provider.python, root, self.env)
            except OSError as e:
                logger.warning("no local fork server (%s): each agent starts its interpreter", e)

    def new_machine(self, rank: int) -> Machine:
        try:
            if self.provider.keep_folders:  # kept: the same folder for this rank every time
                assert self.provider.workdir is not None
                folder = os.path.join(self.provider.workdir, f"node{rank}")
                os.makedirs(folder, exist_ok=True)
                shutil.rmtree(os.path.join(folder, _LIB), ignore_errors=True)
            else:
                prefix = f"flotilla-{self.spec.pool_id}-{procs.owner_tag()}-node{rank}-"
                with self.creating("work folder", prefix):
                    folder = tempfile.mkdtemp(prefix=prefix, dir=self.provider.workdir)
                    self._folders.append(folder)
        except OSError as e:
            raise ProvisionError(f"cannot create node {rank}'s work folder: {e}") from e
        links = os.path.join(folder, _LIB)  # flotilla and cloudpickle, as this client has them
        try:
            os.mkdir(links)
            if running_bundle() is None:  # (else: the agents import from the same bundle)
                for name, path in node_packages().items():
                    os.symlink(path, os.path.join(links, name))
        except OSError as e:
            raise ProvisionError(f"cannot prepare node {rank}'s work folder: {e}") from e
        return Machine(rank, "localhost", "127.0.0.1", folder)

    async def start_agent(self, machine: Machine) -> AgentProcess:
        command = [self.provider.python, "-m", "flotilla.agent"]
        try:
            # the agent removes its folder when it exits, even if this client was killed
            lib = running_bundle() or os.path.join(machine.ident, _LIB)
            path = os.pathsep.join([lib, *self.user_path])
            env = dict(self.env, FLOTILLA_NODE_DIR=machine.ident, PYTHONPATH=path)
            if self.provider.keep_folders:
                del env["FLOTILLA_NODE_DIR"]  # kept
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as e:
            raise out_of_files(e) or ProvisionError(
                f"cannot start the agent {command[0]!r}: {e}"
            ) from e
        agent: PipeAgent | None = None
        try:  # the agent's lane socket: its executors' lanes come through it (_node/lanes.py)
            ours.setblocking(False)
            if self.forks is not None:
                forked = self._fork(machine.ident, env, theirs.fileno())
                if forked is not None:
                    agent = PipeAgent(forked, address=machine.address, host=machine.host)
            if agent is None:
                env[LANES_VAR] = str(theirs.fileno())
                proc = spawn(command, cwd=machine.ident, env=env, pass_fds=(theirs.fileno(),))
                agent = PipeAgent(proc, address=machine.address, host=machine.host)
        except OSError as e:
            ours.close()
            raise out_of_files(e) or ProvisionError(
                f"cannot start the agent {command[0]!r}: {e}"
            ) from e
        finally:
            theirs.close()
        agent.lanes = ours
        return agent

    async def forks_ready(self) -> None:
        """Wait (in a worker thread) until the fork server has imported the agents'
        modules; without it (it failed), agents are spawned."""
        if self.forks is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.forks.wait_ready)
            except OSError as e:
                self._no_forks(e)

    def _fork(self, folder: str, env: dict[str, str], lanes: int) -> ForkedAgent | None:
        """An agent from the fork server; None (and no server any more) if it cannot."""
        assert self.forks is not None
        try:
            return self.forks.fork(folder, env, lanes)
        except OSError as e:
            self._no_forks(e)
            return None

    def _no_forks(self, e: OSError) -> None:
        logger.warning("the local fork server failed (%s): each agent starts its interpreter", e)
        if self.forks is not None:
            self.forks.close()
            self.forks = None

    async def replacement(self, rank: int, reason: str) -> Machine:
        """A new folder; the lost machine's goes."""
        machine = self.new_machine(rank)
        old = self.machines[rank]
        if old.ident in self._folders:
            _remove(old.ident)
        else:  # a kept folder, the new machine's too
            _unmount_under(old.ident)
        return machine

    async def candidate(self, rank: int) -> Machine | None:
        """A new folder."""
        return self.new_machine(rank)

    async def give_back(self, machine: Machine, failed: bool) -> None:
        if machine.ident in self._folders:
            self._folders.remove(machine.ident)
            _remove(machine.ident)
        else:
            _unmount_under(machine.ident)

    def sweep(self) -> None:
        """Remove the folders made (synchronous, see ``base.Allocation.sweep``)."""
        if self.forks is not None:
            self.forks.close()
        for folder in list(self._folders):
            _remove(folder)
        for machine in self.machines:  # kept folders: only what lost agents left mounted
            _unmount_under(machine.ident)


def _remove(folder: str) -> None:
    """Remove a node's folder, after detaching the bucket volumes mounted in it (a node
    lost with its mounts up: removing would delete the bucket's objects)."""
    _unmount_under(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _unmount_under(folder: str) -> None:
    from .._system.mounts import unmount_under  # (imported only when a pool ends)

    unmount_under(folder)


_LIB = ".flotilla-lib"
"""In a node's folder: links to the client's flotilla and cloudpickle packages (their
compiled copy, see ``bootstrap.node_packages``: an agent compiles none of it). A client
that runs from a bundle (a pool started on a node) gives its agents that bundle instead."""


def compiled_root() -> str | None:
    """The folder of the compiled copy of the node code (``bootstrap.node_packages``) when
    nothing else can be imported from it (the fork server's import path; the kept SSH
    bundle beside them is no module); None where there is none (no cache, or a client
    running from a bundle)."""
    if running_bundle() is not None:
        return None
    packages = node_packages()
    roots = {os.path.dirname(path) for path in packages.values()}
    if len(roots) != 1:
        return None
    root = roots.pop()
    try:
        others = set(os.listdir(root)) - set(packages)
    except OSError:
        return None
    importable = [
        name
        for name in others
        if name.endswith((".py", ".pyc", ".so")) or os.path.isdir(os.path.join(root, name))
    ]
    return None if importable else root


def user_code_path() -> list[str]:
    """The folders of this process's import path that hold the user's own code (not the
    interpreter's installation, not a site-packages), so agents import it as the client
    does."""
    out: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if path not in out and os.path.isdir(path) and not is_installed(path):
            out.append(path)
    return out


def local_gpu_count() -> int:
    """Number of NVIDIA GPUs of this machine (see ``_system.gpus``)."""
    from .._system.gpus import gpu_count

    return gpu_count()


def memory_gb() -> float:
    """This machine's memory in GiB (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 / 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (OSError, ValueError):
        return 0.0
