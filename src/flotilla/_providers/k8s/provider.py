"""The Kubernetes provider: one Pod per node; each node's agent runs through an exec stream.

**Pods.** A pool of N nodes is N pods created in one call (``restartPolicy: Never``,
labelled ``flotilla/pool=<id>`` and ``flotilla/rank=<k>``, annotated with the client that
made them), each running a *holder* (:data:`HOLDER`): a few lines of shell that keep the pod
alive while an agent runs in it and end it (so the pod is Succeeded and holds no GPU) when no
agent has run for a while: ``start_timeout`` + 30 s when none ever started, ``IDLE`` seconds
after the last one ended (an agent holds a lock on a file of the pod while it runs; the
file's existence says that one started). It waits in ``flock`` while agents hold the lock
and counts the idle seconds with ``sleep``; an image without ``flock`` (util-linux, or
busybox's) runs the same loop in Python instead (:data:`PYTHON_HOLDER`, a second interpreter
start). Resources:
``accelerator="A100:8"`` requests (and limits) ``nvidia.com/gpu: 8`` and selects nodes
labelled ``<gpu_label>=a100``; ``vcpus`` and ``memory_gb`` request CPU and memory.

**All or nothing.** The pool waits until every pod runs with an IP. A pod the scheduler
cannot place (its ``PodScheduled`` condition: Unschedulable, the message of the scheduler's
``FailedScheduling`` event, e.g. "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
for ``pending_timeout`` seconds fails the pool with a ProvisionError naming the shortage, and
every pod made is deleted.

**Agents.** ``kubectl exec -i POD -- sh -c <start command>`` is the remote shell of the
launch layer (:class:`ExecShell`): one exec per pod, all at once, whose one Python process
checks the interpreter, takes the pod's agent lock, installs the bundle (sent once per pod
over the stream) and becomes the agent (``bootstrap.start_command``); the stream's
stdin/stdout are then the protocol channel. No SSH daemon is needed in the image.
``instance_info().peers`` are the pod IPs (node 0's is ``head_addr``).

**Lost pods.** A pod that is deleted, evicted, or whose node is gone ends its exec stream (or
is seen gone by the watcher, :meth:`KubernetesAllocation.watch`): the node is lost and
replaced by a new pod at the same rank (the old one deleted).

**A named cluster's daemon dies** (kill -9; ``PoolSpec.keep_agents``): its kubectl
processes see end of input and the agents wait for a new daemon
(``_providers/reattach.py``); each still holds its pod's lock, so the holder keeps the pod.
Nobody re-attaching, the agents end after the grace and the holders end the pods ``IDLE``
seconds later, as below; a new daemon reaches the agents with ``kubectl exec`` into the
same pods (:meth:`Kubernetes.reattach_command`) and deletes the pool's objects once they
ended (:meth:`Kubernetes.release_reattached`).

**Nothing left.** Closing the pool (also on exceptions and Ctrl-C) deletes its pods and waits
until they are gone. A client killed with SIGKILL: its kubectl processes see end of input,
the agents end, and the holders end the pods (Succeeded, holding nothing) ``IDLE`` seconds
later; ``flotilla down --orphans`` deletes the pods that clients gone from this machine left
(:func:`remove_orphans`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import math
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..._redaction import Secret, is_secret
from ..base import (
    AgentProcess,
    Machine,
    PoolSpec,
    Provider,
)
from ..bootstrap import NoAnswer
from ..launch import RemoteShell, ShellAllocation
from ..options import provider_init
from ..polling import PolledAllocation
from .kubectl import Kubectl, Watch, said
from .settings import KubernetesSettings

if TYPE_CHECKING:
    from ..reattach import Node

logger = logging.getLogger("flotilla.k8s")

POOL_LABEL = "flotilla/pool"
RANK_LABEL = "flotilla/rank"
MANAGED = "app.kubernetes.io/managed-by=flotilla"
CLIENT_ANNOTATION = "flotilla/client"
CONTAINER = "node"
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
"""A variable name a pod's ``env`` accepts (and a Secret key)."""
LOCK = "agent.lock"
"""The pod's agent lock, in the workdir (one per pod: a container's files are its own)."""
IDLE = 10.0
"""Seconds a pod's holder waits after its last agent ended before ending the pod."""
POLL = 0.1
"""Seconds between two looks at the pool's pods while they start."""
WATCH_INTERVAL = 5.0
"""Seconds between two looks at the pool's pods while it runs (see watch())."""

