"""The Verda instances of one pool: create, reach, replace, delete (see ``provider``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import shlex
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._accelerators import offered_as, unknown_name
from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..._wire.protocol import CLOUD_ENV
from ..base import AllocationState, Machine, PoolSpec
from ..bootstrap import NoAnswer
from ..cloud import login
from ..cloud.allocation import CloudShell, cheapest, show
from ..cloud.guard import contact_path
from ..cloud.identity import client_id, pool_folder
from ..cloud.keys import KeyPair, keygen, pin
from ..cloud.market import LABEL_PREFIX, label, over_budget
from ..cloud.rest import ApiError
from ..offers import Offer
from ..ssh_shell import Target
from .api import VerdaApi
from .settings import VerdaSettings
from .stopstart import VerdaStopping

logger = logging.getLogger("flotilla.verda")

FOLDER_PREFIX = "flotilla-verda-"
GUARD_ID = "flotilla"
"""The name the boot guard and the watchdog give the instance's contact file."""
TERMINATE = "/root/.flotilla-verda-terminate"
"""The root-only script with which an instance deletes itself."""
POLL = 0.3
ENDED = frozenset({"error", "discontinued", "deleted", "deleting", "offline"})
"""Statuses of an instance that will not become ``running``."""


@dataclass(frozen=True)
class Candidate:
    """An instance type that fits the pool, its prices and the locations with room now
    (on-demand and spot)."""

    name: str
    gpus: str
    count: int
    hourly: float
    spot_hourly: float | None
    locations: tuple[str, ...]
    spot_locations: tuple[str, ...]


def _where(availability: Any) -> dict[str, set[str]]:
    """instance type -> the locations listing it as available."""
    out: dict[str, set[str]] = {}
    for row in availability or []:
        for name in row.get("availabilities") or []:
            out.setdefault(str(name), set()).add(str(row.get("location_code")))
    return out


