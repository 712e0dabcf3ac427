"""The Lambda Cloud instances of one pool: launch, reach, replace, terminate (see
``provider``)."""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._errors import ProvisionCause, ProvisionError
from ..base import Machine, PoolSpec
from ..cloud import login
from ..cloud.allocation import GUARD_ID, SelfEnding, as_root, show
from ..cloud.keys import KeyPair, user_data
from ..cloud.market import fits, unoffered
from ..cloud.rest import ApiError, RestApi
from ..offers import Offer
from .api import data
from .settings import LambdaSettings

logger = logging.getLogger("flotilla.lambda")

FOLDER_PREFIX = "flotilla-lambda-"
TERMINATE = "/root/.flotilla-lambda-terminate"
"""The root-only script with which an instance terminates itself."""


@dataclass(frozen=True)
class Candidate:
    """An instance type that fits the pool, and the regions that have room now."""

    name: str
    gpus: str
    count: int
    hourly: float
    regions: tuple[str, ...]


def candidates(types: dict[str, Any], spec: PoolSpec, settings: LambdaSettings) -> list[Candidate]:
    """The instance types that have the pool's accelerator (count included), cheapest
    first; ConfigurationError naming the nearest when none has it."""
    acc = spec.accelerator
    out = []
    for name, entry in types.items():
        t = entry.get("instance_type") or {}
        gpus = int((t.get("specs") or {}).get("gpus") or 0)
        if not fits(acc, settings.instance_type, name, gpus, name, "lambda"):
            continue
        regions = tuple(
            str(r.get("name")) for r in entry.get("regions_with_capacity_available") or []
        )
        if settings.region is not None:
            regions = tuple(r for r in regions if r == settings.region)
        out.append(
            Candidate(
                name,
                str(t.get("gpu_description") or t.get("description") or name),
                gpus,
                float(t.get("price_cents_per_hour") or 0) / 100,
                regions,
            )
        )
    if not out and acc is not None:
        raise unoffered(acc, "Lambda Cloud", "lambda", sorted(types))
    return sorted(out, key=lambda c: (c.hourly, c.name))


def as_offers(c: Candidate) -> list[Offer]:
    return [
        Offer("lambda", c.gpus, c.count, c.hourly, r, False, c.name, None)
        for r in c.regions or ("(no capacity now)",)
    ]


def terminate_script(url: str, key: str) -> str:
    """The instance's own terminate script: it finds itself among the account's instances
    by its addresses (``hostname -I``: Lambda gives an instance no id of its own to read)
    and terminates that one; tried 8 times over about 4 minutes."""
    python = (
        "import json,subprocess,time,urllib.request as u\n"
        f"URL={json.dumps(url)};KEY={json.dumps(key)}\n"
        'H={"Authorization":"Bearer "+KEY,"Content-Type":"application/json"}\n'
        'mine=set(subprocess.run(["hostname","-I"],capture_output=True,text=True).stdout.split())\n'
        "for n in range(8):\n"
        " try:\n"
        '  rows=json.load(u.urlopen(u.Request(URL+"/instances",headers=H),timeout=10))["data"]\n'
        '  ids=[r["id"] for r in rows if r.get("private_ip") in mine or r.get("ip") in mine]\n'
        '  b=json.dumps({"instance_ids":ids}).encode()\n'
        '  u.urlopen(u.Request(URL+"/instance-operations/terminate",data=b,method="POST",'
        "headers=H),timeout=10).read()\n"
        '  print("terminated",ids,flush=True);break\n'
        " except Exception as x:\n"
        '  print("failed:",x,flush=True);time.sleep(2**n)\n'
    )
    return (
        f"umask 077; cat > {TERMINATE} <<'FLOTILLA_TERMINATE'\n"
        f"exec >>{TERMINATE}.log 2>&1 </dev/null\n"
        f"exec python3 -c '{python}'\n"
        "FLOTILLA_TERMINATE\n"
        f"chmod 700 {TERMINATE}"
    )


POWEROFF = as_root(TERMINATE)
"""What the watchdog and the guard run when the client is gone: the terminate script."""


