"""The SLURM provider: a pool is one SLURM job; each node's agent is one job step.

**Allocation.** ``salloc`` with a *holder* command, run on the client's machine (the login
node): ``salloc --nodes=N ... sh -c 'echo FLOTILLA_SLURM_JOB $SLURM_JOB_ID ...; exec cat'``.
The holder prints the job id and node list once the nodes are ready and then waits for end
of stdin, which is a pipe from the client: when the client closes it (release) or dies
(even by kill -9) the holder exits and salloc relinquishes the job at once; should salloc
not exit then (one killed client in a few left a salloc spinning, parent PID 1), the
holder's watchdog cancels the job and kills salloc after ``SALLOC_EXIT_GRACE``. salloc was
measured against ``sbatch`` of a holder script on the test cluster: ~10 ms to a running
job against ~2.9 s (an sbatch job waits for the scheduler's next pass, salloc's request is
scheduled when it arrives), and salloc needs no polling to learn the job runs. While the
job is pending, salloc is sent SIGTERM if the client dies (``PR_SET_PDEATHSIG``): salloc
then revokes the pending request. ``--time`` is only the last backstop.

**Agents.** ``srun --jobid=J --nodes=1 --ntasks=1 -w NODE --overlap python -m
flotilla.agent`` per node: srun is the remote shell of the launch layer (:class:`SrunShell`,
``launch``), relaying the step's stdin/stdout, which are the protocol channel. Without
``--exact`` a step gets every CPU and the memory the job holds on its node, and the GPUs the
job asked for. The step's command first answers: a step srun cannot start (the job was
cancelled or ended, srun refused it) is a ProvisionError with srun's own cause, and one that
waits (a suspended job) is given up after ``Options.start_timeout``.

**Files.** On a SLURM cluster the login and compute nodes normally share the users' home and
project directories, so by default (``shared_filesystem=True``) the nodes run the client's
own interpreter (``sys.executable``) with the client's import path, as the local provider
does, and user modules are imported rather than shipped. With ``shared_filesystem=False``
the nodes get the client's flotilla through the bootstrap (see ``bootstrap``) over the
step's stdio, into ``workdir`` on each node.

**Inside an existing allocation** (the program runs under ``sbatch``/``salloc``:
``SLURM_JOB_ID`` is set and no ``partition`` is given) the pool uses that job's nodes with
steps and never cancels the job.

**A named cluster's daemon dies** (kill -9; ``PoolSpec.keep_agents``): its agents wait for
a new daemon (``_providers/reattach.py``), so the job must stay. Each agent's srun inherits
the write end of the holder's stdin (:meth:`SrunShell.holds`): the holder sees end of input
only once the client *and* every agent's srun ended; and salloc is not sent SIGTERM at the
client's death (it would cancel the running job: a request still pending then is released
by the holder as soon as it runs). Nobody re-attaching, the agents end after
the grace, their steps with them, and the job is released as above; a new daemon reaches
the agents with a step of the same job (:meth:`Slurm.reattach_command`) and cancels the
job once they ended (:meth:`Slurm.release_reattached`).

**Replacing a node.** The pool's job is submitted with ``--no-kill`` so that it survives the
failure of one of its nodes; a replacement is a new one-node job (excluding the lost node),
released with the pool.

**Elastic pools** (``nodes=(2, 8)``, ``Nodes(0, max=4, min=0)``): every node is a one-node
job of its own (salloc, excluding the nodes the pool has), submitted as the pool grows and
ended (the holder's stdin closed, the job gone from the queue) as it releases that node.
``scontrol update JobId=... NumNodes=...`` is not used: SLURM can only shrink a running
job that way (growing one was removed in 19.05), and a pool grows as often as it shrinks.
A grow step whose job waits in the queue leaves the pool working at its size meanwhile.
Inside an existing allocation the pool grows over that job's nodes (as the SSH provider
over its spare hosts) and never ends the job.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError, ProvisionError
from ..base import (
    AgentProcess,
    Machine,
    PoolSpec,
    Provider,
)
from ..bootstrap import NoAnswer
from ..launch import RemoteShell, ShellAllocation
from ..local import user_code_path
from ..options import provider_init
from ..polling import PolledAllocation
from .job import (
    GONE_TIMEOUT,
    HOLDER,
    Job,
    Partition,
    error_of,
    fields,
    format_time,
    gres_offer,
    hostnames,
    job_state,
    node_addresses,
    node_states,
    parse_limit,
    query,
    say,
    slurm_env,
    srun_error,
)
from .settings import SlurmSettings, parse_time

if TYPE_CHECKING:
    from ..reattach import Node

COMMANDS = ("salloc", "srun", "scancel", "squeue", "scontrol", "sinfo")
FALLBACK_TIME = "1-00:00:00"
"""--time when neither time= nor the partition gives a limit (never UNLIMITED)."""
WATCH_INTERVAL = 5.0
"""Seconds between two looks at SLURM's view of a pool's nodes and jobs (see watch())."""
_LOST_STATES = {"DOWN", "FAIL", "FAILING", "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN"}


class Slurm(Provider):
    """Run the pool as one SLURM job, one job step per node.

    Used on a login node of a SLURM cluster (the SLURM commands must be on PATH), or inside
    a job: ``Compute(provider=Slurm(partition="gpu", time="2:00:00"), nodes=4,
    accelerator="A100:8")``.
    """

    name = "slurm"
    settings: SlurmSettings
    elastic = True
    """Elastic pools: a one-node job per node added, ended per node released (see the
    module docstring)."""

    @provider_init(SlurmSettings)
    def __init__(self) -> None:
        settings = self.settings
        time, python, workdir = settings.time, settings.python, settings.workdir
        self.time_limit = parse_time(time) if time is not None else None
        self.shares_filesystem = settings.shared_filesystem
        self.python = python or (sys.executable if self.shares_filesystem else "python3")
        self.python_pinned = python is not None
        self.workdir = workdir or (None if self.shares_filesystem else "~/.flotilla")
        self.home = os.environ.get("FLOTILLA_HOME", "~/.flotilla")
        self._partition: Partition | None = None

    def existing_job(self) -> str | None:
        """The job this program runs in, when the pool should use its nodes."""
        job = os.environ.get("SLURM_JOB_ID")
        return job if job and self.settings.partition is None else None

    # -- validation ------------------------------------------------------------------
    def validate(self, spec: PoolSpec) -> None:
        missing = [c for c in COMMANDS if shutil.which(c) is None]
        if missing:
            raise ConfigurationError(
                f"the SLURM commands {', '.join(missing)} are not on PATH: run on a login node "
                "of the cluster (or inside a job), or install the SLURM client "
                "(apt-get install slurm-client) configured for your cluster"
            )
        job = self.existing_job()
        if job is not None:
            nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
            have = len(hostnames(nodelist)) if nodelist else 0
            if spec.most > have:
                raise ConfigurationError(
                    f"the pool asks for {spec.most} nodes but runs inside SLURM job {job}, "
                    f"which has {have}: lower nodes= to at most {have}, submit the job with "
                    f"--nodes={spec.most}, or pass Slurm(partition=...) for a new allocation"
                )
            return
        part = self._partition = self.partition_info()
        if spec.most > part.nodes:
            raise ConfigurationError(
                f"the pool asks for {spec.most} nodes but partition {part.name!r} has "
                f"{part.nodes}: lower nodes= or pick a larger partition (`sinfo -s` lists them)"
            )
        limit = part.max_time
        if self.time_limit is not None and limit is not None and self.time_limit > limit:
            raise ConfigurationError(
                f"Slurm(time={self.settings.time!r}) exceeds partition {part.name!r}'s limit "
                f"({format_time(limit)}): ask for at most that"
            )
        acc = spec.accelerator
        if acc is not None and self.settings.gres is None:
            fits = [c for kind, c in part.gpus if kind == acc.name.lower() and c >= acc.count]
            if not fits:
                offered = ", ".join(f"gpu:{k}:{c}" if k else f"gpu:{c}" for k, c in part.gpus)
                raise ConfigurationError(
                    f"partition {part.name!r} has no nodes with {acc.count} {acc.name} GPU(s) "
                    f"(its nodes offer: {offered or 'no GPUs'}): pick another partition or "
                    "accelerator, or give the site's GRES name with Slurm(gres=...)"
                )

    def partition_info(self) -> Partition:
        """The partition the pool would run in; ConfigurationError if there is none."""
        proc = query(["scontrol", "-o", "show", "partition"])
        if proc.returncode != 0:
            raise ProvisionError(f"cannot query SLURM's partitions: {error_of(proc)}")
        parts = [fields(line) for line in proc.stdout.splitlines() if "PartitionName=" in line]
        names = [p["PartitionName"] for p in parts]
        if self.settings.partition is None:
            found = [p for p in parts if p.get("Default") == "YES"]
            if not found:
                raise ConfigurationError(
                    "this SLURM cluster has no default partition: pass Slurm(partition=...), "
                    f"one of {', '.join(names)}"
                )
        else:
            found = [p for p in parts if p["PartitionName"] == self.settings.partition]
            if not found:
                raise ConfigurationError(
                    f"SLURM has no partition {self.settings.partition!r}: pass "
                    f"Slurm(partition=...) with one of {', '.join(names) or '(none)'}"
                )
        p = found[0]
        gpus: list[tuple[str, int]] = []
        gres = query(["sinfo", "-h", "-p", p["PartitionName"], "-o", "%G"])
        for line in gres.stdout.splitlines():
            gpus += gres_offer(line)
        return Partition(
            name=p["PartitionName"],
            nodes=int(p.get("TotalNodes", "0") or 0),
            max_time=parse_limit(p.get("MaxTime")),
            default_time=parse_limit(p.get("DefaultTime")),
            gpus=tuple(sorted(set(gpus))),
        )

    # -- a cluster's agents, reached again by a new daemon (``_providers/reattach.py``) -
    def reattach_command(self, node: Node) -> tuple[list[str], dict[str, Any]]:
        """The bridge to ``node``'s agent: a step of the job it runs in, on its node."""
        if not node.job:
            raise ProvisionError(f"node {node.rank} ({node.host}): its SLURM job is not known")
        argv = [
            "srun",
            f"--jobid={node.job}",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={node.scheduler_node or node.host}",
            "--overlap",
            "--chdir=/",
            "--quiet",
            "--unbuffered",
        ]
        return [*argv, *node.argv], {"env": slurm_env()}

    def release_reattached(self, nodes: list[Node]) -> None:
        """End the jobs of ``nodes`` (whose agents ended; never the job this program runs
        inside) and wait until SLURM no longer lists them."""
        for job in sorted({n.job for n in nodes if n.job and n.job != self.existing_job()}):
            query(["scancel", job])
            deadline = time.monotonic() + GONE_TIMEOUT
            while job_state(job) is not None and time.monotonic() < deadline:
                time.sleep(0.05)

    # -- allocation ------------------------------------------------------------------
    def salloc_argv(self, spec: PoolSpec, nodes: int, exclude: Sequence[str] = ()) -> list[str]:
        """The salloc command line of a job of ``nodes`` nodes for ``spec``."""
        argv = [
            "salloc",
            f"--nodes={nodes}",
            "--ntasks-per-node=1",
            f"--job-name=flotilla-{spec.pool_id}",
            "--no-kill",
        ]
        for option, value in (
            ("partition", self.settings.partition),
            ("account", self.settings.account),
            ("qos", self.settings.qos),
            ("constraint", self.settings.constraint),
            ("reservation", self.settings.reservation),
        ):
            if value is not None:
                argv.append(f"--{option}={value}")
        argv += self._time_args()
        gres = self.settings.gres
        if gres is None and spec.accelerator is not None:
            gres = f"gpu:{spec.accelerator.name.lower()}:{spec.accelerator.count}"
        if gres is not None:
            argv.append(f"--gres={gres}")
        if spec.vcpus is not None:
            argv.append(f"--cpus-per-task={max(1, math.ceil(spec.vcpus))}")
        else:
            argv.append("--exclusive")  # a node is a whole machine, as on other providers
        if spec.memory_gb is not None:
            argv.append(f"--mem={max(1, math.ceil(spec.memory_gb * 1024))}M")
        if exclude:
            argv.append(f"--exclude={','.join(exclude)}")
        return [*argv, *self.settings.sbatch_args, "sh", "-c", HOLDER]

    def _time_args(self) -> list[str]:
        if self.time_limit is not None:
            return [f"--time={format_time(self.time_limit)}"]
        try:
            part = self._partition or self.partition_info()  # validate()'s, if it ran
        except (ConfigurationError, ProvisionError):
            return []
        if part.default_time is not None:
            return []  # SLURM applies the partition's default
        if part.max_time is not None:
            return [f"--time={format_time(part.max_time)}"]
        say(
            f"partition {part.name!r} has no time limit: the pool's job asks for "
            f"{FALLBACK_TIME} (pass Slurm(time=...) to choose)"
        )
        return [f"--time={FALLBACK_TIME}"]

    async def acquire(self, spec: PoolSpec) -> SlurmAllocation:
        loop = asyncio.get_running_loop()
        job = self.existing_job()
        if job is not None:
            names = await loop.run_in_executor(None, hostnames, os.environ["SLURM_JOB_NODELIST"])
            allocation = SlurmAllocation(self, spec, job=Job(job, None, names))
        elif not spec.nodes:  # an elastic pool: a one-node job per node (``candidate``)
            return SlurmAllocation(self, spec, job=None)
        else:
            argv = await loop.run_in_executor(None, self.salloc_argv, spec, spec.nodes)
            held = await Job.submit(argv, self.settings.queue_timeout, bool(spec.keep_agents))
            allocation = SlurmAllocation(self, spec, job=held)
        pool_job = allocation.job
        assert pool_job is not None
        try:
            names = pool_job.nodes[: spec.nodes]
            addrs = await loop.run_in_executor(None, node_addresses, names)
            allocation.machines = [
                allocation.new_machine(rank, name, addrs.get(name, name), pool_job)
                for rank, name in enumerate(names)
            ]
        except BaseException:
            await allocation.release()
            raise
        return allocation


