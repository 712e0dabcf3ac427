"""Stopping and starting a stoppable Verda pool's instances (``cloud.stopstart``'s flow),
as the official client's ``instances.action(ids, "shutdown")`` / ``"start"`` do: ``PUT
/instances {"id": [...], "action": "shutdown"|"start"}``. A shut-down instance
(``offline``) keeps its OS volume (the pool's host key and login key on it, and the
files), and Verda bills only that disk while it is shut down; a start boots it again (the
startup script is not run again: what it installed is on the disk). Spot instances are
deleted, never shut down.

Verda cannot relabel an instance (its ``description`` is set at the create), so the new
client records the instances it started in its pool folder's ``adopted`` file: ``down
--orphans`` leaves the instances a live pool on this machine adopted, and ``offline``
ones (only ``flotilla stop`` shuts a flotilla instance down; ``flotilla down NAME``
removes them)."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from ..._errors import ProvisionCause, ProvisionError
from ..base import Machine
from ..cloud.identity import client_alive
from ..cloud.kept import KeptPool
from ..cloud.keys import KeyPair
from ..cloud.stopstart import StoppableAllocation
from .api import VerdaApi

STOP_TIMEOUT = 300.0
STOPPED = "offline"
"""The status of a shut-down instance."""
ADOPTED = "adopted"
"""The file of a pool folder listing the kept instances its pool started."""


class VerdaStopping(StoppableAllocation):
    """The stop and start hooks of ``pool.VerdaAllocation`` (which implements the
    methods this class only declares)."""

    provider_kind = "verda"
    provider_title = "Verda"
    api: VerdaApi
    folder: str
    instances: dict[str, dict[str, Any]]
    ssh_key_id: str
    key_name: str

    if TYPE_CHECKING:  # ``pool.VerdaAllocation``'s and ``SelfEnding``'s (after this in its MRO)

        def wait_running(self, ids: list[str]) -> None: ...

        def _machine(self, rank: int, ident: str) -> Machine: ...

        def end(self, ids: list[str]) -> None: ...

    def place(self, ident: str | None = None) -> str:
        """Where instance ``ident`` is (its location); by default the pool's nodes'."""
        if ident is None:
            ids = self.node_ids()
            if not ids:
                return ""
            ident = ids[0]
        return str(self.instances.get(ident, {}).get("location") or "")

    def sweep(self) -> None:
        """Closing the pool: its instances shut down when its keep folder says so, else
        everything removed (``cloud.allocation.SelfEnding``) and nothing kept."""
        if self.kept_at_release():
            shutil.rmtree(self.folder, ignore_errors=True)
            return
        super().sweep()
        self.forget_kept()

    def host_keys_of(self, ident: str) -> list[str]:
        key = self.instances.get(ident, {}).get("host_key")
        return [key.public] if isinstance(key, KeyPair) else []

    def _action(self, ids: list[str], action: str) -> None:
        what = f"{action} instance(s) {', '.join(ids)}"
        self.api.call("PUT", "/instances", what, {"id": ids, "action": action})

    def _statuses(self) -> dict[str, str]:
        rows = self.api.call("GET", "/instances", "list the pool's instances") or []
        return {str(r.get("id")): str(r.get("status")) for r in rows}

    def stop_instances(self, ids: list[str]) -> None:
        self.end([i for i in self.instances if i not in ids])  # replaced nodes' ones
        self._action(ids, "shutdown")
        deadline = time.monotonic() + STOP_TIMEOUT
        while True:
            statuses = self._statuses()
            left = [i for i in ids if statuses.get(i, STOPPED) != STOPPED]
            if not left:
                break
            if time.monotonic() > deadline:
                raise ProvisionError(
                    f"Verda: instances {', '.join(left)} are not shut down",
                    cause=ProvisionCause.TIMEOUT,
                )
            time.sleep(0.2)
        # the login key is on the instances' disks: Verda need not keep it
        if self.ssh_key_id:
            self.api.delete(f"/sshkeys/{self.ssh_key_id}", "delete the SSH key")

    def start_instances(self, kept: KeptPool) -> list[Machine]:
        with open(os.path.join(self.folder, ADOPTED), "w") as f:  # the owner now
            f.write("".join(f"{i}\n" for i in kept.ids))
        for node in kept.nodes:
            row = self.api.call("GET", f"/instances/{node.id}", f"look up instance {node.id}")
            self.instances[node.id] = dict(row or {})
            self.instances[node.id].update(
                host_key=KeyPair("", node.host_keys[0] if node.host_keys else ""), script=""
            )
            if str((row or {}).get("status")) == STOPPED:
                what = f"start instance {node.id}"
                self.start_one(partial(self._action, [node.id], "start"), what)
        # (``offline`` reads as ended to the launch's wait: not until the start is seen)
        deadline = time.monotonic() + self.spec.options.start_timeout
        while any(s == STOPPED for i, s in self._statuses().items() if i in kept.ids):
            if time.monotonic() > deadline:
                raise ProvisionError(
                    f"Verda: instances {', '.join(kept.ids)} did not start",
                    cause=ProvisionCause.TIMEOUT,
                )
            time.sleep(0.2)
        self.wait_running(kept.ids)
        return [self._machine(rank, ident) for rank, ident in enumerate(kept.ids)]


def adopted(prefix: str) -> set[str]:
    """The instances that live pools of this user on this machine started again (their
    folders' ``adopted`` files, see the module docstring)."""
    out: set[str] = set()
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}*")):
        try:
            if os.stat(folder).st_uid != os.getuid():
                continue
            with open(os.path.join(folder, "client")) as f:
                client = f.read().strip()
            if client_alive(client) is False:
                continue
            with open(os.path.join(folder, ADOPTED)) as f:
                out |= set(f.read().split())
        except OSError:
            continue
    return out