class LambdaAllocation(SelfEnding):
    """The Lambda Cloud instances of one pool.

    Attributes:
        instances: instance id -> its last description.
        ssh_key_id: the pool's login key registered with Lambda ("" before).
    """

    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=8, thread_name_prefix="flotilla-lambda"
    )
    handover = "installed by cloud-init from the user-data"
    cloud = "Lambda Cloud"
    poweroff = POWEROFF
    label_key = "name"
    cloud_log = logger
    key_path = "/ssh-keys"
    key_field = "public_key"
    noun = "Lambda"
    running = "active"
    ended = frozenset({"terminated"})
    gone = frozenset({"terminated"})

    folder_prefix = FOLDER_PREFIX
    settings: LambdaSettings
    api: RestApi
    _candidates: list[Candidate]

    def __init__(
        self, settings: LambdaSettings, api: RestApi, ttl_key: str, spec: PoolSpec
    ) -> None:
        super().__init__(settings, api, spec)
        self.ttl_key = ttl_key

    # -- launch ------------------------------------------------------------------------
    def search(self) -> list[Candidate]:
        types = data(self.api.call("GET", "/instance-types", "list instance types")) or {}
        return candidates(dict(types), self.spec, self.settings)

    def price(self, kind: Candidate) -> float:
        return kind.hourly

    def answer_id(self, reply: Any) -> str:
        return str((data(reply) or {}).get("id") or "")

    def _user_data(self, host_key: KeyPair) -> str:
        assert self.login_key is not None
        guard = self.guard(POWEROFF)
        return user_data(
            host_key,
            self.login_key,
            [terminate_script(self.api.url, self.ttl_key), f"INSTANCE_ID={GUARD_ID}; {guard}"],
        )

    def _launch(self, count: int, region: str | None) -> tuple[list[str], str]:
        """``count`` instances in one launch, at the first (type, region) with room (in
        ``region`` only when given: a node added joins its pool's private network)."""
        host_key = self.new_host_key()
        script = self._user_data(host_key)
        tried = []
        for c in self._candidates:
            for r in c.regions:
                if region is not None and r != region:
                    continue
                body = {
                    "region_name": r,
                    "instance_type_name": c.name,
                    "ssh_key_names": [self.key_name],
                    "file_system_names": [],
                    "quantity": count,
                    "name": self.label,
                    "user_data": script,
                }
                try:
                    with self.creating("instance", self.label):
                        reply = self.api.call(
                            "POST", "/instance-operations/launch", f"launch {c.name}", body
                        )
                except ApiError as e:
                    if e.cause is not ProvisionCause.CAPACITY:
                        raise
                    tried.append(f"{c.name} in {r}")
                    self.tell(logger, f"Lambda Cloud: no capacity for {count} x {c.name} in {r}")
                    continue
                ids = [str(i) for i in (data(reply) or {}).get("instance_ids") or []]
                for i in ids:
                    self.instances[i] = {"id": i, "host_key": host_key, "region": {"name": r}}
                    self.billed(i, c.hourly)
                return ids, r
        raise ProvisionError(
            f"Lambda Cloud has no capacity for {count} x {self.spec.accelerator or 'an instance'}"
            f" now (tried {'; '.join(tried) or 'no region with capacity listed'})",
            cause=ProvisionCause.CAPACITY,
        )

    def place(self, ident: str) -> str:
        return str((self.instances[ident].get("region") or {}).get("name") or "")

    def _machine(self, rank: int, ident: str) -> Machine:
        row = self.instances[ident]
        return Machine(rank, f"lambda-{ident}", str(row.get("private_ip") or row["ip"]), ident)

    # -- release -----------------------------------------------------------------------
    def end(self, ids: list[str]) -> None:
        if ids:
            self.api.call(
                "POST",
                "/instance-operations/terminate",
                "terminate instances",
                {"instance_ids": ids},
            )

    def rows(self) -> list[dict[str, Any]]:
        return data(self.api.call("GET", "/instances", "list the pool's instances")) or []

    def leftovers(self) -> list[Callable[[], None]]:
        return [lambda: delete_keys(self.api, {self.key_name}, self.ssh_key_id)]


def delete_keys(api: RestApi, names: set[str], known: str = "") -> None:
    """Delete the SSH keys called ``names`` (and the one of id ``known``)."""
    ids = {known} if known else set()
    if names:
        for k in data(api.call("GET", "/ssh-keys", "list SSH keys")) or []:
            if str(k.get("name")) in names:
                ids.add(str(k.get("id")))
    for i in sorted(ids):
        api.delete(f"/ssh-keys/{i}", f"delete SSH key {i}")


def ssh_login(address: str) -> list[str]:
    """``ssh`` arguments that log in to the running instance whose peers' address is
    ``address`` as its pool does (``flotilla ssh``)."""
    return login.ssh_login(FOLDER_PREFIX, address, "Lambda Cloud")


def _show(message: str) -> None:
    show(logger, message)
