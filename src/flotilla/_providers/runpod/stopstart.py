"""Stopping and starting a stoppable RunPod pool's pods (``cloud.stopstart``'s flow), as
the official client's ``stop_pod``/``resume_pod`` do: GraphQL ``podStop(input: {podId})``
and ``podResume(input: {podId, gpuCount})``. A stopped pod (``desiredStatus`` EXITED)
gives its GPUs back and loses its container disk; its volume disk (``RunPod(volume_gb=)``,
at ``volume_mount_path``) stays, and RunPod bills only that volume while it is stopped. A
resume needs free GPUs on the pod's own host machine ("not enough free GPUs": the pods
stay stopped). The pods are renamed (REST ``PATCH /pods/{id}``) with the new client's
label before they start, so that ``down --orphans`` sees a live owner. Interruptible
(spot) pods are terminated, never stopped."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from ..._errors import ProvisionError
from ..base import Machine
from ..cloud.kept import KeptPool
from ..cloud.keys import KeyPair
from ..cloud.stopstart import StoppableAllocation
from .api import RunPodApi

STOP_TIMEOUT = 300.0
POD_STOP = "mutation Stop($id: String!) { podStop(input: {podId: $id}) { id desiredStatus } }"
POD_RESUME = (
    "mutation Resume($id: String!, $gpus: Int!) { podResume(input: {podId: $id, "
    "gpuCount: $gpus}) { id desiredStatus imageName env machineId machine { podHostId } } }"
)


class RunPodStopping(StoppableAllocation):
    """The stop and start hooks of ``pool.RunPodAllocation`` (which implements the
    methods this class only declares)."""

    provider_kind = "runpod"
    provider_title = "RunPod"
    api: RunPodApi
    label: str
    pods: dict[str, dict[str, Any]]
    _host_keys: dict[str, KeyPair]

    def _wait_running(self, ids: list[str]) -> None:
        raise NotImplementedError

    def _machine(self, rank: int, ident: str) -> Machine:
        raise NotImplementedError

    def _terminate(self, ident: str) -> None:
        raise NotImplementedError

    def place(self) -> str:
        ids = self.node_ids()
        row = self.pods.get(ids[0], {}) if ids else {}
        return str((row.get("machine") or {}).get("dataCenterId") or "")

    def host_keys_of(self, ident: str) -> list[str]:
        key = self._host_keys.get(ident)
        return [key.public] if key is not None else []

    def _statuses(self) -> dict[str, str]:
        rows = self.api.call("GET", "/pods", "list the pool's pods")
        return {str(r.get("id")): str(r.get("desiredStatus")) for r in rows or []}

    def stop_instances(self, ids: list[str]) -> None:
        for ident in [i for i in self.pods if i not in ids]:  # replaced nodes' pods
            self._terminate(ident)
        for ident in ids:
            self.api.query(POD_STOP, f"stop pod {ident}", {"id": ident})
        deadline = time.monotonic() + STOP_TIMEOUT
        while True:
            statuses = self._statuses()
            left = [i for i in ids if statuses.get(i, "EXITED") != "EXITED"]
            if not left:
                return
            if time.monotonic() > deadline:
                raise ProvisionError(f"RunPod: pods {', '.join(left)} are not stopped")
            time.sleep(0.2)

    def start_instances(self, kept: KeptPool) -> list[Machine]:
        for node in kept.nodes:
            self.pods[node.id] = {}
            self._host_keys[node.id] = KeyPair("", node.host_keys[0] if node.host_keys else "")
            row = self.api.call("GET", f"/pods/{node.id}", f"look up pod {node.id}")
            gpus = int((row.get("gpu") or {}).get("count") or 1)
            # this client is the pods' owner now (``down --orphans`` asks whether it lives)
            self.api.call(
                "PATCH", f"/pods/{node.id}", f"rename pod {node.id}", {"name": self.label}
            )
            what = f"resume pod {node.id}"
            variables = {"id": node.id, "gpus": gpus}
            self.start_one(partial(self.api.query, POD_RESUME, what, variables), what)
        self._wait_running(kept.ids)
        return [self._machine(rank, ident) for rank, ident in enumerate(kept.ids)]
