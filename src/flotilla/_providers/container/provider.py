"""The Container provider: each node a local container (docker or podman); the agents run
through ``<binary> exec -i``.

**Containers.** A pool of N nodes is N containers named ``<prefix>-<pool>-<rank>``, on a
network of their own (``flotilla-<pool>``, made first, removed last) or on a shared one
(``Container(network=...)``: made when missing, never removed). Every container and the
pool's network carry the labels ``flotilla.managed=true``, ``flotilla.pool=<id>``,
``flotilla.client=<host:pid:start>`` (and ``flotilla.rank=<rank>``). A container's own process is a
*holder* (a few lines of Python that wait for SIGTERM): the agent starts in it with
``exec -i``, whose stdin/stdout are the protocol channel, and the client's flotilla is sent
over it once per container (no SSH daemon, no image build). ``instance_info().peers`` are
the containers' addresses on the network (node 0's is ``head_addr``), so distributed
frameworks (gloo, NCCL) connect across containers as across machines. ``vcpus`` and
``memory_gb`` become ``--cpus`` and ``--memory``.

**Lost containers.** A node whose agent dies or whose container is removed ends its exec
stream: the node is lost and replaced by a new container at the same rank (the old one
removed).

**Nothing left.** Closing the pool (also on exceptions and Ctrl-C) stops the agents, removes
the pool's containers (``rm -f``) and its own network. An engine command it cut short (a
``run`` of a start interrupted, of an elastic pool growing) is let end first: killed while
it sets up a container's network, podman leaves that network namespace behind. A client
killed with SIGKILL: a *janitor*, a small process started with the pool in a session of its
own, reads a pipe only the client holds; at its end of input without the client's "done"
it removes the pool's containers and network itself. What even that missed (the janitor
killed too) is found by its labels: :func:`..container.orphans.remove_orphans` (``flotilla
down --orphans``) removes the pools whose client is gone.

**A named cluster's daemon dies** (kill -9; ``PoolSpec.keep_agents``): its agents wait for
a new daemon (``_providers/reattach.py``), so the containers must stay. Each agent's
``exec`` process inherits the write end of the janitor's stdin (:meth:`ExecShell.holds`):
the janitor sees end of input only once the client *and* every agent ended, and removes
the pool then. Nobody re-attaching, the agents end after the grace and the janitor removes
the containers; a new daemon reaches the agents with ``exec`` into the same containers
(:meth:`Container.reattach_command`) and removes the pool once they ended
(:meth:`Container.release_reattached`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..base import AgentProcess, Machine, PoolSpec, Provider
from ..bootstrap import NoAnswer
from ..launch import RemoteShell, ShellAllocation
from ..options import provider_init
from .settings import ContainerSettings

if TYPE_CHECKING:
    from ..reattach import Node

logger = logging.getLogger("flotilla.container")

MANAGED = "flotilla.managed=true"
POOL_LABEL = "flotilla.pool"
CLIENT_LABEL = "flotilla.client"
RANK_LABEL = "flotilla.rank"
CALL_TIMEOUT = 120.0
"""Seconds an engine command (run, inspect, rm...) may take."""

HOLDER = (
    "import signal, sys\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "while True:\n"
    "    signal.pause()\n"
)
"""A container's own process: nothing but waiting to be stopped (the agents are exec'd)."""

JANITOR = """\
import json, subprocess, sys
base, pool, network = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
said = sys.stdin.buffer.read()
if said.endswith(b"done"):
    sys.exit(0)
def run(args):
    try:
        return subprocess.run(base + args, capture_output=True, text=True, timeout=120).stdout
    except Exception:
        return ""
ids = run(["ps", "-a", "-q", "--filter", "label=flotilla.pool=" + pool]).split()
if ids:
    run(["rm", "-f", *ids])
if network:
    run(["network", "rm", network])
"""
"""Removes a pool's containers and network once the client is gone (see the module doc)."""