# -- the allocation ------------------------------------------------------------------------
class SrunShell(RemoteShell):
    """``srun`` as a remote shell: a command runs as a one-task step of the machine's job
    on its node. A step srun cannot start (the job was cancelled or ended, the step asks
    for what the job lacks) is explained with srun's own words; one that waits (a suspended
    job) is given up after ``Options.start_timeout``."""

    name = "srun"

    def __init__(self, allocation: SlurmAllocation) -> None:
        self.allocation = allocation
        env = slurm_env()
        if allocation.provider.shares_filesystem:
            env["PYTHONPATH"] = os.pathsep.join(user_code_path())
        env.pop("COMPUTE_POOL", None)
        self.env = env

    def argv(self, machine: Machine, command: list[str]) -> list[str]:
        allocation, provider = self.allocation, self.allocation.provider
        job = allocation.job_of[machine.ident]
        argv = [
            "srun",
            f"--jobid={job.id}",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={machine.host}",
            "--overlap",
            f"--job-name=flotilla-{allocation.spec.pool_id}-node{machine.rank}",
            "--quiet",
            "--unbuffered",  # else slurmstepd forwards stdout line by line (frames are binary)
        ]
        if provider.shares_filesystem and provider.workdir is not None:
            argv.append(f"--chdir={provider.workdir}")
        return [*argv, *command]

    def subject(self, machine: Machine) -> str:
        return f"the agent's step in SLURM job {self.allocation.job_of[machine.ident].id}"

    def holds(self, machine: Machine) -> tuple[int, ...]:
        """The holder's stdin, when the pool's agents outlive it (see the module doc)."""
        salloc = self.allocation.job_of[machine.ident].salloc
        if not self.allocation.spec.keep_agents or salloc is None or salloc.stdin is None:
            return ()
        return (salloc.stdin.fileno(),)

    async def explain(self, machine: Machine, failure: NoAnswer) -> ProvisionError:
        job = self.allocation.job_of[machine.ident].id
        return srun_error(machine.host, job, failure.status, failure.stderr)


