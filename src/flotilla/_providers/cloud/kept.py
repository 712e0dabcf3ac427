"""A stoppable pool: what a named cluster keeps on this machine so that its instances can
be stopped (their disks kept, no compute billed) and started again by a later pool, as
SkyPilot's ``sky stop`` / ``sky start`` do.

The command line's backend gives the provider a keep folder (:class:`KeepFolder`, private to
this user). The pool records its instances there (``pool.json``, written once the pool is
up, after a replacement and when it stops) with the pool's login key. Closing the pool
removes everything, as always, unless the folder's ``stop`` was set (``flotilla stop``,
``--autostop``): then the instances are stopped, and the next pool of the cluster starts
them instead of making new ones, with their recorded host keys pinned.

AWS records its own fields (``aws.kept``); the rented clouds that stop and start (RunPod
pods, Compute Engine instances) share :class:`KeptPool` and ``cloud.stopstart``'s flow.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..._errors import ConfigurationError
from ..._system.private import private_dir

STATE_FILE = "pool.json"
LOGIN_KEY = "login_key"
_R = TypeVar("_R")


@dataclass
class KeepFolder:
    """A stoppable pool's folder on this machine, and what closing the pool does.

    Attributes:
        folder: the folder (made private to this user on first write).
        stop: closing the pool stops its instances (kept for a later pool) instead of
            removing them. A pool that starts kept instances sets it while it starts (a
            failed start keeps them); it is cleared once the pool is up.
    """

    folder: Path
    stop: bool = False

    where = "its instances are still in the provider's console"
    """Where a user finds the instances of a record that cannot be read."""

    @property
    def state_file(self) -> Path:
        return self.folder / STATE_FILE

    @property
    def login_key(self) -> Path:
        return self.folder / LOGIN_KEY

    def load_data(self) -> dict[str, Any] | None:
        """The record's data, or None when there is none; a ConfigurationError when it
        cannot be read."""
        try:
            data = json.loads(self.state_file.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            raise ConfigurationError(
                f"the stopped pool's record {self.state_file} cannot be read ({e}): {self.where}"
            ) from e

    def save_data(self, data: dict[str, Any], login_key: str | None = None) -> None:
        """Record ``data`` (atomically), and copy the login key file ``login_key``."""
        private_dir(self.folder)
        if login_key is not None and os.path.abspath(login_key) != str(self.login_key):
            for suffix in ("", ".pub"):  # the private key first made 0600, then written
                target = f"{self.login_key}{suffix}"
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as dst, open(f"{login_key}{suffix}", "rb") as src:
                    shutil.copyfileobj(src, dst)
        fd, tmp = tempfile.mkstemp(prefix=".pool.", dir=self.folder)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.state_file)

    def restore_login_key(self, folder: str) -> str:
        """Copy the kept login key into a new pool's ``folder``; its path there."""
        login = os.path.join(folder, LOGIN_KEY)
        for suffix in ("", ".pub"):
            with open(f"{self.login_key}{suffix}", "rb") as src:
                data = src.read()
            fd = os.open(login + suffix, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as dst:
                dst.write(data)
        return login

    def forget(self) -> None:
        """The pool's instances are gone: nothing to keep."""
        shutil.rmtree(self.folder, ignore_errors=True)


def record(kind: type[_R], data: dict[str, Any], listed: str, item: type[Any]) -> _R:
    """The record ``kind`` of ``data`` (its fields only: a newer flotilla's extra ones are
    left out), ``data[listed]`` a list of ``item`` records."""
    known = {k: v for k, v in data.items() if k in getattr(kind, "__dataclass_fields__", {})}
    known[listed] = [item(**i) for i in data.get(listed, [])]
    return kind(**known)


@dataclass
class KeptNode:
    """One node's instance, in rank order.

    Attributes:
        id: the instance (pod id, instance name).
        host_keys: its SSH host keys (``type key``), pinned at every start.
    """

    id: str
    host_keys: list[str] = field(default_factory=list)


@dataclass
class KeptPool:
    """What a stoppable rented pool records (``pool.json``).

    Attributes:
        provider: the provider's kind ("gcp", "runpod"): a record is only another pool of
            the same provider's.
        pool: the pool id its instances are labelled with (the first pool's).
        stopped: its instances were stopped (True) or run under a live pool (False).
        spot: its instances are spot / interruptible ones.
        place: where they are (a zone, a data center).
        hourly: what the pool's instances cost per hour while they run.
        nodes: the node instances, in rank order.
    """

    provider: str
    pool: str
    stopped: bool = False
    spot: bool = False
    place: str = ""
    hourly: float | None = None
    nodes: list[KeptNode] = field(default_factory=list)

    @staticmethod
    def from_json(data: dict[str, Any]) -> KeptPool:
        return record(KeptPool, data, "nodes", KeptNode)

    @property
    def ids(self) -> list[str]:
        return [n.id for n in self.nodes]


@dataclass
class Keep(KeepFolder):
    """The keep folder of a rented cloud's stoppable pool (:class:`KeptPool`)."""

    def load(self) -> KeptPool | None:
        """The kept pool, or None (see :meth:`KeepFolder.load_data`)."""
        data = self.load_data()
        return None if data is None else KeptPool.from_json(data)

    def save(self, pool: KeptPool, login_key: str | None = None) -> None:
        self.save_data(asdict(pool), login_key)
