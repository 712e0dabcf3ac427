"""Stopping and starting a stoppable GCP pool's instances (``cloud.stopstart``'s flow):
``instances.stop`` keeps an instance's boot disk (and its SSH host keys, and the files on
it) and bills only the disk while it is TERMINATED; ``instances.start`` boots it again (the
startup script runs again), with a new ephemeral external address. Both are ``*_unary``
calls waited on with the ``ZoneOperationsClient`` at the same endpoint, as inserts are.
SPOT instances are deleted, never stopped (their termination action is DELETE)."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from ..._errors import ProvisionCause, ProvisionError
from ..base import Machine
from ..cloud.kept import KeptPool
from ..cloud.stopstart import StoppableAllocation
from .api import GcpApi

STOP_TIMEOUT = 300.0
CLIENT_KEY = "flotilla-client"
"""An instance's metadata item ``flotilla-client={host:pid:start}`` (a label cannot hold it)."""


class GCPStopping(StoppableAllocation):
    """The stop and start hooks of ``pool.GCPAllocation`` (which implements the methods
    this class only declares)."""

    provider_kind = "gcp"
    provider_title = "GCP"
    api: GcpApi
    zone: str
    zones_tried: list[str]
    client: str
    instances: dict[str, dict[str, Any]]
    pinned: dict[str, list[str]]

    def _wait_ready(self, zone: str, name: str, deadline: float) -> None:
        raise NotImplementedError

    def _machine(self, rank: int, row: dict[str, Any]) -> Machine:
        raise NotImplementedError

    def _delete(self, zone: str, name: str, deadline: float) -> None:
        raise NotImplementedError

    def place(self) -> str:
        return self.zone

    def host_keys_of(self, ident: str) -> list[str]:
        return list(self.pinned.get(ident, []))

    def _op(self, verb: str, name: str, deadline: float, **fields: Any) -> None:
        """``instances.{verb}_unary`` on instance ``name``, waited on."""
        api = self.api
        instances = api.client("InstancesClient")
        call = getattr(instances, f"{verb}_unary")
        op = api.call(
            f"{verb.replace('_', ' ')} instance {name}",
            lambda: call(project=api.project, zone=self.zone, instance=name, **fields),
        )
        api.wait(self.zone, op, f"{verb.replace('_', ' ')} instance {name}", deadline)

    def _status(self, name: str) -> str:
        api = self.api
        instances = api.client("InstancesClient")
        inst = api.call(
            f"look up instance {name}",
            lambda: instances.get(project=api.project, zone=self.zone, instance=name),
        )
        row = type(inst).to_dict(inst)
        self.instances[name] = row
        return str(row.get("status", ""))

    def stop_instances(self, ids: list[str]) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT
        for name in [n for n in self.instances if n not in ids]:  # replaced nodes' ones
            self._delete(self.zone, name, deadline)
            self.instances.pop(name, None)
        for name in ids:
            self._op("stop", name, deadline)
        waiting = set(ids)

        def step() -> bool:
            for name in sorted(waiting):
                if self._status(name) == "TERMINATED":
                    waiting.discard(name)
            return not waiting

        self._poll_until(step, deadline, lambda: f"GCP: {', '.join(sorted(waiting))} not stopped")

    def _poll_until(self, step: Any, deadline: float, late: Any) -> None:
        """``step()`` every 0.2 s until it is done (the pool's ``poll`` refuses to wait
        once the pool is being released, which a stop is part of)."""
        while not step():
            if time.monotonic() > deadline:
                raise ProvisionError(late(), cause=ProvisionCause.TIMEOUT)
            time.sleep(0.2)

    def start_instances(self, kept: KeptPool) -> list[Machine]:
        from google.cloud import compute_v1 as c

        self.zone = kept.place
        self.zones_tried = [kept.place]
        deadline = time.monotonic() + self.spec.options.start_timeout
        names = kept.ids
        for name in names:
            status = self._status(name)
            if status == "STOPPING":
                self._poll_until(
                    lambda n=name: self._status(n) != "STOPPING",
                    deadline,
                    lambda n=name: f"GCP: instance {n} is still stopping",
                )
            row = self.instances[name]
            # this client is the instances' owner now (``down --orphans`` asks whether it lives)
            meta = row.get("metadata") or {}
            items = [
                c.Items(key=i["key"], value=self.client if i["key"] == CLIENT_KEY else i["value"])
                for i in meta.get("items") or []
            ]
            resource = c.Metadata(fingerprint=meta.get("fingerprint", ""), items=items)
            self._op("set_metadata", name, deadline, metadata_resource=resource)
        for name in names:
            start = partial(self._op, "start", name, deadline)
            self.start_one(start, f"start {name} in {self.zone}")
        for name in names:
            self._wait_ready(self.zone, name, deadline)
        return [self._machine(rank, self.instances[name]) for rank, name in enumerate(names)]