class SlurmAllocation(PolledAllocation, ShellAllocation):
    """The pool's SLURM job (and the one-node jobs of replacements); an agent is a step.

    Attributes:
        job: the pool's job, or the job it runs inside; None for an elastic pool of its
            own, whose every node is a one-node job.
        jobs: every job the pool made (and the one it runs inside).
    """

    def __init__(self, provider: Slurm, spec: PoolSpec, job: Job | None) -> None:
        super().__init__(spec, [])
        self.provider = provider
        self.job = job
        self.jobs: list[Job] = [job] if job is not None else []
        self.job_of: dict[str, Job] = {}
        self.agents: list[AgentProcess] = []
        self._adding: set[str] = set()  # nodes of candidates not admitted yet
        self.watch_interval = WATCH_INTERVAL
        self.shell = SrunShell(self)
        self.python = provider.python
        self.workdir = provider.workdir or "~/.flotilla"
        self.ship = not provider.shares_filesystem

    def new_machine(self, rank: int, node: str, address: str, job: Job) -> Machine:
        ident = f"{job.id}:{node}"
        if ident in self.machine_states:  # a node an elastic pool released, added again
            ident += f"#{sum(1 for i in self.machine_states if i.startswith(ident + '#')) + 1}"
        machine = Machine(rank, node, address, ident)
        self.job_of[machine.ident] = job
        return machine

    async def start_agent(self, machine: Machine) -> AgentProcess:
        """Run the agent as a step on ``machine``'s node (see :class:`SrunShell`)."""
        agent = await super().start_agent(machine)
        self.agents.append(agent)
        return agent

    async def replacement(self, rank: int, reason: str) -> Machine:
        """A new one-node job for ``rank`` (SLURM cannot add a node to a running job),
        avoiding the lost node."""
        old = self.machines[rank]
        if self.job is not None and not self.job.owned:
            raise ProvisionError(
                f"{old.host}: {reason}; the pool runs inside SLURM job {self.job.id}, whose "
                "nodes it cannot replace"
            )
        return await self._one_node_job(rank, [old.host])

    async def _one_node_job(self, rank: int, exclude: Sequence[str]) -> Machine:
        """A new one-node job (not on the nodes ``exclude``), its node as the machine for
        ``rank``; once it runs (ProvisionError after the provider's ``queue_timeout``)."""
        loop = asyncio.get_running_loop()
        argv = await loop.run_in_executor(None, self.provider.salloc_argv, self.spec, 1, exclude)
        keep = bool(self.spec.keep_agents)
        job = await Job.submit(argv, self.provider.settings.queue_timeout, keep)
        self.jobs.append(job)
        try:
            addrs = await loop.run_in_executor(None, node_addresses, job.nodes)
        except BaseException:
            self.jobs.remove(job)
            await job.release()
            raise
        return self.new_machine(rank, job.nodes[0], addrs.get(job.nodes[0], job.nodes[0]), job)

    # -- elastic pools: a node more, a node fewer -------------------------------------
    async def candidate(self, rank: int) -> Machine | None:
        """A node for ``rank`` (an elastic pool grows): a new one-node job on a node the
        pool does not have; inside an existing allocation, the next of its nodes the pool
        does not use (None when it uses them all)."""
        using = {m.host for m in self.machines} | self._adding
        if self.job is not None and not self.job.owned:
            free = [n for n in self.job.nodes if n not in using]
            if not free:
                return None
            self._adding.add(free[0])
            loop = asyncio.get_running_loop()
            try:
                addrs = await loop.run_in_executor(None, node_addresses, free[:1])
            except BaseException:
                self._adding.discard(free[0])
                raise
            return self.new_machine(rank, free[0], addrs.get(free[0], free[0]), self.job)
        machine = await self._one_node_job(rank, sorted(using))
        self._adding.add(machine.host)
        return machine

    def admit(self, machine: Machine) -> Machine:
        self._adding.discard(machine.host)
        return super().admit(machine)

    async def give_back(self, machine: Machine, failed: bool) -> None:
        """End the one-node job of a node the pool released (its steps drained first, see
        ``_client/elastic.py``) or whose agent did not start; a node of the job the pool
        runs inside is only free again."""
        self._adding.discard(machine.host)
        job = self.job_of.get(machine.ident)
        if job is not None and job is not self.job and job in self.jobs:
            self.jobs.remove(job)
            await job.release()

    async def lost_machines(self, machines: list[Machine]) -> dict[str, str]:
        """A node SLURM marks DOWN, FAIL or NOT_RESPONDING, or a job that ended under the
        pool (cancelled by an admin, out of time). A dead step is noticed by the client
        anyway."""
        loop = asyncio.get_running_loop()
        nodes = await loop.run_in_executor(None, node_states, [m.host for m in machines])
        ended = {}
        for job in {self.job_of[m.ident] for m in machines}:
            if await loop.run_in_executor(None, job_state, job.id) is None:
                ended[job.id] = job
        lost = {}
        for m in machines:
            state, why = nodes.get(m.host, ("", ""))
            job = self.job_of[m.ident]
            if _LOST_STATES & set(state.split("+")):
                lost[m.ident] = f"SLURM marks node {m.host} {state}" + (f" ({why})" if why else "")
            elif job.id in ended:
                lost[m.ident] = f"SLURM job {job.id} ended (cancelled, or out of time)"
        return lost

    async def free(self) -> None:
        """Stop the steps still running, then end every job the pool made (never one it
        runs inside) and wait until SLURM no longer lists them."""
        self.stop_watching()
        await asyncio.gather(
            *(a.terminate() for a in self.agents if a.exit_status() is None),
            return_exceptions=True,
        )
        await asyncio.gather(*(job.release() for job in self.jobs), return_exceptions=True)
