"""A Vast.ai marketplace on this machine: a stand-in for its REST API whose instances boot.

No emulator of Vast's API exists, so this is a small one, serving the endpoints, request
bodies and response fields the official client ``vastai`` uses (``vast-ai/vast-python``,
``vast.py`` at b25bd95; the overlay commands from the newer CLI, ``vast_cli/commands/
clusters.py``). Every route cites the lines it follows:

* base URL ``{url}/api/v0{path}`` and the key as ``Authorization: Bearer`` (or the
  ``api_key`` query argument): ``apiurl`` and ``apiheaders``, vast.py 367-420;
* ``POST /bundles/`` with a query ``{field: {op: value}}`` (ops eq, neq, gt, gte, lt, lte,
  in, notin: ``op_names`` 736-756), ``order``, ``type``, ``limit``, ``allocated_storage``;
  the default filters ``verified``/``external``/``rentable``/``rented``: ``search__offers``
  3021-3100; answer ``{"offers": [...]}`` with the fields ``displayable_fields`` 440-465
  shows (``id``, ``machine_id``, ``gpu_name``, ``num_gpus``, ``cpu_cores_effective``,
  ``cpu_ram`` in MB, ``disk_space``, ``dph_total``, ``reliability``, ``geolocation``) and
  ``cluster_id``, the physical cluster a machine is part of;
* ``PUT /asks/{id}/`` with ``client_id``, ``image``, ``disk``, ``label``, ``onstart``,
  ``runtype``...: ``create__instance`` 1545-1586; answer ``{"success": true,
  "new_contract": ID}`` (its docstring), or 400 ``{"success": false, "error":
  "no_such_ask", "msg": ...}`` when the offer is gone;
* ``GET /instances?owner=me`` -> ``{"instances": [...]}`` (``show__instances`` 3758-3762),
  ``GET /instances/{id}/?owner=me`` -> ``{"instances": {...}}`` (``show__instance`` 3732),
  with ``actual_status``, ``intended_status``, ``public_ipaddr``, ``ports["22/tcp"][0]
  ["HostPort"]`` (``ssh_url`` 3346-3352), ``ssh_host``/``ssh_port``, ``label``,
  ``dph_total``, ``start_date``, ``extra_env``;
* ``DELETE /instances/{id}/`` -> ``{"success": true}`` (``destroy_instance`` 1904-1915);
* ``POST /instances/{id}/ssh/`` with ``{"ssh_key": ...}`` (``attach__ssh`` 949-955);
* overlays: ``POST /overlay/`` ``{"cluster_id", "name"}``, ``PUT /overlay/`` ``{"name",
  "instance_id"}``, ``DELETE /overlay/`` ``{"overlay_name"}`` or ``{"overlay_id"}``,
  ``GET /overlay/`` -> ``[{"overlay_id", "name", "internal_subnet", "cluster_id",
  "instances"}]`` (``create__overlay``, ``join__overlay``, ``delete__overlay``,
  ``show__overlays`` of the newer CLI);
* a 429 is what the client retries (``http_get`` 173-182): ``VastLab.throttle`` answers
  the next requests with it; ``VastLab.failing`` answers the next requests of one route
  with a 500 (a server error, transient).

Inside an instance, as on Vast, ``CONTAINER_ID`` and ``CONTAINER_API_KEY`` are set for the
on-start script: a key valid only for that instance (reading and destroying it).

Instances: every machine has a public address on a test bridge; renting its offer makes
the instance there at once (a network-namespace host), and ``boot_delay`` s later runs the
on-start script (``/bin/sh -c``, as root, in the instance's own ``/etc/ssh`` and ``/run``)
and starts sshd, which listens ONLY on the public address and the instance's mapped port,
with whatever host key the script put in ``/etc/ssh/ssh_host_ed25519_key`` (a key of its
own otherwise) and the keys attached through the API; then the instance is "running".
Machines of one physical cluster can join an overlay network: a bridge of its own, on
which each instance that joins gets an address in the overlay's ``internal_subnet``.
Destroying an instance stops its host and everything in it; the machine's next offer has
a new id.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from _hosts import SSHD, LabError, TestHost, keygen, lab_unavailable, run
from _standin import SSHD_OPTIONS, JsonHandler, StandIn

API_KEY = "vast-test-key-0123456789abcdef"
"""The account's key the lab's tests use."""


@dataclass
class MachineSpec:
    """A machine offered on the lab's market (one offer: the whole machine)."""

    gpu_name: str = "A100 SXM4"
    num_gpus: int = 1
    cpu_cores_effective: float = 8.0
    cpu_ram: float = 64000.0  # MB, as Vast reports it
    disk_space: float = 200.0
    dph_total: float = 1.2
    reliability: float = 0.99
    geolocation: str = "US"
    cluster_id: int | None = None
    verified: bool = True