def _price(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _ordered(found: set[str], first: str | None) -> tuple[str, ...]:
    return tuple(sorted(found, key=lambda loc: (loc != first, loc)))


def candidates(
    types: Any, on_demand: Any, spot: Any, spec: PoolSpec, settings: VerdaSettings
) -> list[Candidate]:
    """The instance types that have the pool's accelerator (count included), cheapest
    first, with the locations listing them (``settings.region`` first); ConfigurationError
    naming the nearest when none has it."""
    acc = spec.accelerator
    demand_at, spot_at = _where(on_demand), _where(spot)
    out = []
    for t in types or []:
        name = str(t.get("instance_type"))
        gpu = t.get("gpu") or {}
        gpus = int(gpu.get("number_of_gpus") or 0)
        described = str(gpu.get("description") or "")
        if settings.instance_type is not None and name != settings.instance_type:
            continue
        if acc is not None and (gpus != acc.count or not offered_as(acc, described, "verda")):
            continue
        if acc is None and settings.instance_type is None and gpus == 0:
            continue
        out.append(
            Candidate(
                name,
                described.split("x ", 1)[-1] if described else name,
                gpus,
                _price(t.get("price_per_hour")) or 0.0,
                _price(t.get("spot_price")),
                _ordered(demand_at.get(name, set()), settings.region),
                _ordered(spot_at.get(name, set()), settings.region),
            )
        )
    if not out and acc is not None:
        offered = sorted(
            f"{t.get('instance_type')} ({(t.get('gpu') or {}).get('description')})"
            for t in types or []
        )
        raise ConfigurationError(
            unknown_name(
                f"{acc.name}:{acc.count:g}" if acc.count != 1 else acc.name,
                "Verda",
                {"verda": offered},
            )
        )
    return sorted(out, key=lambda c: (c.hourly, c.name))


def as_offers(c: Candidate) -> list[Offer]:
    rows = [
        Offer("verda", c.gpus, c.count, c.hourly, loc, False, c.name, None)
        for loc in c.locations or ("(no capacity now)",)
    ]
    if c.spot_hourly is not None:
        rows += [
            Offer("verda", c.gpus, c.count, c.spot_hourly, loc, True, c.name, None)
            for loc in c.spot_locations
        ]
    return rows


def terminate_script(url: str, client: str, secret: str) -> str:
    """The instance's own delete script: it gets a token with the ttl client
    credentials, finds itself among the account's instances by its addresses (``hostname
    -I``) and deletes that one; tried 8 times over about 4 minutes."""
    python = (
        "import json,subprocess,time,urllib.request as u\n"
        f"URL={json.dumps(url)};CID={json.dumps(client)};SEC={json.dumps(secret)}\n"
        "def call(m,p,b=None,t=None):\n"
        ' h={"Content-Type":"application/json"}\n'
        ' if t:h["Authorization"]="Bearer "+t\n'
        " d=json.dumps(b).encode() if b is not None else None\n"
        " r=u.urlopen(u.Request(URL+p,data=d,method=m,headers=h),timeout=10).read()\n"
        " return json.loads(r) if r else None\n"
        'mine=set(subprocess.run(["hostname","-I"],capture_output=True,text=True).stdout.split())\n'
        "for n in range(8):\n"
        " try:\n"
        '  t=call("POST","/oauth2/token",{"grant_type":"client_credentials",'
        '"client_id":CID,"client_secret":SEC})["access_token"]\n'
        '  ids=[r["id"] for r in call("GET","/instances",t=t) if r.get("ip") in mine]\n'
        '  call("PUT","/instances",{"id":ids,"action":"delete"},t)\n'
        '  print("deleted",ids,flush=True);break\n'
        " except Exception as x:\n"
        '  print("failed:",x,flush=True);time.sleep(2**n)\n'
    )
    return (
        f"cat > {TERMINATE} <<'FLOTILLA_TERMINATE'\n"
        f"exec >>{TERMINATE}.log 2>&1 </dev/null\n"
        f"exec python3 -c '{python}'\n"
        "FLOTILLA_TERMINATE\n"
        f"chmod 700 {TERMINATE}\n"
    )


POWEROFF = [
    "sh",
    "-c",
    f'if [ "$(id -u)" = 0 ]; then exec sh {TERMINATE}; else exec sudo -n sh {TERMINATE}; fi',
]
"""What the watchdog and the guard run when the client is gone: the delete script (as
root: the login user through sudo)."""


def startup_script(
    pool_id: str, host_key: KeyPair, login_key: KeyPair, user: str, more: str
) -> str:
    """The instance's startup script (Verda runs it as root at the first boot): the pool's
    host key as the only one, the login key authorized for ``user``, then ``more`` (the
    delete script and the guard); sshd restarted where systemd runs it."""
    private = host_key.private().strip()
    public = " ".join(host_key.public.split()[:2])
    home = "/root" if user == "root" else f"~{user}"
    return f"""#!/bin/sh
# flotilla pool {pool_id}: the pinned SSH host key, the login key and the guard (see
# flotilla's _providers/verda/pool.py)
umask 077
mkdir -p /etc/ssh
rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub
cat > /etc/ssh/ssh_host_ed25519_key <<'FLOTILLA_HOST_KEY'
{private}
FLOTILLA_HOST_KEY
echo '{public} flotilla-{pool_id}' > /etc/ssh/ssh_host_ed25519_key.pub
chmod 600 /etc/ssh/ssh_host_ed25519_key
mkdir -p {home}/.ssh
echo {shlex.quote(login_key.public)} >> {home}/.ssh/authorized_keys
chown -R {user} {home}/.ssh 2>/dev/null || true
{more}
if [ -d /run/systemd/system ]; then
  systemctl restart ssh 2>/dev/null || systemctl restart sshd 2>/dev/null || true
fi
"""


OTHER_KEY = ("REMOTE HOST IDENTIFICATION HAS CHANGED", "Host key verification failed")
"""What ssh says when the instance presents another host key than the pinned one."""


class VerdaShell(CloudShell):
    """``ssh`` to a Verda instance, its host key pinned. Verda runs the startup script
    that installs the pool's host key some time after the image's sshd may have started
    with a key of its own: another key is refused (never trusted) but tried again, as a
    booting instance, until the start timeout; then the instance is REFUSED."""

    def transient(self, failure: NoAnswer) -> bool:
        return super().transient(failure) or any(m in failure.stderr for m in OTHER_KEY)


class VerdaAllocation(VerdaStopping):
    """The Verda instances of one pool (a named cluster's can be shut down and started
    again: ``stopstart``).

    Attributes:
        instances: instance id -> its last description.
        ssh_key_id: the pool's login key registered with Verda ("" before).
        scripts: the startup scripts made for the pool (deleted once its instances run).
    """

    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=8, thread_name_prefix="flotilla-verda"
    )
    handover = "installed by its startup script"
    shell_type = VerdaShell

    def __init__(
        self,
        settings: VerdaSettings,
        api: VerdaApi,
        ttl_credentials: tuple[str, str],
        spec: PoolSpec,
    ) -> None:
        super().__init__(spec, [])
        self.state = AllocationState.ACQUIRING
        self.settings = settings
        self.api = api
        self.ttl_credentials = ttl_credentials
        self.instances: dict[str, dict[str, Any]] = {}
        self.ssh_key_id = ""
        self.scripts: list[str] = []
        self._open(settings, pool_folder(FOLDER_PREFIX, spec.pool_id))
        self.label = label(spec.pool_id, client_id())
        self.key_name = f"flotilla-{spec.pool_id}"
        self._candidates: list[Candidate] = []
        self._keys = 0
        self._host_keys: dict[str, KeyPair] = {}  # startup script id -> its host key
        self._launching = threading.Lock()  # one launch at a time: scripts, locations

    # -- launch ------------------------------------------------------------------------
    async def launch(self) -> None:
        await self._make_login_key()
        self._candidates = self._affordable(await self._in_thread(self.search))
        await self._in_thread(self._register_key)
        if self.starts_empty(logger, "Verda", "instance(s)", cheapest(self._candidates)):
            return
        ids, where = await self._in_thread(self._launch, self.spec.nodes, None)
        _show(f"Verda: {len(ids)} instance(s) in {where}: {', '.join(ids)}")
        await self._in_thread(self._wait_running, ids)
        self.machines = [self._machine(rank, i) for rank, i in enumerate(ids)]
        self.state = AllocationState.READY

    def search(self) -> list[Candidate]:
        types = self.api.call("GET", "/instance-types", "list instance types", query=_USD)
        demand = self.api.call(
            "GET", "/instance-availability", "list availability", query={"isSpot": "false"}
        )
        spot: Any = []
        if self.settings.allocation != "on-demand":
            spot = self.api.call(
                "GET", "/instance-availability", "list spot availability", query={"isSpot": "true"}
            )
        return candidates(types, demand, spot, self.spec, self.settings)

    def _price(self, c: Candidate, spot: bool) -> float:
        return (c.spot_hourly or c.hourly) if spot else c.hourly

    def _plan(self) -> list[tuple[Candidate, str, bool]]:
        """(type, location, spot) to try, in order: the allocation's market(s), each type
        (cheapest first) in each location listing it."""
        markets = {"on-demand": (False,), "spot": (True,), "spot-if-available": (True, False)}
        out = []
        for spot in markets[self.settings.allocation]:
            for c in self._candidates:
                for loc in c.spot_locations if spot else c.locations:
                    out.append((c, loc, spot))
        return out

    def _affordable(self, found: list[Candidate]) -> list[Candidate]:
        spec = self.spec
        cap = spec.max_node_hourly_cost
        spot = self.settings.allocation == "spot"
        cheap = [c for c in found if cap is None or self._price(c, spot) <= cap]
        if found and not cheap:
            raise ProvisionError(
                f"every Verda instance type with {spec.accelerator} costs more than "
                f"max_node_hourly_cost=${cap:.2f}/h a node: nothing was rented",
                cause=ProvisionCause.CAPACITY,
            )
        nodes = max(1, spec.nodes)  # an elastic pool (nodes 0): its first node
        if cheap:
            over_budget(
                min(self._price(c, spot) for c in cheap) * nodes,
                spec.max_hourly_cost,
                f"the cheapest Verda instances for {nodes} node(s) cost",
            )
        return cheap

    def _register_key(self) -> None:
        assert self.login_key is not None
        with self.creating("ssh key", self.key_name):
            reply = self.api.call(
                "POST",
                "/sshkeys",
                "register the pool's SSH key",
                {"name": self.key_name, "key": self.login_key.public},
            )
        self.ssh_key_id = str(reply.get("id") if isinstance(reply, dict) else reply)

    def _script(self) -> str:
        """A new startup script (a new host key) for one launch; its id."""
        assert self.login_key is not None
        self._keys += 1
        host_key = keygen(self.folder, f"host_key_{self._keys}", f"flotilla-{self.spec.pool_id}")
        more = (
            terminate_script(self.api.url, *self.ttl_credentials)
            + f"INSTANCE_ID={GUARD_ID}; {self.guard(POWEROFF)}"
        )
        text = startup_script(
            self.spec.pool_id, host_key, self.login_key, self.settings.ssh_user, more
        )
        name = f"{self.key_name}-{self._keys}"
        with self.creating("startup script", name):
            reply = self.api.call(
                "POST", "/scripts", "create the startup script", {"name": name, "script": text}
            )
        ident = str(reply.get("id") if isinstance(reply, dict) else reply)
        self.scripts.append(ident)
        self._host_keys[ident] = host_key
        return ident

    def _image(self, c: Candidate) -> str:
        if self.settings.image is not None:
            return str(self.settings.image)
        return f"ubuntu-24.04-cuda-{self.settings.cuda}-open" if c.count else "ubuntu-24.04"

    def _launch(self, count: int, where: str | None) -> tuple[list[str], str]:
        """``count`` instances at the first (type, location, market) with room for all of
        them (in ``where`` only when given: a replacement joins its pool's location); what
        a location without room for all took is deleted before the next is tried."""
        script = self._script()
        tried = []
        for c, loc, spot in self._plan():
            if where is not None and loc != where:
                continue
            made: list[str] = []
            try:
                for _ in range(count):
                    made.append(self._create(c, loc, spot, script))
            except ApiError as e:
                if e.cause is not ProvisionCause.CAPACITY:
                    raise
                tried.append(f"{c.name}{' (spot)' if spot else ''} in {loc}")
                self.tell(logger, f"Verda: no capacity for {count} x {c.name} in {loc}")
                self._delete(made)
                continue
            return made, loc
        raise ProvisionError(
            f"Verda has no capacity for {count} x {self.spec.accelerator or 'an instance'} now"
            f" (tried {'; '.join(tried) or 'no location listing it as available'})",
            cause=ProvisionCause.CAPACITY,
        )

    def _create(self, c: Candidate, loc: str, spot: bool, script: str) -> str:
        n = len(self.instances) + 1
        body = {
            "instance_type": c.name,
            "image": self._image(c),
            "ssh_key_ids": [self.ssh_key_id],
            "startup_script_id": script,
            "hostname": f"flotilla-{self.spec.pool_id}-{n}",
            "description": self.label,
            "location_code": loc,
            "is_spot": spot,
            "volumes": [],
            "existing_volumes": [],
        }
        with self.creating("instance", self.label):
            reply = self.api.call("POST", "/instances", f"create {c.name} in {loc}", body)
        ident = str(reply.get("id") if isinstance(reply, dict) else reply)
        price = self._price(c, spot)
        self.spot = self.spot or spot  # (never shut down: ``stopstart``)
        self.instances[ident] = {
            "id": ident,
            "host_key": self._host_keys[script],
            "script": script,
            "location": loc,
        }
        self.billed(ident, price)
        return ident

    def _wait_running(self, ids: list[str]) -> None:
        deadline = time.monotonic() + self.spec.options.start_timeout
        waiting = set(ids)

        def step() -> bool:
            rows = self.api.call("GET", "/instances", "list the pool's instances") or []
            listed = {str(r.get("id")): r for r in rows}
            for i in list(waiting):
                row = listed.get(i)
                if row is None or row.get("status") in ENDED:
                    raise ProvisionError(
                        f"Verda instance {i} ended while starting "
                        f"({(row or {}).get('status', 'gone')})",
                        cause=ProvisionCause.NODE,
                    )
                self.instances[i].update(row)
                if row.get("status") == "running" and row.get("ip"):
                    waiting.discard(i)
            return not waiting

        self.poll(
            step,
            deadline,
            lambda: (
                f"Verda instances {', '.join(sorted(waiting))} not running within "
                f"{self.spec.options.start_timeout:g} s; Options(start_timeout=...) sets the limit"
            ),
            POLL,
        )
        for i in ids:
            row = self.instances[i]
            pin(self.known_hosts, str(row["ip"]), row["host_key"])
        # they hold the host key: not kept at Verda once used (another launch's stay)
        self._delete_scripts({str(self.instances[i]["script"]) for i in ids})

    def create_one(self, rank: int) -> str:
        """One instance, in the location of the pool's instances, any location while it
        has none; the types and locations available asked again."""
        with self._launching:
            self._candidates = self._affordable(self.search())
            where = {str(self.instances[i].get("location")) for i in list(self.costs)}
            (ident,), _ = self._launch(1, min(where) if where else None)
        return ident

    def wait_one(self, ident: str) -> None:
        self._wait_running([ident])

    def end_one(self, ident: str) -> None:
        self._delete([ident])

    def machine_of(self, rank: int, ident: str) -> Machine:
        return self._machine(rank, ident)

    def _machine(self, rank: int, ident: str) -> Machine:
        return Machine(rank, f"verda-{ident[:8]}", str(self.instances[ident]["ip"]), ident)

    # -- agents ------------------------------------------------------------------------
    def target(self, machine: Machine) -> Target:
        return Target(str(self.instances[machine.ident]["ip"]), self.settings.ssh_user, 22)

    async def start_agent(self, machine: Machine) -> Any:
        agent = await super().start_agent(machine)
        login.remember(self.folder, machine.address, self.target(machine))
        return agent

    def agent_env(self, machine: Machine) -> dict[str, str]:
        """``FLOTILLA_CLOUD``: the watchdog deletes the instance ``ttl`` s after the
        client's last contact (its delete script, see :func:`terminate_script`)."""
        settings = {
            "contact": contact_path(self.settings.workdir, GUARD_ID),
            "ttl": self.settings.ttl,
            "poweroff": POWEROFF,
            "imds": "",
        }
        return {CLOUD_ENV: json.dumps(settings)}

    # -- release -----------------------------------------------------------------------
    def _delete(self, ids: list[str]) -> None:
        if ids:
            self.api.call(
                "PUT", "/instances", "delete instances", {"id": list(ids), "action": "delete"}
            )

    def _delete_scripts(self, only: set[str] | None = None) -> None:
        """Delete the pool's startup scripts (``only`` those)."""
        for ident in [i for i in self.scripts if only is None or i in only]:
            with contextlib.suppress(ValueError):  # (another thread's already)
                self.scripts.remove(ident)
            try:
                self.api.call("DELETE", f"/scripts/{ident}", "delete the startup script")
            except ApiError as e:
                if e.status != 404:
                    raise

    def sweep(self) -> None:
        """Delete every instance of the pool (also those the API lists with its label: a
        create whose answer was lost), its startup scripts and SSH key; remove the local
        folder."""
        try:
            if self.kept_at_release():
                return
            ids = set(self.instances)
            with contextlib.suppress(ProvisionError):
                rows = self.api.call("GET", "/instances", "list the pool's instances")
                for row in rows or []:
                    mine = str(row.get("description", "")).startswith(
                        f"{LABEL_PREFIX}{self.spec.pool_id}:"
                    )
                    if mine and row.get("status") not in ("deleted", "deleting"):
                        ids.add(str(row["id"]))
            errors = []
            steps: list[Callable[[], None]] = [
                lambda: self._delete(sorted(ids)),
                self._delete_scripts,
                lambda: delete_keys(self.api, {self.key_name}, self.ssh_key_id),
            ]
            for step in steps:
                try:
                    step()
                except ProvisionError as e:
                    errors.append(str(e))
            if errors:
                _show(
                    f"Verda: could not release everything of pool "
                    f"{self.spec.pool_id}: {'; '.join(errors)}"
                )
            else:
                self.forget_kept()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