HOLDER = """\
first=$1 idle=$2 lock=$3
shift 3
command -v flock >/dev/null && command -v sleep >/dev/null || exec "$@" "$first" "$idle" "$lock"
case $lock in "~") lock=$HOME ;; "~/"*) lock=$HOME/${lock#"~/"} ;; esac
trap 'kill $! 2>/dev/null; exit 0' TERM
n=0
until [ -e "$lock" ]; do
    [ "$n" -lt "$first" ] || exit 0
    sleep 1 & wait $!
    n=$((n + 1))
done
while :; do
    if command exec 9<"$lock"; then flock -x 9 & wait $!; fi 2>/dev/null
    exec 9<&-
    n=0
    while [ "$n" -lt "$idle" ]; do
        sleep 1 & wait $!
        n=$((n + 1))
        if command exec 9<"$lock" && ! flock -n -x 9; then exec 9<&-; continue 2; fi 2>/dev/null
        exec 9<&-
    done
    exit 0
done
"""
"""The pods' command (``sh -c HOLDER flotilla-holder FIRST IDLE LOCK PYTHON...``): keeps the
pod while an agent holds the lock (see the module doc). One ``sh`` and, while it waits, one
``flock`` or ``sleep`` at a time: an exclusive ``flock`` on a descriptor of its own blocks
while any agent holds its shared one (no polling while agents run), and is dropped by
closing that descriptor; then ``IDLE`` probes one second apart (``flock -n``) must all find
the lock free (one that finds it held goes back to waiting). The waits run in the background
under ``wait``, so SIGTERM (a pod's deletion) ends it at once: a trapped signal interrupts
``wait``, not a command in the foreground (and the container's PID 1 gets no signal it has
no handler for). Where ``flock`` or ``sleep`` is missing it becomes
``PYTHON... -S -c PYTHON_HOLDER FIRST IDLE LOCK``. ``~`` in the lock's path is ``$HOME``."""

PYTHON_HOLDER = """\
import fcntl, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
first, idle, path = float(sys.argv[1]), float(sys.argv[2]), os.path.expanduser(sys.argv[3])
fd, free_since = None, time.monotonic()
while True:
    if fd is None and os.path.exists(path):
        fd, free_since = os.open(path, os.O_RDWR), time.monotonic()
    held = False
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held = True
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
    now = time.monotonic()
    if held:
        free_since = None
    elif free_since is None:
        free_since = now
    elif now - free_since > (idle if fd is not None else first):
        sys.exit(0)
    time.sleep(0.5)
"""
"""The holder where the image has no ``flock``: the same promises, polling every 0.5 s."""


def holder_command(python: list[str], first: int, idle: int, lock: str) -> list[str]:
    """A pod's command: :data:`HOLDER`, ending the pod ``first`` s after it started when no
    agent took ``lock``, ``idle`` s after the last one let it go; ``python`` (the image's
    interpreter, as words) runs :data:`PYTHON_HOLDER` instead where the image has no
    ``flock``."""
    holder = ["sh", "-c", HOLDER, "flotilla-holder", str(first), str(idle), lock]
    return [*holder, *python, "-S", "-c", PYTHON_HOLDER]


def default_image() -> str:
    """A Python image of the client's minor version."""
    return f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"


def secret_env(spec: PoolSpec) -> dict[str, str]:
    """The pool's secret variables (``Secret`` values, or names that look secret, of the
    image's and the options' ``env``) that its Kubernetes Secret carries: those whose names
    a pod's ``env`` accepts (any other still reaches the agent over its exec stream)."""
    env = {**(getattr(spec.image, "env", None) or {}), **spec.options.env}
    return {
        k: v.value if isinstance(v, Secret) else str(v)
        for k, v in env.items()
        if is_secret(k, v) and ENV_NAME.fullmatch(k)
    }