def said(stderr: str) -> str:
    """The engine's message, on one line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    return "; ".join(lines[-3:]) or "(no message)"


class Engine:
    """The container engine's command line (``docker`` or ``podman``)."""

    def __init__(self, settings: ContainerSettings) -> None:
        self.settings = settings
        self.podman = settings.engine == "podman"

    def base(self) -> list[str]:
        """The engine's command and its own arguments."""
        return [self.settings.binary, *self.settings.binary_args]

    def check_local(self) -> None:
        """ConfigurationError when the engine's command is not on this machine."""
        if shutil.which(self.settings.binary) is None:
            raise ConfigurationError(
                f"Container(binary={self.settings.binary!r}): no such command on this "
                f"machine's PATH; install {self.settings.engine} or name its path"
            )

    async def call(self, args: list[str], timeout: float = CALL_TIMEOUT) -> str:
        """Run ``<engine> args``; its stdout. ProvisionError with the engine's message when
        it fails. Cancelled, it lets the command end first (:func:`_finish`)."""
        argv = [*self.base(), *args]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except OSError as e:
            raise ProvisionError(
                f"cannot run {self.settings.binary}: {e}", cause=ProvisionCause.SPAWN
            ) from e
        answer = asyncio.ensure_future(proc.communicate())
        try:
            async with asyncio.timeout(timeout):
                out, err = await asyncio.shield(answer)
        except asyncio.CancelledError:
            await _finish(proc, answer, timeout)
            raise
        except BaseException:
            await _kill(proc, answer)
            raise
        if proc.returncode != 0:
            raise ProvisionError(
                f"{self.settings.engine} {args[0]} failed (exit status {proc.returncode}): "
                f"{said(err.decode(errors='replace'))}"
            )
        return out.decode(errors="replace")

    def remove_args(self, names: list[str]) -> list[str]:
        """``rm -f`` of ``names`` (podman: without its 10 s stop grace)."""
        return ["rm", "-f", *(["-t", "0"] if self.podman else []), *names]

    def call_now(self, args: list[str], timeout: float = CALL_TIMEOUT) -> str:
        """:meth:`call`, synchronously (no event loop)."""
        argv = [*self.base(), *args]
        try:
            proc = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ProvisionError(f"cannot run {self.settings.binary}: {e}") from e
        if proc.returncode != 0:
            raise ProvisionError(
                f"{self.settings.engine} {args[0]} failed (exit status {proc.returncode}): "
                f"{said(proc.stderr.decode(errors='replace'))}"
            )
        return proc.stdout.decode(errors="replace")

    async def remove_pool(self, pool_id: str, network: str | None) -> list[str]:
        """:meth:`remove_pool_now` in a worker thread."""
        return await asyncio.to_thread(self.remove_pool_now, pool_id, network)

    def remove_pool_now(self, pool_id: str, network: str | None) -> list[str]:
        """Remove the containers labelled for ``pool_id`` and ``network`` (when given);
        the containers' ids. Synchronous."""
        ids = self.call_now(["ps", "-a", "-q", "--filter", f"label={POOL_LABEL}={pool_id}"])
        found = ids.split()
        if found:
            self.call_now(self.remove_args(found))
        if network is not None:
            try:
                self.call_now(["network", "rm", network])
            except ProvisionError as e:
                if "no such network" not in str(e).lower() and "not found" not in str(e).lower():
                    raise
        return found