@dataclass
class LabMachine:
    machine_id: int
    spec: MachineSpec
    addr: str
    ask_id: int
    instance: int | None = None


@dataclass
class LabInstance:
    id: int
    machine: LabMachine
    label: str
    onstart: str
    image: str
    disk: float
    key: str  # CONTAINER_API_KEY
    port: int
    status: str = "loading"
    start_date: float = field(default_factory=time.time)
    attached: list[str] = field(default_factory=list)
    plugged: set[str] = field(default_factory=set)  # overlays it has an interface on
    host: TestHost | None = None
    stopped: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    booted_at: float = 0.0
    created_at: float = field(default_factory=time.monotonic)


@dataclass
class Overlay:
    overlay_id: int
    name: str
    cluster_id: int
    subnet: str  # "10.x.y" of its /24
    bridge: str
    members: dict[int, str] = field(default_factory=dict)  # instance id -> address


class VastLab(StandIn):
    """The stand-in API server and its machines (see the module docstring). A context
    manager; ``url`` and ``env`` (``VAST_URL``, ``VAST_API_KEY``) are what a client needs."""

    def __init__(self, boot_delay: float = 0.5) -> None:
        super().__init__(boot_delay)
        self.machines: list[LabMachine] = []
        self.instances: dict[int, LabInstance] = {}
        self.overlays: dict[str, Overlay] = {}
        self.throttle = 0
        self.failing: dict[tuple[str, str], int] = {}
        """(method, path under /api/v0) -> how many of the next such requests answer 500."""
        self.destroyed: dict[int, str] = {}  # instance id -> "account" | "self"
        self.destroyed_at: dict[int, float] = {}  # instance id -> wall clock
        self._ids = 1000
        self._overlay_count = 0
        self.impostor = False
        """Instances boot with a host key of their own, whatever the on-start script
        installed (someone in the middle)."""

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        self.lab.start()
        self.url = f"http://{self.addr}:{self.serve(_Handler, 'vast')}"
        self.set_env({"VAST_URL": self.url, "VAST_API_KEY": API_KEY})

    def close(self) -> None:
        for inst in list(self.instances.values()):
            self._stop(inst)
        for overlay in list(self.overlays.values()):
            run("ip", "link", "del", overlay.bridge, check=False)
        self.overlays.clear()
        self.shut()

    # -- the market ------------------------------------------------------------------
    def add_machines(self, count: int, **spec: Any) -> list[LabMachine]:
        """``count`` machines with the given :class:`MachineSpec` fields."""
        out = []
        with self._lock:
            for _ in range(count):
                index = len(self.machines)
                machine = LabMachine(
                    machine_id=5000 + index,
                    spec=MachineSpec(**spec),
                    addr=f"{self.lab.subnet}.{10 + index}",
                    ask_id=self._next_id(),
                )
                self.machines.append(machine)
                out.append(machine)
        return out

    def remove_offers(self) -> None:
        """Every machine not rented leaves the market."""
        with self._lock:
            self.machines = [m for m in self.machines if m.instance is not None]

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def live(self, which: str = "") -> list[LabInstance]:
        """The instances not destroyed (whose label starts with ``which``)."""
        with self._lock:
            return [i for i in self.instances.values() if i.label.startswith(which)]

    # -- instances -------------------------------------------------------------------
    def rent(self, ask_id: int, body: dict[str, Any]) -> LabInstance | None:
        with self._lock:
            machine = next(
                (m for m in self.machines if m.ask_id == ask_id and m.instance is None), None
            )
            if machine is None:
                return None
            inst = LabInstance(
                id=self._next_id(),
                machine=machine,
                label=str(body.get("label") or ""),
                onstart=str(body.get("onstart") or ""),
                image=str(body.get("image") or ""),
                disk=float(body.get("disk") or 10),
                key=secrets.token_hex(16),
                port=0,
            )
            inst.port = 40000 + inst.id % 20000
            machine.instance = inst.id
            self.instances[inst.id] = inst
        threading.Thread(target=self._life, args=(inst,), daemon=True).start()
        return inst

    def destroy(self, inst: LabInstance, by: str) -> None:
        with self._lock:
            if self.instances.pop(inst.id, None) is None:
                return
            self.destroyed[inst.id] = by
            self.destroyed_at[inst.id] = time.time()
            inst.machine.instance = None
            inst.machine.ask_id = self._next_id()
            for overlay in self.overlays.values():
                overlay.members.pop(inst.id, None)
        threading.Thread(target=self._stop, args=(inst,), daemon=True).start()

    def _life(self, inst: LabInstance) -> None:
        """The instance's network at once; ``boot_delay`` s later its on-start script,
        then sshd on the public address and mapped port; then "running"."""
        with inst.lock:
            if inst.stopped.is_set():
                return
            host = self.lab.new_host(inst.id, inst.machine.addr, f"C.{inst.id}")
            inst.host = host
            (host.folder / "etc-ssh").mkdir()
            (host.folder / "flotilla").mkdir()  # the container's /root/.flotilla: its own
            (host.folder / "authorized_keys").write_text("".join(k + "\n" for k in inst.attached))
            for overlay in self.overlays.values():
                if inst.id in overlay.members:
                    self._plug(inst, overlay)
        if inst.stopped.wait(max(0.0, inst.created_at + self.boot_delay - time.monotonic())):
            return
        with inst.lock:
            if inst.stopped.is_set():
                return
            self._onstart(inst)
            key = host.folder / "etc-ssh" / "ssh_host_ed25519_key"
            if self.impostor:
                key.unlink(missing_ok=True)
                key.with_suffix(".pub").unlink(missing_ok=True)
            if not key.exists():  # the image's own key
                keygen(key, f"C.{inst.id}")
            config = host.folder / "sshd_config"
            # the client reaches sshd only at the public address and mapped port; peers
            # on an overlay reach the container's port 22 at their overlay address
            overlay = "".join(
                f"ListenAddress {o.members[inst.id]}:22\n"
                for o in self.overlays.values()
                if o.name in inst.plugged and inst.id in o.members
            )
            config.write_text(
                f"ListenAddress {inst.machine.addr}:{inst.port}\n"
                + overlay
                + "HostKey /etc/ssh/ssh_host_ed25519_key\n"
                f"PidFile {host.folder}/sshd.pid\n"
                f"AuthorizedKeysFile {host.folder}/authorized_keys .ssh/authorized_keys\n"
                + SSHD_OPTIONS
            )
            self.lab.start_daemon(
                host,
                self._container(host) + f"exec {SSHD} -D -e -f {config}",
                "sshd.log",
            )
            inst.booted_at = time.monotonic()
            inst.status = "running"

    def _container(self, host: TestHost) -> str:
        """Shell lines that give a process the instance's own /etc/ssh, /root/.flotilla
        (flotilla's default workdir), /run and /dev/shm (the rest of the file system is
        this machine's)."""
        return (
            f"mount --bind {host.folder / 'etc-ssh'} /etc/ssh && "
            "mkdir -p /root/.flotilla && "
            f"mount --bind {host.folder / 'flotilla'} /root/.flotilla && "
            f"mount -t tmpfs -o mode=755 tmpfs /run && mkdir -p /run/sshd && "
            "mount -t tmpfs -o size=512m,mode=1777 tmpfs /dev/shm && "
        )

    def _onstart(self, inst: LabInstance) -> None:
        host = inst.host
        assert host is not None
        if not inst.onstart:
            return
        script = host.folder / "onstart.sh"
        script.write_text(inst.onstart)
        env = {
            "CONTAINER_ID": str(inst.id),
            "CONTAINER_API_KEY": inst.key,
            "PUBLIC_IPADDR": inst.machine.addr,
            "VAST_TCP_PORT_22": str(inst.port),
        }
        self.run_script(host, script, "onstart.log", env, self._container(host))

    def _stop(self, inst: LabInstance) -> None:
        inst.stopped.set()
        with inst.lock:
            self.stop_host(inst.host)
            inst.host = None

    def onstart_log(self, instance_id: int) -> str:
        with contextlib.suppress(OSError):
            return (self.lab.tmp / f"h{instance_id}" / "onstart.log").read_text(errors="replace")
        return ""

    def contact(self, instance_id: int) -> float:
        """When the instance's agent last heard from the client (its watchdog's contact
        file's mtime; 0: none)."""
        path = self.lab.tmp / f"h{instance_id}" / "flotilla" / "watchdog" / str(instance_id)
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    def watchdog_log(self, instance_id: int) -> str:
        """What the instance's watchdog (``_node/cloud.py``) and guard said."""
        folder = self.lab.tmp / f"h{instance_id}" / "flotilla" / "watchdog"
        out = []
        for path in sorted(folder.glob("*")) if folder.is_dir() else []:
            with contextlib.suppress(OSError):
                out.append(f"{path.name}: {path.read_text(errors='replace')}")
        destroy = folder.parent / "vast" / f"{instance_id}.destroy.log"
        with contextlib.suppress(OSError):
            out.append(f"{destroy.name}: {destroy.read_text(errors='replace')}")
        return "\n".join(out) + "\n" + self.onstart_log(instance_id)

    # -- overlays --------------------------------------------------------------------
    def create_overlay(self, cluster_id: int, name: str) -> str | None:
        with self._lock:
            if name in self.overlays:
                return f"overlay {name} already exists"
            if not any(m.spec.cluster_id == cluster_id for m in self.machines):
                return f"no cluster {cluster_id}"
            self._overlay_count += 1
            from _hosts import free_subnet

            subnet = free_subnet(os.getpid() + 7 * self._overlay_count + 31)
            bridge = f"flb{self.lab.tag}x{self._overlay_count}"[:15]  # as remove_stale_labs knows
            run("ip", "link", "add", bridge, "type", "bridge")
            run("ip", "link", "set", bridge, "up")
            self.overlays[name] = Overlay(
                self._next_id(), name, cluster_id, subnet, bridge, members={}
            )
        return None

    def join_overlay(self, name: str, inst: LabInstance) -> str | None:
        with self._lock:
            overlay = self.overlays.get(name)
            if overlay is None:
                return f"no overlay {name}"
            if inst.machine.spec.cluster_id != overlay.cluster_id:
                return (
                    f"instance {inst.id} is not on cluster {overlay.cluster_id}: it cannot "
                    "join this overlay"
                )
            taken = set(overlay.members.values())  # a destroyed member's address is free
            free = next(n for n in range(2, 255) if f"{overlay.subnet}.{n}" not in taken)
            overlay.members[inst.id] = f"{overlay.subnet}.{free}"
        with inst.lock:
            if inst.host is not None:
                self._plug(inst, overlay)
        return None

    def _plug(self, inst: LabInstance, overlay: Overlay) -> None:
        """The instance's interface on the overlay (once; under ``inst.lock``)."""
        host = inst.host
        assert host is not None
        if overlay.name in inst.plugged:
            return
        inst.plugged.add(overlay.name)
        veth = f"flv{self.lab.tag}x{inst.id * 10 + overlay.overlay_id % 10}"[-15:]
        self.plug(host, overlay.bridge, veth, "ovl0", overlay.members[inst.id])

    def delete_overlay(self, name: str) -> bool:
        with self._lock:
            overlay = self.overlays.pop(name, None)
        if overlay is None:
            return False
        run("ip", "link", "del", overlay.bridge, check=False)
        return True

    # -- JSON views ------------------------------------------------------------------
    def offer_json(self, m: LabMachine) -> dict[str, Any]:
        s = m.spec
        return {
            "id": m.ask_id,
            "ask_contract_id": m.ask_id,
            "machine_id": m.machine_id,
            "host_id": 900 + m.machine_id % 100,
            "gpu_name": s.gpu_name,
            "num_gpus": s.num_gpus,
            "cpu_cores_effective": s.cpu_cores_effective,
            "cpu_ram": s.cpu_ram,
            "disk_space": s.disk_space,
            "dph_total": s.dph_total,
            "reliability": s.reliability,
            "reliability2": s.reliability,
            "geolocation": s.geolocation,
            "cluster_id": s.cluster_id,
            "verified": s.verified,
            "external": False,
            "rentable": m.instance is None,
            "rented": m.instance is not None,
            "public_ipaddr": m.addr,
            "direct_port_count": 100,
        }

    def instance_json(self, inst: LabInstance) -> dict[str, Any]:
        s = inst.machine.spec
        running = inst.status == "running"
        return {
            "id": inst.id,
            "machine_id": inst.machine.machine_id,
            "actual_status": inst.status,
            "intended_status": "running",
            "cur_state": "running",
            "label": inst.label,
            "image_uuid": inst.image,
            "image_runtype": "ssh_direc ssh_proxy",
            "public_ipaddr": inst.machine.addr,
            "ssh_host": inst.machine.addr,
            "ssh_port": inst.port,
            "ports": {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(inst.port)}]}
            if running
            else {},
            "gpu_name": s.gpu_name,
            "num_gpus": s.num_gpus,
            "dph_total": s.dph_total,
            "geolocation": s.geolocation,
            "cluster_id": s.cluster_id,
            "start_date": inst.start_date,
            "disk_space": inst.disk,
            "extra_env": [],
        }