class Kubernetes(Provider):
    """Run each node as a Pod of a Kubernetes cluster, reached through ``kubectl exec``.

    ``Compute(provider=Kubernetes(namespace="ml"), nodes=4, accelerator="A100:8")``. Needs
    ``kubectl`` on this machine and, in the namespace, the right to create, get, list and
    delete pods and to exec into them (see docs/providers.md, "Kubernetes").
    """

    name = "k8s"
    settings: KubernetesSettings
    elastic = True
    """Elastic pools: a pod is created per node added and deleted per node released."""

    @provider_init(KubernetesSettings)
    def __init__(self) -> None:
        self.kubectl = Kubectl(self.settings)
        self.reattached: dict[str, str] = {}
        """A re-attached node's address -> its pool's id (``reattach_command``)."""

    def reattach_command(self, node: Node) -> tuple[list[str], dict[str, Any]]:
        """The bridge to ``node``'s agent: ``kubectl exec`` into its pod (the running pod
        of flotilla's with the node's address, as ``flotilla ssh`` finds it)."""
        pod = next((p for p in self._pods_at([node]) if _phase(p) == "Running"), None)
        if pod is None:
            raise ProvisionError(f"no running pod has the node's address {node.ip}")
        meta = pod["metadata"]
        self.reattached[node.ip] = (meta.get("labels") or {}).get(POOL_LABEL, "")
        kubectl = self.kubectl
        argv = [*kubectl.base(), "-n", kubectl.namespace, "exec", "-i", meta["name"]]
        return [*argv, "-c", CONTAINER, "--", *node.argv], {}

    def release_reattached(self, nodes: list[Node]) -> None:
        """Delete the pool of ``nodes`` (whose agents ended): its pods, Service and
        Secret, found by the pool's label (the pool's re-attached to, else that of the
        pods with the nodes' addresses)."""
        pools = {self.reattached.get(n.ip, "") for n in nodes} - {""}
        if not pools:
            with contextlib.suppress(ProvisionError):
                pods = self._pods_at(nodes)
                pools = {(p["metadata"].get("labels") or {}).get(POOL_LABEL, "") for p in pods}
        for pool in sorted(pools - {""}):
            self.kubectl.delete_now("pods,services", f"{POOL_LABEL}={pool}", wait=True)
            with contextlib.suppress(ProvisionError):  # a pool without secrets may lack the right
                self.kubectl.delete_now("secrets", f"{POOL_LABEL}={pool}")

    def _pods_at(self, nodes: list[Node]) -> list[dict[str, Any]]:
        """flotilla's pods (any phase) with the addresses of ``nodes``."""
        kubectl = self.kubectl
        argv = [*kubectl.base(), "-n", kubectl.namespace, "get", "pods", "-l", MANAGED]
        try:
            proc = subprocess.run([*argv, "-o", "json"], capture_output=True, text=True, timeout=60)
            items = (
                json.loads(proc.stdout or "{}").get("items", []) if proc.returncode == 0 else None
            )
        except (OSError, subprocess.TimeoutExpired, ValueError) as e:
            raise ProvisionError(f"kubectl get pods failed: {e}") from None
        if items is None:
            raise ProvisionError(f"kubectl get pods failed: {said(proc.stderr)}")
        ips = {n.ip for n in nodes}
        return [p for p in items if (p.get("status") or {}).get("podIP") in ips]

    def validate(self, spec: PoolSpec) -> None:
        self.kubectl.check_local()
        if spec.accelerator is not None and not spec.accelerator.cuda:
            raise ConfigurationError(
                f"the Kubernetes provider requests NVIDIA GPUs (nvidia.com/gpu); "
                f"{spec.accelerator.name} is not one"
            )

    def lock_path(self) -> str:
        """The agent lock's path in a pod."""
        return f"{self.settings.workdir.rstrip('/')}/{LOCK}"

    @staticmethod
    def object_name(spec: PoolSpec) -> str:
        """The name of the pool's Service and Secret."""
        return f"flotilla-{spec.pool_id}"

    @staticmethod
    def metadata(spec: PoolSpec, name: str, **labels: str) -> dict[str, Any]:
        """The metadata of one of the pool's objects: its name, the pool's labels (and
        ``labels``), the client's annotation."""
        from ..cloud.identity import client_id

        return {
            "name": name,
            "labels": {
                POOL_LABEL: spec.pool_id,
                **labels,
                "app.kubernetes.io/managed-by": "flotilla",
            },
            "annotations": {CLIENT_ANNOTATION: client_id()},
        }

    def secret(self, spec: PoolSpec) -> dict[str, Any] | None:
        """The pool's Secret: its secret variables (:func:`secret_env`), which the pods'
        ``env`` reference; None when it has none."""
        env = secret_env(spec)
        if not env:
            return None
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": self.metadata(spec, self.object_name(spec)),
            "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in env.items()},
        }

    def service(self, spec: PoolSpec) -> dict[str, Any]:
        """The pool's headless Service: pod ``P`` of the pool is
        ``P.<service>.<namespace>.svc`` in the cluster's DNS (peers still use pod IPs)."""
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.metadata(spec, self.object_name(spec)),
            "spec": {
                "clusterIP": "None",
                "selector": {POOL_LABEL: spec.pool_id},
                "publishNotReadyAddresses": True,
            },
        }

    def pod(self, spec: PoolSpec, rank: int, name: str) -> dict[str, Any]:
        """The Pod object of ``rank``."""
        python = shlex.split(self.settings.python or "python3")
        first, idle = math.ceil(spec.options.start_timeout + 30), math.ceil(IDLE)
        requests: dict[str, str] = {}
        limits: dict[str, str] = {}
        if spec.vcpus is not None:
            requests["cpu"] = f"{max(1, math.ceil(spec.vcpus * 1000))}m"
        if spec.memory_gb is not None:
            requests["memory"] = f"{max(1, math.ceil(spec.memory_gb * 1024))}Mi"
        secret = self.object_name(spec)
        env = [
            {"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}}
            for k in secret_env(spec)
        ]
        pod_spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "subdomain": self.object_name(spec),
            "terminationGracePeriodSeconds": 5,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [
                {
                    "name": CONTAINER,
                    "image": self.settings.image or default_image(),
                    "command": holder_command(python, first, idle, self.lock_path()),
                    "resources": {"requests": requests, "limits": limits},
                    **({"env": env} if env else {}),
                }
            ],
        }
        acc = spec.accelerator
        if acc is not None:
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(acc.count)
            if self.settings.gpu_label is not None:
                pod_spec["nodeSelector"] = {self.settings.gpu_label: acc.name.lower()}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": self.metadata(spec, name, **{RANK_LABEL: str(rank)}),
            "spec": pod_spec,
        }

    async def acquire(self, spec: PoolSpec) -> KubernetesAllocation:
        allocation = KubernetesAllocation(self, spec)
        try:
            names = [allocation.pod_name(rank) for rank in range(spec.nodes)]
            secret = self.secret(spec)
            with allocation.creating("pods", allocation.selector):
                await self.kubectl.create(
                    [
                        *([secret] if secret else []),  # first: the pods' env refers to it
                        self.service(spec),
                        *(self.pod(spec, r, n) for r, n in enumerate(names)),
                    ]
                )
            # each pod's agent starts as soon as that pod runs (see start_agent)
            ips = await allocation.wait_running(names, early=True)
            allocation.machines = [
                allocation.new_machine(rank, name, ips[name]) for rank, name in enumerate(names)
            ]
        except BaseException:
            await allocation.release()
            raise
        return allocation


