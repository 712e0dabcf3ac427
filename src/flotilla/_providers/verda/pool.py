"""The Verda instances of one pool: create, reach, replace, delete (see ``provider``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._errors import ProvisionCause, ProvisionError
from ..base import Machine, PoolSpec
from ..bootstrap import NoAnswer
from ..cloud import login
from ..cloud.allocation import GUARD_ID, CloudShell, SelfEnding, as_root, show
from ..cloud.keys import KeyPair, host_key_script, keygen
from ..cloud.market import fits, unoffered
from ..cloud.rest import ApiError
from ..offers import Offer
from .api import VerdaApi
from .settings import VerdaSettings
from .stopstart import VerdaStopping

logger = logging.getLogger("flotilla.verda")

FOLDER_PREFIX = "flotilla-verda-"
TERMINATE = "/root/.flotilla-verda-terminate"
"""The root-only script with which an instance deletes itself."""
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
        if not fits(acc, settings.instance_type, name, gpus, described, "verda"):
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
        raise unoffered(acc, "Verda", "verda", offered)
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


POWEROFF = as_root(TERMINATE)
"""What the watchdog and the guard run when the client is gone: the delete script."""


def startup_script(
    pool_id: str, host_key: KeyPair, login_key: KeyPair, user: str, more: str
) -> str:
    """The instance's startup script (Verda runs it as root at the first boot): the pool's
    host key as the only one, the login key authorized for ``user``, then ``more`` (the
    delete script and the guard); sshd restarted where systemd runs it."""
    home = "/root" if user == "root" else f"~{user}"
    return f"""#!/bin/sh
# flotilla pool {pool_id}: the pinned SSH host key, the login key and the guard (see
# flotilla's _providers/verda/pool.py)
{host_key_script(host_key, pool_id)}mkdir -p {home}/.ssh
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


class VerdaAllocation(VerdaStopping, SelfEnding):
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
    cloud = "Verda"
    poweroff = POWEROFF
    label_key = "description"
    cloud_log = logger
    key_path = "/sshkeys"
    key_field = "key"
    noun = "Verda"
    running = "running"
    ended = ENDED
    gone = frozenset({"deleted", "deleting"})
    show_status = True
    folder_prefix = FOLDER_PREFIX
    settings: VerdaSettings
    api: VerdaApi
    _candidates: list[Candidate]

    def __init__(
        self,
        settings: VerdaSettings,
        api: VerdaApi,
        ttl_credentials: tuple[str, str],
        spec: PoolSpec,
    ) -> None:
        super().__init__(settings, api, spec)
        self.ttl_credentials = ttl_credentials
        self.scripts: list[str] = []
        self._keys = 0
        self._host_keys: dict[str, KeyPair] = {}  # startup script id -> its host key

    # -- launch ------------------------------------------------------------------------
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

    def price(self, kind: Candidate) -> float:
        return self._price(kind, self.settings.allocation == "spot")

    def answer_id(self, reply: Any) -> str:
        return str(reply.get("id") if isinstance(reply, dict) else reply)

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
        ident = self.answer_id(reply)
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
                self.end(made)
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
        ident = self.answer_id(reply)
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

    def wait_running(self, ids: list[str]) -> None:
        super().wait_running(ids)
        # they hold the host key: not kept at Verda once used (another launch's stay)
        self._delete_scripts({str(self.instances[i]["script"]) for i in ids})

    def _machine(self, rank: int, ident: str) -> Machine:
        return Machine(rank, f"verda-{ident[:8]}", str(self.instances[ident]["ip"]), ident)

    # -- release -----------------------------------------------------------------------
    def end(self, ids: list[str]) -> None:
        if ids:
            self.api.call(
                "PUT", "/instances", "delete instances", {"id": list(ids), "action": "delete"}
            )

    def _delete_scripts(self, only: set[str] | None = None) -> None:
        """Delete the pool's startup scripts (``only`` those)."""
        for ident in [i for i in self.scripts if only is None or i in only]:
            with contextlib.suppress(ValueError):  # (another thread's already)
                self.scripts.remove(ident)
            self.api.delete(f"/scripts/{ident}", "delete the startup script")

    def rows(self) -> list[dict[str, Any]]:
        return self.api.call("GET", "/instances", "list the pool's instances") or []

    def leftovers(self) -> list[Callable[[], None]]:
        return [
            self._delete_scripts,
            lambda: delete_keys(self.api, {self.key_name}, self.ssh_key_id),
        ]


_USD = {"currency": "usd"}


def delete_keys(api: VerdaApi, names: set[str], known: str = "") -> None:
    """Delete the SSH keys called ``names`` (and the one of id ``known``)."""
    ids = {known} if known else set()
    if names:
        for k in api.call("GET", "/sshkeys", "list SSH keys") or []:
            if str(k.get("name")) in names:
                ids.add(str(k.get("id")))
    for i in sorted(ids):
        api.delete(f"/sshkeys/{i}", f"delete SSH key {i}")


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
