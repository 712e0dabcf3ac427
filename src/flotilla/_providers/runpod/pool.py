"""The RunPod pods of one pool: rent, reach, replace, terminate (see ``provider``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import shutil
import time
from typing import Any

from ..._errors import ProvisionCause, ProvisionError
from ..._wire.protocol import CLOUD_ENV
from ..base import AllocationState, Machine, PoolSpec
from ..cloud import login
from ..cloud.allocation import show
from ..cloud.identity import client_id, pool_folder
from ..cloud.keys import KeyPair, pin
from ..cloud.market import label, pool_ids, release_each
from ..cloud.rest import ApiError
from ..cloud.selfdestruct import DestroyCall, contact, poweroff_command, start_script
from ..ssh_shell import Target
from .api import RunPodApi
from .choice import GPU_TYPES, Candidate, affordable, candidates
from .settings import RunPodSettings
from .stopstart import RunPodStopping

logger = logging.getLogger("flotilla.runpod")

FOLDER_PREFIX = "flotilla-runpod-"
POLL = 0.2
SSHD = (
    'mkdir -p ~/.ssh && chmod 700 ~/.ssh && echo "$PUBLIC_KEY" >> ~/.ssh/authorized_keys\n'
    "chmod 600 ~/.ssh/authorized_keys\n"
    'mkdir -p /run/sshd && exec "$(command -v sshd || echo /usr/sbin/sshd)" -D -e\n'
)
"""The end of a pod's start command: what RunPod's images' ``/start.sh`` does for SSH (the
login key from ``PUBLIC_KEY``, then sshd on the container's port 22)."""


def internal_name(pod_id: str) -> str:
    """A pod's name on RunPod's global network."""
    return f"{pod_id}.runpod.internal"