class Container(Provider):
    """Run each node as a local container (docker or podman), reached through ``exec``.

    ``Compute(provider=Container(binary="podman"), nodes=3)``: three containers on a network
    of their own, forming one cluster (peers, head, DDP across them). Needs the engine's
    command on this machine and an image with Python of the client's minor version (see
    docs/providers.md, "Local containers").
    """

    name = "container"
    settings: ContainerSettings
    elastic = True
    """Elastic pools: a container is run per node added and removed per node released."""

    @provider_init(ContainerSettings)
    def __init__(self) -> None:
        self.engine = Engine(self.settings)

    def validate(self, spec: PoolSpec) -> None:
        self.engine.check_local()
        rootfs = self.settings.rootfs
        if rootfs is not None and not Path(rootfs).is_dir():
            raise ConfigurationError(f"Container(rootfs={rootfs!r}): no such folder")
        if spec.accelerator is not None:
            raise ConfigurationError(
                f"the Container provider gives its containers no accelerators; "
                f"{spec.accelerator} cannot be honoured (pass GPUs with run_args, e.g. "
                "['--device', 'nvidia.com/gpu=all'], and no accelerator=)"
            )

    def reattach_command(self, node: Node) -> tuple[list[str], dict[str, Any]]:
        """The bridge to ``node``'s agent: ``exec`` into its container."""
        return [*self.engine.base(), "exec", "-i", node.host, *node.argv], {}

    def release_reattached(self, nodes: list[Node]) -> None:
        """Remove the pool of ``nodes`` (whose agents ended): its containers, found by
        their pool's label, and its own network."""
        pools = set()
        for node in nodes:
            try:
                data = json.loads(self.engine.call_now(["inspect", node.host]))
            except (ProvisionError, ValueError):
                continue  # gone already (the janitor removed it)
            pools |= {pool_labels(info).get(POOL_LABEL, "") for info in data}
        for pool in sorted(pools - {""}):
            network = None if self.settings.network else f"flotilla-{pool}"
            self.engine.remove_pool_now(pool, network)

    def network_name(self, spec: PoolSpec) -> str:
        return self.settings.network or f"flotilla-{spec.pool_id}"

    def run_args(self, spec: PoolSpec, rank: int, name: str, network: str) -> list[str]:
        """The ``run`` arguments of the container ``name`` of ``rank``."""
        from ..cloud.identity import client_id

        settings = self.settings
        args = [
            "run",
            "-d",
            "--name",
            name,
            "--hostname",
            name,
            "--network",
            network,
            "--label",
            MANAGED,
            "--label",
            f"{POOL_LABEL}={spec.pool_id}",
            "--label",
            f"{RANK_LABEL}={rank}",
            "--label",
            f"{CLIENT_LABEL}={client_id()}",
        ]
        if spec.vcpus is not None:
            args += ["--cpus", f"{spec.vcpus:g}"]
        if spec.memory_gb is not None:
            args += ["--memory", f"{max(1, math.ceil(spec.memory_gb * 1024))}m"]
        for volume in settings.volumes:
            args += ["-v", volume]
        args += list(settings.run_args)
        if settings.rootfs is not None:
            args += ["--rootfs", f"{settings.rootfs}:O"]
        else:
            args.append(settings.image_name)
        python = shlex.split(settings.python or "python3")
        return [*args, *python, "-S", "-c", HOLDER]

    async def acquire(self, spec: PoolSpec) -> ContainerAllocation:
        allocation = ContainerAllocation(self, spec)
        try:
            await allocation.make_network()
            names = [allocation.container_name(rank) for rank in range(spec.nodes)]
            runs = await asyncio.gather(
                *(allocation.run(rank, name) for rank, name in enumerate(names)),
                return_exceptions=True,  # every run ends before the pool is removed
            )
            for outcome in runs:
                if isinstance(outcome, BaseException):
                    raise outcome
            ips = [str(ip) for ip in runs]
            allocation.machines = [
                Machine(rank, name, ip, name)
                for rank, (name, ip) in enumerate(zip(names, ips, strict=True))
            ]
        except BaseException:
            await allocation.release()
            raise
        return allocation