_OPS = {
    "eq": lambda a, b: a == b,
    "neq": lambda a, b: a != b,
    "gt": lambda a, b: a is not None and a > b,
    "gte": lambda a, b: a is not None and a >= b,
    "lt": lambda a, b: a is not None and a < b,
    "lte": lambda a, b: a is not None and a <= b,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
}


def _matches(offer: dict[str, Any], query: dict[str, Any]) -> bool:
    for name, cond in query.items():
        if not isinstance(cond, dict):
            continue
        for op, value in cond.items():
            if op not in _OPS:
                raise ValueError(f"unknown operator {op!r} for {name}")
            if not _OPS[op](offer.get(name), value):
                return False
    return True


class _Handler(JsonHandler):
    vast: VastLab

    def _body(self) -> Any:
        raw = self._raw()
        return json.loads(raw) if raw else {}

    def _serve(self, method: str) -> None:
        lab = self.vast
        path = urlparse(self.path).path
        lab.requests.append((method, path))
        body = self._body()
        if lab.throttle > 0:
            lab.throttle -= 1
            return self._send(429, {"success": False, "error": "too_many_requests"})
        with lab._lock:
            route = (method, path.removeprefix("/api/v0"))
            if lab.failing.get(route, 0) > 0:
                lab.failing[route] -= 1
                return self._send(500, {"success": False, "error": "server_error"})
        if not path.startswith("/api/v0/"):
            return self._send(404, {"success": False, "error": "not_found"})
        path = path[len("/api/v0") :]
        key = self._key()
        own = re.fullmatch(r"/instances/(\d+)/", path)
        if key != API_KEY:
            # a CONTAINER_API_KEY: its own instance only
            with lab._lock:
                inst = lab.instances.get(int(own[1])) if own else None
            if inst is None or inst.key != key or method not in ("GET", "DELETE"):
                return self._send(
                    401, {"success": False, "error": "invalid_api_key", "msg": "Invalid key"}
                )
            return self._instance(method, inst, "self")
        try:
            self._route(method, path, body)
        except (ValueError, KeyError, TypeError) as e:
            self._send(400, {"success": False, "error": "invalid_args", "msg": str(e)})

    def _instance(self, method: str, inst: LabInstance | None, by: str) -> None:
        if inst is None:
            return self._send(404, {"success": False, "error": "no_such_instance"})
        if method == "GET":
            return self._send(200, {"instances": self.vast.instance_json(inst)})
        self.vast.destroy(inst, by)
        return self._send(200, {"success": True})

    def _route(self, method: str, path: str, body: Any) -> None:
        lab = self.vast
        if method == "POST" and path == "/bundles/":
            query = dict(body)
            order = query.pop("order", [])
            limit = query.pop("limit", None)
            kind = query.pop("type", "on-demand")
            query.pop("allocated_storage", None)
            query.pop("disable_bundling", None)
            if kind not in ("on-demand", "bid", "reserved"):
                raise ValueError(f"unknown type {kind!r}")
            with lab._lock:
                offers = [lab.offer_json(m) for m in lab.machines]
            offers = [o for o in offers if _matches(o, query)]
            for name, direction in reversed(order):
                offers.sort(
                    key=lambda o, n=name: (o.get(n) is None, o.get(n)), reverse=direction == "desc"
                )
            return self._send(200, {"offers": offers[: int(limit)] if limit else offers})
        ask = re.fullmatch(r"/asks/(\d+)/", path)
        if method == "PUT" and ask:
            inst = lab.rent(int(ask[1]), body)
            if inst is None:
                return self._send(
                    400,
                    {
                        "success": False,
                        "error": "no_such_ask",
                        "msg": f"Instance type by id {ask[1]} is not available.",
                    },
                )
            return self._send(200, {"success": True, "new_contract": inst.id})
        if method == "GET" and path in ("/instances", "/instances/"):
            with lab._lock:
                rows = [lab.instance_json(i) for i in lab.instances.values()]
            return self._send(200, {"instances": rows})
        one = re.fullmatch(r"/instances/(\d+)/", path)
        if one and method in ("GET", "DELETE"):
            with lab._lock:
                inst = lab.instances.get(int(one[1]))
            return self._instance(method, inst, "account")
        ssh = re.fullmatch(r"/instances/(\d+)/ssh/", path)
        if ssh and method == "POST":
            with lab._lock:
                inst = lab.instances.get(int(ssh[1]))
            if inst is None:
                return self._send(404, {"success": False, "error": "no_such_instance"})
            key = str(body["ssh_key"]).strip()
            with inst.lock:
                inst.attached.append(key)
                if inst.host is not None:
                    with open(inst.host.folder / "authorized_keys", "a") as f:
                        f.write(key + "\n")
            return self._send(200, {"success": True, "msg": "ssh key attached"})
        if path == "/overlay/":
            if method == "GET":
                with lab._lock:
                    rows = [
                        {
                            "overlay_id": o.overlay_id,
                            "name": o.name,
                            "internal_subnet": f"{o.subnet}.0/24",
                            "cluster_id": o.cluster_id,
                            "instances": sorted(o.members),
                        }
                        for o in lab.overlays.values()
                    ]
                return self._send(200, rows)
            if method == "POST":
                error = lab.create_overlay(int(body["cluster_id"]), str(body["name"]))
                if error:
                    return self._send(400, {"success": False, "msg": error})
                return self._send(200, {"success": True, "msg": "Overlay network created"})
            if method == "PUT":
                with lab._lock:
                    inst = lab.instances.get(int(body["instance_id"]))
                if inst is None:
                    return self._send(404, {"success": False, "msg": "no such instance"})
                error = lab.join_overlay(str(body["name"]), inst)
                if error:
                    return self._send(400, {"success": False, "msg": error})
                return self._send(200, {"success": True, "msg": "Instance joined overlay"})
            if method == "DELETE":
                name = body.get("overlay_name")
                if name is None:
                    with lab._lock:
                        name = next(
                            (
                                o.name
                                for o in lab.overlays.values()
                                if o.overlay_id == body.get("overlay_id")
                            ),
                            "",
                        )
                if not lab.delete_overlay(str(name)):
                    return self._send(404, {"success": False, "msg": "no such overlay"})
                return self._send(200, {"success": True, "msg": "Overlay deleted"})
        return self._send(404, {"success": False, "error": "not_found", "msg": path})


def vast_unavailable() -> str | None:
    return lab_unavailable()


@pytest.fixture(name="vast_lab")
def vast_lab_fixture() -> Iterator[VastLab]:
    """A fresh market per test (machines added by the test)."""
    yield from VastLab.running()


__all__ = ["API_KEY", "LabError", "Path", "VastLab", "vast_lab_fixture"]