class RunPodAllocation(RunPodStopping):
    """The RunPod pods of one pool (a named cluster's can be stopped and resumed:
    ``stopstart``; an elastic pool's come and go one at a time:
    ``cloud.allocation.InstanceAllocation``).

    Attributes:
        pods: pod id -> its last description (REST v1), for every pod created.
        chosen: the candidate each pod is of.
    """

    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=8, thread_name_prefix="flotilla-runpod"
    )
    handover = "installed by its start command"
    prefix = "runpod-"

    def __init__(self, settings: RunPodSettings, api: RunPodApi, spec: PoolSpec) -> None:
        super().__init__(spec, [])
        self.state = AllocationState.ACQUIRING
        self.settings = settings
        self.api = api
        self.pods: dict[str, dict[str, Any]] = {}
        self.chosen: dict[str, Candidate] = {}
        self._open(settings, pool_folder(FOLDER_PREFIX, spec.pool_id))
        self.label = label(spec.pool_id, client_id())
        self._targets: dict[str, Target] = {}
        self._candidates: list[Candidate] = []
        self._host_keys: dict[str, KeyPair] = {}

    # -- launch ------------------------------------------------------------------------
    async def launch(self) -> None:
        await self._make_login_key()
        self._candidates = affordable(await self._in_thread(self.search), self.spec)
        if self.starts_empty(
            logger, "RunPod", "pod(s)", f", from {self._candidates[0].describe()}"
        ):
            return
        ids = await self._in_thread(self._create_all, self.spec.nodes)
        kinds = sorted({self.chosen[i].describe() for i in ids})
        _show(f"RunPod: {self.spec.nodes} pod(s): {', '.join(kinds)}; pods {', '.join(ids)}")
        await self._in_thread(self._wait_running, ids)
        self.machines = [self._machine(rank, i) for rank, i in enumerate(ids)]
        self.state = AllocationState.READY

    def search(self) -> list[Candidate]:
        types = self.api.query(GPU_TYPES, "list GPU types").get("gpuTypes") or []
        return candidates(list(types), self.spec, self.settings)

    def _create_all(self, count: int) -> list[str]:
        """Create ``count`` pods, one after the other, walking the candidates and their
        data centers from where the previous pod was had (a capacity error moves on)."""
        host_key = self.new_host_key()
        ids: list[str] = []
        at = 0
        for _ in range(count):
            ident, at = self._create(host_key, at)
            ids.append(ident)
        return ids

    def create_one(self, rank: int) -> str:
        return self._create(self.new_host_key(), 0)[0]

    def _places(self) -> list[tuple[Candidate, str | None]]:
        centers: list[str | None] = list(self.settings.data_centers) or [None]
        return [(c, dc) for c in self._candidates for dc in centers]

    def _create(self, host_key: KeyPair, start: int) -> tuple[str, int]:
        """One pod at the first place from ``start`` that has room; (its id, that place's
        index). ProvisionError (CAPACITY) listing where it was tried when none has."""
        places = self._places()
        tried = []
        for index in range(start, len(places)):
            candidate, dc = places[index]
            try:
                pod = self._create_at(candidate, dc, host_key)
            except ApiError as e:
                if e.cause is not ProvisionCause.CAPACITY:
                    raise
                tried.append(f"{candidate.gpu_type} {candidate.cloud.lower()} in {dc or 'any'}")
                self.tell(
                    logger,
                    f"RunPod: no capacity for {candidate.describe()} in {dc or 'any data center'}",
                )
                continue
            ident = str(pod["id"])
            self.pods[ident] = pod
            self._host_keys[ident] = host_key
            self.chosen[ident] = candidate
            self.billed(ident, float(pod.get("costPerHr") or candidate.hourly))
            return ident, index
        raise ProvisionError(
            f"RunPod has no capacity for {self.spec.accelerator} now (tried "
            f"{'; '.join(tried) or 'nothing: every candidate was taken by earlier nodes'})",
            cause=ProvisionCause.CAPACITY,
        )

    def _start_command(self, host_key: KeyPair) -> list[str]:
        call = DestroyCall(
            "RUNPOD_POD_ID",
            "DELETE",
            f"{self.api.rest.url}/pods/$RUNPOD_POD_ID",
            (("Authorization", "Bearer $RUNPOD_API_KEY"),),
        )
        script = start_script(
            "runpod",
            self.spec.pool_id,
            host_key,
            call,
            self.settings.workdir,
            self.settings.ttl,
            self.spec.options.start_timeout,
        )
        return ["bash", "-c", script + SSHD]

    def _create_at(self, candidate: Candidate, dc: str | None, host_key: KeyPair) -> dict[str, Any]:
        assert self.login_key is not None
        body: dict[str, Any] = {
            "name": self.label,
            "imageName": self.settings.image,
            "gpuTypeIds": [candidate.gpu_type],
            "gpuCount": candidate.count,
            "cloudType": candidate.cloud,
            "interruptible": candidate.interruptible,
            "containerDiskInGb": int(self.settings.disk_gb),
            "volumeInGb": int(self.settings.volume_gb),
            "ports": ["22/tcp"],
            "supportPublicIp": True,
            "globalNetworking": self.settings.global_networking,
            "dockerStartCmd": self._start_command(host_key),
            "env": {"PUBLIC_KEY": self.login_key.public},
        }
        if self.settings.volume_gb:
            body["volumeMountPath"] = self.settings.volume_mount_path
        if dc is not None:
            body["dataCenterIds"] = [dc]
        with self.creating("pod", self.label):
            pod = self.api.call("POST", "/pods", f"create a pod of {candidate.gpu_type}", body)
        return dict(pod)

    def _wait_running(self, ids: list[str]) -> None:
        deadline = time.monotonic() + self.spec.options.start_timeout
        waiting = set(ids)

        def step() -> bool:
            rows = self.api.call("GET", "/pods", "list the pool's pods")
            for row in rows if isinstance(rows, list) else []:
                ident = str(row.get("id"))
                if ident in self.pods:
                    self.pods[ident] = row
                if ident in waiting and row.get("publicIp") and self._port(row):
                    waiting.discard(ident)
            gone = [i for i in waiting if i not in {str(r.get("id")) for r in rows or []}]
            if gone:
                raise ProvisionError(
                    f"RunPod pod(s) {', '.join(gone)} ended while starting",
                    cause=ProvisionCause.NODE,
                )
            return not waiting

        self.poll(
            step,
            deadline,
            lambda: (
                f"RunPod pods {', '.join(sorted(waiting))} not running with a public SSH "
                f"port within {self.spec.options.start_timeout:g} s; "
                "Options(start_timeout=...) sets the limit"
            ),
            POLL,
        )
        for ident in ids:
            row = self.pods[ident]
            target = Target(str(row["publicIp"]), "root", self._port(row))
            self._targets[ident] = target
            pin(self.known_hosts, f"[{target.host}]:{target.port}", self._host_keys[ident])

    @staticmethod
    def _port(row: dict[str, Any]) -> int:
        """The public port mapped to the pod's port 22 (0: not yet)."""
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            return int((row.get("portMappings") or {}).get("22") or 0)
        return 0

    def wait_one(self, ident: str) -> None:
        self._wait_running([ident])

    def machine_of(self, rank: int, ident: str) -> Machine:
        return self._machine(rank, ident)

    def _machine(self, rank: int, ident: str) -> Machine:
        row = self.pods[ident]
        address = internal_name(ident) if self.settings.global_networking else str(row["publicIp"])
        return Machine(rank, f"runpod-{ident}", address, ident)

    # -- agents ------------------------------------------------------------------------
    def target(self, machine: Machine) -> Target:
        return self._targets[machine.ident]

    async def start_agent(self, machine: Machine) -> Any:
        agent = await super().start_agent(machine)
        self._remember(machine)
        return agent

    def _remember(self, machine: Machine) -> None:
        """Where ``machine`` is reached over SSH, for ``flotilla ssh`` (:func:`ssh_login`)."""
        login.remember(self.folder, machine.address, self._targets[machine.ident])

    def agent_env(self, machine: Machine) -> dict[str, str]:
        """``FLOTILLA_CLOUD``: the watchdog terminates the pod ``ttl`` s after the client's
        last contact (see ``cloud/selfdestruct.py``)."""
        settings = {
            "contact": contact(self.settings.workdir, machine.ident),
            "ttl": self.settings.ttl,
            "poweroff": poweroff_command(self.settings.workdir, "runpod", machine.ident),
            "imds": "",
        }
        return {CLOUD_ENV: json.dumps(settings)}

    # -- release -----------------------------------------------------------------------
    def end_one(self, ident: str) -> None:
        self._terminate(ident)
        self.pods.pop(ident, None)

    def _terminate(self, ident: str) -> None:
        self.api.delete(f"/pods/{ident}", f"terminate pod {ident}")

    def sweep(self) -> None:
        """Terminate every pod of the pool: the ones created, and any the API lists with
        the pool's name (a create whose answer was lost); then remove the local folder."""
        try:
            if self.kept_at_release():
                return
            ids = set(self.pods)
            with contextlib.suppress(ProvisionError):
                rows = self.api.call("GET", "/pods", "list the pool's pods")
                ids |= pool_ids(rows if isinstance(rows, list) else [], "name", self.spec.pool_id)
            errors = release_each(sorted(ids), self._terminate)
            if errors:
                _show(
                    f"RunPod: could not terminate everything of pool {self.spec.pool_id}: "
                    + "; ".join(errors)
                )
            else:
                self.forget_kept()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def ssh_login(address: str) -> list[str]:
    """``ssh`` arguments that log in to the running pod whose peers' address is
    ``address`` as its pool does (``flotilla ssh``)."""
    return login.ssh_login(FOLDER_PREFIX, address, "RunPod")


def _show(message: str) -> None:
    show(logger, message)