def _phase(pod: dict[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase", ""))


@dataclass(frozen=True)
class PodState:
    """What the pool needs of a pod's status."""

    name: str
    phase: str
    ip: str
    deleting: bool
    unschedulable: str | None
    ended: str | None

    @staticmethod
    def gone(name: str) -> PodState:
        """A pod no longer listed."""
        return PodState(name, "Unknown", "", True, None, None)

    @staticmethod
    def of(pod: dict[str, Any]) -> PodState:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        unschedulable = None
        for cond in status.get("conditions", []) or []:
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                unschedulable = cond.get("message") or "the scheduler cannot place it"
        phase = status.get("phase", "Pending")
        ended = None
        if phase in ("Failed", "Succeeded"):
            ended = f"it ended ({phase}"
            for cs in status.get("containerStatuses", []) or []:
                term = (cs.get("state") or {}).get("terminated")
                if term:
                    why = term.get("message") or term.get("reason") or ""
                    ended += f", exit code {term.get('exitCode')}" + (f": {why}" if why else "")
            reason = status.get("reason")
            if reason:
                ended += f"; {reason}: {status.get('message', '')}".rstrip(": ")
            ended += ")"
        else:
            for cs in status.get("containerStatuses", []) or []:
                waiting = (cs.get("state") or {}).get("waiting") or {}
                if waiting.get("reason") in (
                    "ErrImagePull",
                    "ImagePullBackOff",
                    "InvalidImageName",
                    "CreateContainerConfigError",
                    "CreateContainerError",
                ):
                    ended = f"its container cannot start ({waiting['reason']}: "
                    ended += f"{waiting.get('message', '')})"
        return PodState(
            name=meta.get("name", ""),
            phase=phase,
            ip=status.get("podIP") or "",
            deleting=bool(meta.get("deletionTimestamp")),
            unschedulable=unschedulable,
            ended=ended,
        )


class ExecShell(RemoteShell):
    """``kubectl exec -i`` as a remote shell: the command runs in the pod's container (the
    agent holds the pod's agent lock, see the module doc)."""

    name = "kubectl exec"

    def __init__(self, allocation: KubernetesAllocation) -> None:
        self.allocation = allocation

    def argv(self, machine: Machine, command: list[str]) -> list[str]:
        kubectl = self.allocation.provider.kubectl
        return [
            *kubectl.base(),
            "-n",
            kubectl.namespace,
            "exec",
            "-i",
            machine.host,
            "-c",
            CONTAINER,
            "--",
            *command,
        ]

    def subject(self, machine: Machine) -> str:
        return f"the agent in pod {machine.host}"

    async def explain(self, machine: Machine, failure: NoAnswer) -> ProvisionError:
        text = failure.stderr or ""
        cause = ProvisionCause.NO_ANSWER
        lowered = text.lower()
        if "forbidden" in lowered or "unauthorized" in lowered:
            cause = ProvisionCause.AUTH
        elif "not found" in lowered and "executable" not in lowered:
            cause = ProvisionCause.LAUNCHER
        elif "unable to upgrade" in lowered or "connection refused" in lowered:
            cause = ProvisionCause.UNREACHABLE
        elif "executable file not found" in lowered or "no such file" in lowered:
            cause = ProvisionCause.NODE
        return ProvisionError(
            f"{machine.host}: kubectl exec ended without the agent starting "
            f"(exit status {failure.status}): {said(text)}",
            cause=cause,
        )


class KubernetesAllocation(PolledAllocation, ShellAllocation):
    """The pods of a pool (and of its replacements)."""

    def __init__(self, provider: Kubernetes, spec: PoolSpec) -> None:
        super().__init__(spec, [])
        self.provider = provider
        self.kubectl = provider.kubectl
        self.shell = ExecShell(self)
        self.python = provider.settings.python or "python3"
        self.workdir = provider.settings.workdir
        self.lock = LOCK
        self.selector = f"{POOL_LABEL}={spec.pool_id}"
        self.delivered_env = frozenset(secret_env(spec))  # the pods' env, from the Secret
        self.others = "services,secrets" if self.delivered_env else "services"
        self.agents: list[AgentProcess] = []
        self.early: dict[str, asyncio.Future[AgentProcess]] = {}
        self.made = 0
        self.watch_interval = WATCH_INTERVAL

    def pod_name(self, rank: int) -> str:
        """A new pod name for ``rank`` (unique within the pool's history)."""
        self.made += 1
        suffix = "" if self.made <= self.spec.nodes else f"-{self.made - self.spec.nodes}"
        return f"flotilla-{self.spec.pool_id}-{rank}{suffix}"

    def new_machine(self, rank: int, name: str, ip: str) -> Machine:
        return Machine(rank, name, ip, name)

    async def pod_states(self) -> dict[str, PodState]:
        return {s.name: s for s in map(PodState.of, await self.kubectl.get("pods", self.selector))}

    async def wait_running(self, names: list[str], early: bool = False) -> dict[str, str]:
        """Wait until every pod of ``names`` (``names[k]``: rank ``k``'s) runs with an IP;
        their IPs. With ``early``, each pod's agent starts as soon as that pod runs (see
        :meth:`start_agent`). ProvisionError when one cannot be placed for
        ``pending_timeout`` s (naming the shortage), ends, or is deleted, or when they do
        not all run within the start timeout.

        The pods are watched (one ``kubectl get --watch``: a change is seen when it
        happens); should the watch end, they are listed every ``POLL`` s."""
        deadline = time.monotonic() + self.spec.options.start_timeout
        stuck_since: dict[str, float] = {}
        states: dict[str, PodState] = {}
        started = self.kubectl.watch("pods", self.selector)
        watch: Watch | None = started
        try:
            await started.start()
            while True:
                now = time.monotonic()
                ips = self._check_pods(names, states, stuck_since, now, deadline)
                if early:
                    for rank, name in enumerate(names):
                        state = states.get(name)
                        if state is not None and state.phase == "Running" and state.ip:
                            self._start_early(self.new_machine(rank, name, state.ip))
                if ips is not None:
                    return ips
                limit = self.provider.settings.pending_limit
                wake = min([deadline, *(t + limit for t in stuck_since.values())]) - now
                wake = min(max(wake, 0.01), 1.0)
                if watch is not None:
                    try:
                        event = await watch.next(wake)
                    except EOFError:
                        logger.debug("pool %s: the pod watch ended", self.spec.pool_id)
                        await watch.close()
                        watch = None
                        continue
                    if event is not None:
                        kind, pod = event
                        state = PodState.of(pod)
                        if kind == "DELETED":
                            state = dataclasses.replace(state, deleting=True)
                        states[state.name] = state
                else:
                    await asyncio.sleep(POLL)
                    listed = await self.pod_states()
                    for name in names:  # not listed: deleted
                        states[name] = listed.get(name) or PodState.gone(name)
        finally:
            if watch is not None:
                await watch.close()

    def _check_pods(
        self,
        names: list[str],
        states: dict[str, PodState],
        stuck_since: dict[str, float],
        now: float,
        deadline: float,
    ) -> dict[str, str] | None:
        """The pods' IPs when all of ``names`` run, None while they start; ProvisionError
        when one cannot run (see :meth:`wait_running`)."""
        settings = self.provider.settings
        for name in names:
            state = states.get(name)
            if state is None:
                continue  # not seen yet
            if state.deleting:
                raise ProvisionError(f"pod {name} was deleted while the pool started")
            if state.ended:
                hint = ""
                if "exit code 127" in state.ended:
                    hint = (
                        f"; exit code 127 is 'command not found': the image has no "
                        f"{self.python!r} (Kubernetes(python=..., image=...))"
                    )
                raise ProvisionError(f"pod {name} cannot run the node: {state.ended}{hint}")
            if state.unschedulable is None:
                stuck_since.pop(name, None)
                continue
            since = stuck_since.setdefault(name, now)
            if now - since >= settings.pending_limit:
                wait = (
                    "pass Kubernetes(autoscaler=True) to wait for a cluster autoscaler"
                    if not settings.autoscaler
                    else "the autoscaler added no node in time"
                )
                raise ProvisionError(
                    f"the scheduler cannot place pod {name} of the pool "
                    f"({len(names)} pod(s)) in namespace {self.kubectl.namespace}: "
                    f"{state.unschedulable.strip()} (waited "
                    f"{settings.pending_limit:g} s; Kubernetes(pending_timeout=...) sets "
                    f"the wait; {wait}); nothing of the pool is left"
                )
        ready = {n: s.ip for n in names if (s := states.get(n)) and s.phase == "Running" and s.ip}
        if len(ready) == len(names):
            return ready
        if now > deadline:
            pending = [n for n in names if n not in ready]
            state = states.get(pending[0])
            raise ProvisionError(
                f"pods {', '.join(pending)} did not run within "
                f"{self.spec.options.start_timeout:g} s (phase "
                f"{state.phase if state else 'unknown: not seen'}); "
                "Options(start_timeout=...) sets the limit",
                cause=ProvisionCause.TIMEOUT,
            )
        return None

    def _start_early(self, machine: Machine) -> None:
        """Start ``machine``'s agent now (once), for :meth:`start_agent` to take."""
        if machine.ident not in self.early:
            self.early[machine.ident] = asyncio.ensure_future(self._start(machine))

    async def _start(self, machine: Machine) -> AgentProcess:
        agent = await super().start_agent(machine)
        self.agents.append(agent)  # free() stops it
        return agent

    async def start_agent(self, machine: Machine) -> AgentProcess:
        """The agent of ``machine``: the one started when its pod began to run (see
        :meth:`wait_running`), or a new one."""
        started = self.early.pop(machine.ident, None)
        if started is not None:
            return await started
        return await self._start(machine)

    async def replacement(self, rank: int, reason: str) -> Machine:
        """A new pod for ``rank``; the lost one is deleted (without waiting)."""
        old = self.machines[rank]
        with contextlib.suppress(ProvisionError):
            await self.delete_pod(old.host)
        return await self.new_pod(rank, recorded=True)

    async def candidate(self, rank: int) -> Machine | None:
        """A new pod for ``rank`` (an elastic pool grows), once it runs; ProvisionError
        (it is deleted then) when it cannot be placed or run: the pool keeps its size and
        tries again later."""
        return await self.new_pod(rank, recorded=False)

    async def new_pod(self, rank: int, recorded: bool) -> Machine:
        """A new pod for ``rank``, once it runs (its creation ``recorded`` in the ledger);
        deleted again when it cannot be placed or run."""
        name = self.pod_name(rank)
        try:
            with self.creating("pod", self.selector) if recorded else contextlib.nullcontext():
                await self.kubectl.create([self.provider.pod(self.spec, rank, name)])
            ips = await self.wait_running([name])
        except BaseException:
            with contextlib.suppress(Exception):
                await self.delete_pod(name)
            raise
        return self.new_machine(rank, name, ips[name])

    async def delete_pod(self, name: str) -> None:
        """Delete the pod ``name`` if it is there, without waiting for it to end."""
        await self.kubectl.call(["delete", "pod", name, "--ignore-not-found", "--wait=false"])

    async def give_back(self, machine: Machine, failed: bool) -> None:
        """Delete the pod of a node an elastic pool released (or whose agent did not
        start), without waiting for it to end."""
        with contextlib.suppress(ProvisionError):
            await self.delete_pod(machine.host)

    async def lost_machines(self, machines: list[Machine]) -> dict[str, str]:
        """A pod that is gone, deleting or ended (its exec stream usually ends first)."""
        states = await self.pod_states()
        lost = {}
        for m in machines:
            state = states.get(m.host)
            if state is None or state.deleting:
                lost[m.ident] = f"pod {m.host} was deleted"
            elif state.ended:
                lost[m.ident] = f"pod {m.host} {state.ended}"
        return lost

    async def free(self) -> None:
        """Stop the agents, then delete the pool's pods (waiting until they are gone), its
        Service and its Secret."""
        self.stop_watching()
        early, self.early = list(self.early.values()), {}
        for task in early:  # started early, never taken (the start failed)
            task.cancel()
        await asyncio.gather(*early, return_exceptions=True)
        await asyncio.gather(
            *(a.terminate() for a in self.agents if a.exit_status() is None),
            return_exceptions=True,
        )
        failed = await asyncio.gather(
            self.kubectl.delete("pods", self.selector, wait=True),
            self.kubectl.delete(self.others, self.selector, wait=False),
            return_exceptions=True,
        )
        for e in failed:
            if isinstance(e, BaseException):
                raise e

    def sweep(self) -> None:
        """Delete the pool's pods, Service and Secret, found by the pool's label, without
        waiting for the pods to end (synchronous: the process exits, see
        ``base.Allocation.sweep``)."""
        if not self.created:
            return
        self.kubectl.delete_now(f"pods,{self.others}", self.selector)
