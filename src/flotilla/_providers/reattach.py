"""Reaching a named cluster's running agents again, after its daemon died.

A cluster's agents outlive their client for a grace period (``Compute.keep_agents``,
``_node/reattach.py``). :class:`Reattach` is the provider a new daemon opens its pool
with: it provisions nothing; each "machine" is a node of the cluster's record, and
"starting its agent" starts the re-attach bridge (``python -m flotilla._node.reattach
ADDRESS``, the command the node itself recorded) on that node, hands it the key over the
provider's own channel, and the bridge then carries the protocol to the agent that runs
there. The pool's client then speaks to the
agent as to one it started (the agent answers CONFIG with its READY: its executors and
the calls they run go on).

How the bridge is started is the provider's (:meth:`Reattach.bridge_command`): the local
provider runs the command as it is; the SSH provider through ``ssh`` as it started the
agent (its key, its pinned host keys). A provider with a ``reattach_command(node)``
method (SLURM: a step of the still-running job; Kubernetes: ``kubectl exec`` into the
pod; Container: ``exec`` into the container) runs it through its own shell, and its
``release_reattached(nodes)`` gives back what holds the nodes once their agents ended. A
cloud (a provider with ``reattaches_over_ssh``: AWS and the rented clouds of the cloud
kit) through ``ssh`` with the node's ``login``, the pool's own login key and pinned host
key (kept in the cluster's private folder, see ``cli/adopt.py``). Other providers cannot
re-attach yet (:func:`can_reattach`): their clusters' agents end with their daemon, as
before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import shlex
import subprocess
from dataclasses import dataclass
from typing import Any

from .._errors import ProvisionError
from .._system.procs import last_words
from .base import AgentProcess, Allocation, Machine, PoolSpec, Provider
from .pipe import PipeAgent, spawn

_PROBE_TIMEOUT = 60.0


@dataclass(frozen=True)
class Node:
    """A node of the cluster's record: where its agent runs and the command, run there,
    that bridges to it."""

    rank: int
    ip: str
    host: str
    workdir: str
    argv: tuple[str, ...]
    job: str = ""
    """The batch scheduler's job the node's agent runs in (SLURM's; "" when none)."""
    scheduler_node: str = ""
    """The batch scheduler's name for the node (SLURM's; "" when none)."""
    login: tuple[str, ...] = ()
    """A cloud node's: ``ssh`` options then ``USER@HOST``, logging in as its pool did."""


def can_reattach(provider: Provider) -> bool:
    """Whether a cluster on ``provider`` can be re-attached (its agents wait for it)."""
    from .local import Local
    from .ssh import SSH

    if isinstance(provider, Local | SSH | Reattach) or reattaches_over_ssh(provider):
        return True
    return hasattr(provider, "reattach_command")


def reattaches_over_ssh(provider: Provider) -> bool:
    """Whether ``provider`` is a cloud whose nodes are re-attached to over its pool's
    pinned SSH login (``Node.login``; the cloud kit's providers)."""
    return bool(getattr(provider, "reattaches_over_ssh", False))


class Reattach(Provider):
    """The running agents of ``nodes`` (on ``base``, the cluster's provider), reached
    with ``key`` (hex); provisions nothing."""

    name = "reattach"

    def __init__(self, base: Provider, nodes: list[Node], key: str) -> None:
        self.base = base
        self.nodes = nodes
        self.key = key

    def __repr__(self) -> str:
        return f"Reattach({self.base!r})"

    def bridge_command(self, node: Node) -> tuple[list[str], dict[str, Any]]:
        """The command that starts the bridge to ``node``'s agent, and Popen's arguments."""
        from .local import Local
        from .ssh import SSH

        if isinstance(self.base, Local):
            return list(node.argv), {}
        if node.login and reattaches_over_ssh(self.base):
            ssh = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30"]
            return [*ssh, *node.login, "exec " + shlex.join(node.argv)], {}
        if isinstance(self.base, SSH):
            for host in self.base.hosts:
                target = self.base.target(host)
                if node.ip in (target.address, target.host):
                    shell = self.base.shell(functools.partial(_same, target))
                    return shell.ssh_argv(target, "exec " + shlex.join(node.argv)), {}
            raise ProvisionError(f"node {node.rank} ({node.host}) is not one of the SSH hosts")
        through = getattr(self.base, "reattach_command", None)
        if through is not None:  # the provider's own shell (srun, kubectl exec, exec)
            return through(node)  # type: ignore[no-any-return]
        raise ProvisionError(f"the {self.base.name} provider cannot re-attach to its agents")

    def start_bridge(self, node: Node, probe: bool = False) -> subprocess.Popen[bytes]:
        """The bridge to ``node``'s agent, given the key (on its stdin); ``probe``: it
        only checks that the agent is there (see ``bridge``)."""
        if probe:
            node = dataclasses.replace(node, argv=(*node.argv, "--probe"))
        argv, kwargs = self.bridge_command(node)
        proc = spawn(argv, **kwargs)
        assert proc.stdin is not None
        proc.stdin.write(f"{self.key}\n".encode())
        return proc

    def probe(self) -> dict[int, str]:
        """The nodes whose agent cannot be reached (gone: its host, its process), by rank,
        with why (each checked by a bridge that only probes: the agent's state is left
        as it is)."""
        gone: dict[int, str] = {}
        started = []
        for node in self.nodes:
            if not node.argv:
                gone[node.rank] = "its agent had no re-attach socket"
                continue
            try:
                started.append((node, self.start_bridge(node, probe=True)))
            except (OSError, ProvisionError) as e:
                gone[node.rank] = f"cannot reach it: {e}"
        for node, proc in started:
            why = last_words(proc, _PROBE_TIMEOUT)
            if proc.returncode != 0:
                gone[node.rank] = why or f"its bridge exited ({proc.returncode})"
        return gone

    def stop(self, ranks: list[int]) -> None:
        """End the agents of the nodes at ``ranks`` (SHUTDOWN through a bridge: they stop
        what runs there and exit) and remove their folders, as closing their pool would."""
        from .._wire.frames import Kind, frame

        started = []
        for node in self.nodes:
            if node.rank in ranks:
                try:
                    started.append(self.start_bridge(node))
                except (OSError, ProvisionError):
                    continue
        shutdown = b"".join(frame(Kind.SHUTDOWN, 0))
        for proc in started:
            last_words(proc, _PROBE_TIMEOUT, shutdown)  # its stream ends when the agent exits
        self.sweep([n for n in self.nodes if n.rank in ranks])

    def sweep(self, nodes: list[Node]) -> None:
        """Remove the folders of ``nodes`` (whose agents ended) where the provider made
        them (the local provider's, unless it keeps them), and give back what held them
        (the provider's ``release_reattached``)."""
        from .local import Local, _remove

        if isinstance(self.base, Local) and not self.base.keep_folders:
            for node in nodes:
                _remove(node.workdir)
        release = getattr(self.base, "release_reattached", None)
        if release is not None and nodes:  # the job, the pods, the containers
            release(nodes)

    async def acquire(self, spec: PoolSpec) -> ReattachAllocation:
        if spec.nodes != len(self.nodes):
            raise ProvisionError(
                f"{spec.nodes} node(s) asked of a re-attach to {len(self.nodes)} node(s)"
            )
        return ReattachAllocation(self, spec)


def _same(target: Any, _: Machine) -> Any:
    return target


class ReattachAllocation(Allocation):
    """The recorded nodes as machines; an "agent" is a bridge to the running one."""

    def __init__(self, provider: Reattach, spec: PoolSpec) -> None:
        machines = [Machine(i, n.host, n.ip, n.workdir) for i, n in enumerate(provider.nodes)]
        super().__init__(spec, machines)
        self.provider = provider

    async def start_agent(self, machine: Machine) -> AgentProcess:
        node = self.provider.nodes[machine.rank]
        loop = asyncio.get_running_loop()
        try:
            proc = await loop.run_in_executor(None, self.provider.start_bridge, node)
        except OSError as e:
            raise ProvisionError(f"cannot reach node {node.rank}'s agent again: {e}") from e
        return PipeAgent(proc, address=node.ip, host=node.host)

    def sweep(self) -> None:
        """The agents have ended: their folders go (see :meth:`Reattach.sweep`)."""
        self.provider.sweep(self.provider.nodes)
