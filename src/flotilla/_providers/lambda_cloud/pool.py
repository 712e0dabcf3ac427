"""The Lambda Cloud instances of one pool: launch, reach, replace, terminate (see
``provider``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..._accelerators import offered_as, unknown_name
from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..._wire.protocol import CLOUD_ENV
from ..base import AllocationState, Machine, PoolSpec
from ..cloud import login
from ..cloud.allocation import InstanceAllocation, cheapest, show
from ..cloud.guard import contact_path
from ..cloud.identity import client_id, pool_folder
from ..cloud.keys import KeyPair, pin, user_data
from ..cloud.market import label, over_budget, pool_ids
from ..cloud.rest import ApiError, RestApi
from ..offers import Offer
from ..ssh_shell import Target
from .api import data
from .settings import LambdaSettings

logger = logging.getLogger("flotilla.lambda")

FOLDER_PREFIX = "flotilla-lambda-"
GUARD_ID = "flotilla"
"""The name the boot guard and the watchdog give the instance's contact file (one pool per
instance; cloud-init's instance id need not be Lambda's)."""
TERMINATE = "/root/.flotilla-lambda-terminate"
"""The root-only script with which an instance terminates itself."""
POLL = 0.3


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
        if settings.instance_type is not None and name != settings.instance_type:
            continue
        if acc is not None and (gpus != acc.count or not offered_as(acc, name, "lambda")):
            continue
        if acc is None and settings.instance_type is None and gpus == 0:
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
        offered = sorted(types)
        raise ConfigurationError(
            unknown_name(
                f"{acc.name}:{acc.count:g}" if acc.count != 1 else acc.name,
                "Lambda Cloud",
                {"lambda": offered},
            )
        )
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


POWEROFF = [
    "sh",
    "-c",
    f'if [ "$(id -u)" = 0 ]; then exec sh {TERMINATE}; else exec sudo -n sh {TERMINATE}; fi',
]
"""What the watchdog and the guard run when the client is gone: the terminate script (as
root: the login user through sudo)."""


class LambdaAllocation(InstanceAllocation):
    """The Lambda Cloud instances of one pool.

    Attributes:
        instances: instance id -> its last description.
        ssh_key_id: the pool's login key registered with Lambda ("" before).
    """

    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=8, thread_name_prefix="flotilla-lambda"
    )
    handover = "installed by cloud-init from the user-data"

    def __init__(
        self, settings: LambdaSettings, api: RestApi, ttl_key: str, spec: PoolSpec
    ) -> None:
        super().__init__(spec, [])
        self.state = AllocationState.ACQUIRING
        self.settings = settings
        self.api = api
        self.ttl_key = ttl_key
        self.instances: dict[str, dict[str, Any]] = {}
        self.ssh_key_id = ""
        self._open(settings, pool_folder(FOLDER_PREFIX, spec.pool_id))
        self.label = label(spec.pool_id, client_id())
        self.key_name = f"flotilla-{spec.pool_id}"
        self._candidates: list[Candidate] = []
        self._launching = threading.Lock()  # one launch at a time: they choose the region

    # -- launch ------------------------------------------------------------------------
    async def launch(self) -> None:
        await self._make_login_key()
        self._candidates = self._affordable(await self._in_thread(self.search))
        await self._in_thread(self._register_key)
        if self.starts_empty(logger, "Lambda Cloud", "instance(s)", cheapest(self._candidates)):
            return
        ids, region = await self._in_thread(self._launch, self.spec.nodes, None)
        _show(f"Lambda Cloud: {len(ids)} instance(s) in {region}: {', '.join(ids)}")
        await self._in_thread(self._wait_active, ids)
        self.machines = [self._machine(rank, i) for rank, i in enumerate(ids)]
        self.state = AllocationState.READY

    def search(self) -> list[Candidate]:
        types = data(self.api.call("GET", "/instance-types", "list instance types")) or {}
        return candidates(dict(types), self.spec, self.settings)

    def _affordable(self, found: list[Candidate]) -> list[Candidate]:
        spec = self.spec
        cap = spec.max_node_hourly_cost
        cheap = [c for c in found if cap is None or c.hourly <= cap]
        if found and not cheap:
            raise ProvisionError(
                f"every Lambda instance type with {spec.accelerator} costs more than "
                f"max_node_hourly_cost=${cap:.2f}/h a node: nothing was rented",
                cause=ProvisionCause.CAPACITY,
            )
        nodes = max(1, spec.nodes)  # an elastic pool (nodes 0): its first node
        if cheap:
            over_budget(
                cheap[0].hourly * nodes,
                spec.max_hourly_cost,
                f"the cheapest Lambda instances for {nodes} node(s) cost",
            )
        return cheap

    def _register_key(self) -> None:
        assert self.login_key is not None
        with self.creating("ssh key", self.key_name):
            reply = self.api.call(
                "POST",
                "/ssh-keys",
                "register the pool's SSH key",
                {"name": self.key_name, "public_key": self.login_key.public},
            )
        self.ssh_key_id = str((data(reply) or {}).get("id") or "")

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

    def _wait_active(self, ids: list[str]) -> None:
        deadline = time.monotonic() + self.spec.options.start_timeout
        waiting = set(ids)

        def step() -> bool:
            rows = data(self.api.call("GET", "/instances", "list the pool's instances")) or []
            listed = {str(r.get("id")): r for r in rows}
            for i in list(waiting):
                row = listed.get(i)
                if row is None or row.get("status") == "terminated":
                    raise ProvisionError(
                        f"Lambda instance {i} ended while starting", cause=ProvisionCause.NODE
                    )
                self.instances[i].update(row)
                if row.get("status") == "active" and row.get("ip"):
                    waiting.discard(i)
            return not waiting

        self.poll(
            step,
            deadline,
            lambda: (
                f"Lambda instances {', '.join(sorted(waiting))} not active within "
                f"{self.spec.options.start_timeout:g} s; Options(start_timeout=...) sets the limit"
            ),
            POLL,
        )
        for i in ids:
            row = self.instances[i]
            pin(self.known_hosts, str(row["ip"]), row["host_key"])

    def create_one(self, rank: int) -> str:
        """One instance, in the region of the pool's instances (their private network),
        any region when it has none; the types and regions with room asked again."""
        with self._launching:
            self._candidates = self._affordable(self.search())
            regions = {
                str((self.instances[i].get("region") or {}).get("name") or "")
                for i in list(self.costs)
            }
            (ident,), _ = self._launch(1, min(regions) if regions else None)
        return ident

    def wait_one(self, ident: str) -> None:
        self._wait_active([ident])

    def machine_of(self, rank: int, ident: str) -> Machine:
        return self._machine(rank, ident)

    def _machine(self, rank: int, ident: str) -> Machine:
        row = self.instances[ident]
        return Machine(rank, f"lambda-{ident}", str(row.get("private_ip") or row["ip"]), ident)

    # -- agents ------------------------------------------------------------------------
    def target(self, machine: Machine) -> Target:
        return Target(str(self.instances[machine.ident]["ip"]), self.settings.ssh_user, 22)

    async def start_agent(self, machine: Machine) -> Any:
        agent = await super().start_agent(machine)
        login.remember(self.folder, machine.address, self.target(machine))
        return agent

    def agent_env(self, machine: Machine) -> dict[str, str]:
        """``FLOTILLA_CLOUD``: the watchdog terminates the instance ``ttl`` s after the
        client's last contact (its terminate script, see :func:`terminate_script`)."""
        settings = {
            "contact": contact_path(self.settings.workdir, GUARD_ID),
            "ttl": self.settings.ttl,
            "poweroff": POWEROFF,
            "imds": "",
        }
        return {CLOUD_ENV: json.dumps(settings)}

    # -- release -----------------------------------------------------------------------
    def end_one(self, ident: str) -> None:
        self._terminate([ident])

    def _terminate(self, ids: list[str]) -> None:
        if ids:
            self.api.call(
                "POST",
                "/instance-operations/terminate",
                "terminate instances",
                {"instance_ids": ids},
            )

    def sweep(self) -> None:
        """Terminate every instance of the pool (also those the API lists with its name:
        a launch whose answer was lost) and delete its SSH key; remove the local folder."""
        try:
            ids = set(self.instances)
            with contextlib.suppress(ProvisionError):
                rows = data(self.api.call("GET", "/instances", "list the pool's instances"))
                live = [row for row in rows or [] if row.get("status") != "terminated"]
                ids |= pool_ids(live, "name", self.spec.pool_id)
            errors = []
            try:
                self._terminate(sorted(ids))
            except ProvisionError as e:
                errors.append(str(e))
            try:
                delete_keys(self.api, {self.key_name}, self.ssh_key_id)
            except ProvisionError as e:
                errors.append(str(e))
            if errors:
                _show(
                    f"Lambda Cloud: could not release everything of pool "
                    f"{self.spec.pool_id}: {'; '.join(errors)}"
                )
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def delete_keys(api: RestApi, names: set[str], known: str = "") -> None:
    """Delete the SSH keys called ``names`` (and the one of id ``known``)."""
    ids = {known} if known else set()
    if names:
        for k in data(api.call("GET", "/ssh-keys", "list SSH keys")) or []:
            if str(k.get("name")) in names:
                ids.add(str(k.get("id")))
    for i in sorted(ids):
        try:
            api.call("DELETE", f"/ssh-keys/{i}", f"delete SSH key {i}")
        except ApiError as e:
            if e.status != 404:
                raise


def ssh_login(address: str) -> list[str]:
    """``ssh`` arguments that log in to the running instance whose peers' address is
    ``address`` as its pool does (``flotilla ssh``)."""
    return login.ssh_login(FOLDER_PREFIX, address, "Lambda Cloud")


def _show(message: str) -> None:
    show(logger, message)