class ExecShell(RemoteShell):
    """``<binary> exec -i CONTAINER`` as a remote shell."""

    def __init__(self, allocation: ContainerAllocation) -> None:
        self.allocation = allocation
        self.name = f"{allocation.engine.settings.engine} exec"

    def argv(self, machine: Machine, command: list[str]) -> list[str]:
        return [*self.allocation.engine.base(), "exec", "-i", machine.host, *command]

    def subject(self, machine: Machine) -> str:
        return f"the agent in container {machine.host}"

    def holds(self, machine: Machine) -> tuple[int, ...]:
        """The janitor's stdin, when the pool's agents outlive it (see the module doc)."""
        janitor = self.allocation.janitor
        if not self.allocation.spec.keep_agents or janitor is None or janitor.stdin is None:
            return ()
        return (janitor.stdin.fileno(),)

    async def explain(self, machine: Machine, failure: NoAnswer) -> ProvisionError:
        text = failure.stderr or ""
        lowered = text.lower()
        cause = ProvisionCause.NO_ANSWER
        if "executable file not found" in lowered or "no such file" in lowered:
            cause = ProvisionCause.NODE
        elif "no such container" in lowered or "not running" in lowered:
            cause = ProvisionCause.UNREACHABLE
        return ProvisionError(
            f"{machine.host}: {self.name} ended without the agent starting "
            f"(exit status {failure.status}): {said(text)}",
            cause=cause,
        )