_USD = {"currency": "usd"}


def delete_keys(api: VerdaApi, names: set[str], known: str = "") -> None:
    """Delete the SSH keys called ``names`` (and the one of id ``known``)."""
    ids = {known} if known else set()
    if names:
        for k in api.call("GET", "/sshkeys", "list SSH keys") or []:
            if str(k.get("name")) in names:
                ids.add(str(k.get("id")))
    for i in sorted(ids):
        try:
            api.call("DELETE", f"/sshkeys/{i}", f"delete SSH key {i}")
        except ApiError as e:
            if e.status != 404:
                raise


def delete_scripts(api: VerdaApi, pools: set[str]) -> None:
    """Delete the startup scripts of ``pools`` (named ``flotilla-{pool}-{n}``)."""
    for s in api.call("GET", "/scripts", "list startup scripts") or []:
        name = str(s.get("name"))
        if any(name.startswith(f"flotilla-{p}-") for p in pools):
            with contextlib.suppress(ApiError):
                api.call("DELETE", f"/scripts/{s.get('id')}", "delete a startup script")


def ssh_login(address: str) -> list[str]:
    """``ssh`` arguments that log in to the running instance at ``address`` as its pool
    does (``flotilla ssh``)."""
    return login.ssh_login(FOLDER_PREFIX, address, "Verda")


def _show(message: str) -> None:
    show(logger, message)