class ContainerAllocation(ShellAllocation):
    """The containers of a pool (and of its replacements), its network and its janitor."""

    def __init__(self, provider: Container, spec: PoolSpec) -> None:
        super().__init__(spec, [])
        self.provider = provider
        self.engine = provider.engine
        self.shell = ExecShell(self)
        self.python = provider.settings.python or "python3"
        self.workdir = provider.settings.workdir
        self.network = provider.network_name(spec)
        self.own_network = provider.settings.network is None
        self.agents: list[AgentProcess] = []
        self.made = 0
        self.janitor: subprocess.Popen[bytes] | None = self._start_janitor()

    def _start_janitor(self) -> subprocess.Popen[bytes]:
        """The process that removes the pool when the client dies (see the module doc)."""
        return subprocess.Popen(
            [
                sys.executable,
                "-S",
                "-c",
                JANITOR,
                json.dumps(self.engine.base()),
                self.spec.pool_id,
                self.network if self.own_network else "",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C and the client's death do not reach it
        )

    def container_name(self, rank: int) -> str:
        """A new container name for ``rank`` (unique within the pool's history)."""
        self.made += 1
        suffix = "" if self.made <= self.spec.nodes else f"-{self.made - self.spec.nodes}"
        return f"{self.provider.settings.prefix}-{self.spec.pool_id}-{rank}{suffix}"

    async def make_network(self) -> None:
        """The pool's own network, or the shared one when it is missing."""
        from ..cloud.identity import client_id

        if not self.own_network:
            try:
                await self.engine.call(["network", "inspect", self.network])
                return
            except ProvisionError:
                pass
        labels = [MANAGED, f"{POOL_LABEL}={self.spec.pool_id}", f"{CLIENT_LABEL}={client_id()}"]
        args = ["network", "create"]
        if self.own_network:
            for label in labels:
                args += ["--label", label]
        try:
            with self.creating("network", self.network):
                await self.engine.call([*args, self.network])
        except ProvisionError as e:
            if self.own_network or "already exists" not in str(e):
                raise ProvisionError(f"cannot make network {self.network}: {e}") from None

    async def run(self, rank: int, name: str) -> str:
        """Start the container ``name`` for ``rank``; its address on the pool's network.
        ProvisionError naming it when it does not run (the engine's or its own message)."""
        args = self.provider.run_args(self.spec, rank, name, self.network)
        try:
            with self.creating("container", f"{POOL_LABEL}={self.spec.pool_id}"):
                await self.engine.call(args)
        except ProvisionError as e:
            raise ProvisionError(f"container {name} did not start: {e}") from None
        data = json.loads(await self.engine.call(["inspect", name]))
        info = data[0] if isinstance(data, list) else data
        state = info.get("State") or {}
        if not state.get("Running"):
            logs = ""
            with contextlib.suppress(ProvisionError):
                logs = await self.engine.call(["logs", name])
            hint = ""
            if state.get("ExitCode") == 127:
                hint = f"; exit code 127: the image has no {self.python!r} (Container(python=))"
            raise ProvisionError(
                f"container {name} ended at once (exit code {state.get('ExitCode')}"
                f"{': ' + said(logs) if logs.strip() else ''}){hint}",
                cause=ProvisionCause.NODE,
            )
        networks = (info.get("NetworkSettings") or {}).get("Networks") or {}
        ip = (networks.get(self.network) or {}).get("IPAddress") or ""
        if not ip:
            raise ProvisionError(f"container {name} has no address on network {self.network}")
        return str(ip)

    async def start_agent(self, machine: Machine) -> AgentProcess:
        agent = await super().start_agent(machine)
        self.agents.append(agent)
        return agent

    async def replacement(self, rank: int, reason: str) -> Machine:
        """A new container for ``rank``; the lost one is removed."""
        old = self.machines[rank]
        with contextlib.suppress(ProvisionError):
            await self.engine.call(self.engine.remove_args([old.host]))
        return await self.new_container(rank)

    async def candidate(self, rank: int) -> Machine | None:
        """A new container for ``rank`` (an elastic pool grows); ProvisionError naming it
        when it does not run (it is removed then)."""
        return await self.new_container(rank)

    async def new_container(self, rank: int) -> Machine:
        """A new container for ``rank``, running; removed again when it does not run."""
        name = self.container_name(rank)
        try:
            ip = await self.run(rank, name)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.engine.call(self.engine.remove_args([name]))
            raise
        return Machine(rank, name, ip, name)

    async def give_back(self, machine: Machine, failed: bool) -> None:
        """Remove the container of a node an elastic pool released (or whose agent did not
        start): it costs nothing from then on."""
        with contextlib.suppress(ProvisionError):
            await self.engine.call(self.engine.remove_args([machine.host]))

    async def free(self) -> None:
        """Stop the agents, remove the pool's containers and its own network, then let the
        janitor go."""
        try:
            await asyncio.gather(
                *(a.terminate() for a in self.agents if a.exit_status() is None),
                return_exceptions=True,
            )
        finally:
            await super().free()  # sweep_now, in a worker thread

    def sweep(self) -> None:
        """Remove the pool's containers (found by its label) and its own network, then
        let the janitor go; synchronous (see ``base.Allocation.sweep``)."""
        removed = False
        try:
            if self.created:
                network = self.network if self.own_network else None
                self.engine.remove_pool_now(self.spec.pool_id, network)
            removed = True
        finally:
            janitor, self.janitor = self.janitor, None
            if janitor is not None:
                _dismiss(janitor, removed)


async def _finish(
    proc: asyncio.subprocess.Process, answer: asyncio.Future[Any], timeout: float
) -> None:
    """Let an engine command the pool no longer waits for (its start or release cut short:
    Ctrl-C, an elastic pool closing while it grows) end by itself within ``timeout`` s;
    killed past that, or when cancelled again. A ``run`` killed while it sets up the
    container's network leaves that network namespace behind for good (podman 4 with CNI:
    made, and not yet recorded with the container), where one let end makes a container
    that the pool's release removes, namespace and all."""
    try:
        async with asyncio.timeout(timeout):
            await asyncio.shield(answer)
    except Exception:  # past the time limit
        await _kill(proc, answer)
    except BaseException:
        await _kill(proc, answer)
        raise


async def _kill(proc: asyncio.subprocess.Process, answer: asyncio.Future[Any]) -> None:
    """End an engine command now (SIGKILL) and wait for it."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()
    with contextlib.suppress(Exception):
        await answer  # its output pipes are closed now


def _dismiss(janitor: subprocess.Popen[bytes], removed: bool) -> None:
    """Let the janitor go: it exits at once when the pool was ``removed``, else it tries
    to remove it itself."""
    stdin: IO[bytes] | None = janitor.stdin
    with contextlib.suppress(OSError):
        if stdin is not None:
            if removed:
                stdin.write(b"done")
            stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        janitor.wait(timeout=5)


def pool_labels(info: dict[str, Any]) -> dict[str, str]:
    """The labels of an ``inspect`` entry (a container's or a network's; docker and podman
    spell the key differently)."""
    labels = (info.get("Config") or {}).get("Labels") or info.get("Labels") or info.get("labels")
    return dict(labels or {})
