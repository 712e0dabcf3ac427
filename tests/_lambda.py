"""A Lambda Cloud on this machine: a stand-in for its REST API (``/api/v1``) whose instances
boot.

No emulator of Lambda's API exists, so this is a small one, serving the calls, bodies and
answers of Lambda's published OpenAPI specification (the API reference at
``cloud.lambda.ai/api/v1/docs``):

* the key as ``Authorization: Bearer KEY`` or HTTP Basic with the key as the user name;
  a wrong one: 401 ``{"error": {"code": "global/invalid-api-key", "message": ...}}``;
* ``GET /instance-types`` -> ``{"data": {NAME: {"instance_type": {"name", "description",
  "gpu_description", "price_cents_per_hour", "specs": {"vcpus", "memory_gib",
  "storage_gib", "gpus"}}, "regions_with_capacity_available": [{"name",
  "description"}]}}}``;
* ``POST /instance-operations/launch`` (``region_name``, ``instance_type_name``,
  ``ssh_key_names``, ``file_system_names``, ``quantity``, ``name``, ``user_data``) ->
  ``{"data": {"instance_ids": [...]}}``; no room: 400 ``{"error": {"code":
  "instance-operations/launch/insufficient-capacity", "message": "Not enough capacity to
  fulfill launch request."}}``;
* ``GET /instances`` -> ``{"data": [...]}``, ``GET /instances/{id}`` -> ``{"data": {...}}``
  (``id name ip private_ip status region{name} instance_type{name} ssh_key_names
  hostname``); ``status`` ``booting`` then ``active``;
* ``POST /instance-operations/terminate`` (``instance_ids``) -> ``{"data":
  {"terminated_instances": [...]}}``;
* ``GET /ssh-keys``, ``POST /ssh-keys`` (``name``, ``public_key``), ``DELETE
  /ssh-keys/{id}``.

Instances: a network-namespace host at a public address (the lab bridge) and a private one
(a bridge per region: Lambda's private network); ``boot_delay`` s after the launch
cloud-init reads the user-data (``#cloud-config``: ``ssh_keys`` the host key,
``ssh_authorized_keys``, ``bootcmd`` run as root before sshd), then sshd listens ONLY on
the public address, port 22, with the account's named keys and the user-data's
authorized; the instance is then ``active``. Each instance has its own /root, /tmp and
/dev/shm, and an ``nvidia-smi`` listing its type's GPUs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shlex
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from _hosts import SSHD, TestHost, free_subnet, keygen
from _standin import PATH, SSHD_OPTIONS, JsonHandler, StandIn, nvidia_smi

API_KEY = "secret_lambda-test-key_0123456789abcdef"
NO_CAPACITY = "Not enough capacity to fulfill launch request."


@dataclass
class InstanceType:
    name: str
    gpu_description: str
    gpus: int
    price_cents: int
    capacity: dict[str, int] = field(default_factory=lambda: {"us-east-1": 4})
    listed: set[str] = field(default_factory=set)  # regions listed as having room anyway


@dataclass
class Instance:
    id: str
    name: str
    type: InstanceType
    region: str
    ip: str
    private_ip: str
    user_data: str
    keys: list[str]
    status: str = "booting"
    host: TestHost | None = None
    stopped: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    created_at: float = field(default_factory=time.monotonic)
    number: int = 0


class LambdaLab(StandIn):
    """The stand-in API server and its instances. A context manager; ``url`` and ``env``
    (``LAMBDA_API_URL``, ``LAMBDA_API_KEY``) are what a client needs."""

    def __init__(self, boot_delay: float = 0.5) -> None:
        super().__init__(boot_delay)
        self.types: dict[str, InstanceType] = {}
        self.instances: dict[str, Instance] = {}
        self.keys: dict[str, dict[str, str]] = {}  # id -> {id, name, public_key}
        self.launches: list[dict[str, Any]] = []
        self.terminated: dict[str, str] = {}  # id -> "account" | "self" (the key used)
        self.self_key = ""  # a key the test gives the instances (ttl_api_key)
        self._bridges: dict[str, tuple[str, str]] = {}  # region -> (bridge, subnet)
        self._count = 0

    def start(self) -> None:
        self.lab.start()
        self.url = f"http://{self.addr}:{self.serve(_Handler, 'cloud')}/api/v1"
        self.set_env({"LAMBDA_API_URL": self.url, "LAMBDA_API_KEY": API_KEY})

    def close(self) -> None:
        self.closing = True
        for inst in list(self.instances.values()):
            self._stop(inst)
        self._bridges.clear()
        self.shut()

    def add_type(self, name: str, gpu: str, gpus: int, cents: int, **fields: Any) -> InstanceType:
        with self._lock:
            t = InstanceType(name, gpu, gpus, cents, **fields)
            self.types[name] = t
        return t

    def live(self, which: str = "") -> list[Instance]:
        """The instances not terminated (whose name starts with ``which``)."""
        with self._lock:
            return [i for i in self.instances.values() if i.name.startswith(which)]

    def _bridge(self, region: str) -> tuple[str, str]:
        if region not in self._bridges:
            n = len(self._bridges)
            bridge = self.add_bridge(f"flb{self.lab.tag}r{n}"[:15])
            self._bridges[region] = (bridge, free_subnet(os.getpid() + 53 + 11 * n))
        return self._bridges[region]

    def launch(self, body: dict[str, Any]) -> list[Instance] | None:
        with self._lock:
            self.launches.append(body)
            t = self.types[str(body["instance_type_name"])]
            region = str(body["region_name"])
            quantity = int(body.get("quantity") or 1)
            if t.capacity.get(region, 0) < quantity:
                return None
            t.capacity[region] -= quantity
            bridge, subnet = self._bridge(region)
            names = set(body.get("ssh_key_names") or [])
            keys = [k["public_key"] for k in self.keys.values() if k["name"] in names]
            out = []
            for _ in range(quantity):
                self._count += 1
                n = self._count
                inst = Instance(
                    id=secrets.token_hex(16),
                    name=str(body.get("name") or ""),
                    type=t,
                    region=region,
                    ip=f"{self.lab.subnet}.{10 + n}",
                    private_ip=f"{subnet}.{10 + n}",
                    user_data=str(body.get("user_data") or ""),
                    keys=keys,
                    number=n,
                )
                self.instances[inst.id] = inst
                out.append(inst)
        for inst in out:
            threading.Thread(target=self._life, args=(inst, bridge), daemon=True).start()
        return out

    def terminate(self, inst: Instance, by: str) -> None:
        with self._lock:
            if self.instances.pop(inst.id, None) is None:
                return
            self.terminated[inst.id] = by
            inst.type.capacity[inst.region] = inst.type.capacity.get(inst.region, 0) + 1
        threading.Thread(target=self._stop, args=(inst,), daemon=True).start()

    def _life(self, inst: Instance, bridge: str) -> None:
        with inst.lock:
            if inst.stopped.is_set():
                return
            host = self.lab.new_host(inst.number, inst.ip, f"lambda-{inst.number}")
            inst.host = host
            veth = f"flv{self.lab.tag}l{inst.number}"[-15:]
            self.plug(host, bridge, veth, "priv0", inst.private_ip)
        if inst.stopped.wait(max(0.0, inst.created_at + self.boot_delay - time.monotonic())):
            return
        with inst.lock:
            if inst.stopped.is_set() or self.closing:
                return
            self._boot(inst, host)
            inst.status = "active"

    def _boot(self, inst: Instance, host: TestHost) -> None:
        """cloud-init (host key, authorized keys, bootcmd as root), then sshd."""
        config = (
            yaml.safe_load(inst.user_data) if inst.user_data.startswith("#cloud-config") else {}
        )
        config = config or {}
        keys = config.get("ssh_keys") or {}
        hostkey = host.folder / "hostkey"
        if keys.get("ed25519_private"):
            hostkey.write_text(keys["ed25519_private"])
            hostkey.chmod(0o600)
        else:  # the image's own key
            keygen(hostkey, inst.id)
        dot_ssh = host.home / ".ssh"
        dot_ssh.mkdir(parents=True, exist_ok=True, mode=0o700)
        authorized = [*inst.keys, *(config.get("ssh_authorized_keys") or [])]
        (host.folder / "authorized_keys").write_text("".join(k + "\n" for k in authorized))
        gpus = [f"NVIDIA {inst.type.gpu_description}"] * inst.type.gpus
        path = f"{nvidia_smi(host.folder, gpus, inst.id[:8])}:{PATH}"
        lines = [
            c if isinstance(c, str) else " ".join(shlex.quote(str(w)) for w in c)
            for c in config.get("bootcmd") or []
        ]
        (host.folder / "bootcmd.sh").write_text("".join(line + "\n" for line in lines))
        sshd_config = host.folder / "sshd_config"
        sshd_config.write_text(
            f"ListenAddress {inst.ip}:22\n"
            f"HostKey {hostkey}\n"
            f"PidFile {host.folder}/sshd.pid\n"
            f"AuthorizedKeysFile {host.folder}/authorized_keys\n"
            f"SetEnv PATH={path}\n" + SSHD_OPTIONS
        )
        self.lab.start_daemon(
            host,
            f"(sh {host.folder / 'bootcmd.sh'} > {host.folder / 'console.log'} 2>&1); "
            f"mkdir -p /run/sshd; exec {SSHD} -D -e -f {sshd_config}",
            "sshd.log",
            env={"PATH": path, "HOME": "/root"},
            own_files=[],
        )

    def _stop(self, inst: Instance) -> None:
        inst.stopped.set()
        with inst.lock:
            self.stop_host(inst.host)
            inst.host = None

    def console(self) -> str:
        return self.logs("h*/console.log", "h*/home/.flotilla-lambda-terminate.log")

    # -- JSON views ------------------------------------------------------------------
    def instance_json(self, inst: Instance) -> dict[str, Any]:
        return {
            "id": inst.id,
            "name": inst.name,
            "ip": inst.ip,
            "private_ip": inst.private_ip,
            "status": inst.status,
            "ssh_key_names": [],
            "file_system_names": [],
            "region": {"name": inst.region, "description": inst.region},
            "instance_type": self.type_json(inst.type)["instance_type"],
            "hostname": f"{inst.ip.replace('.', '-')}.lambda.example",
            "is_reserved": False,
        }

    def type_json(self, t: InstanceType) -> dict[str, Any]:
        regions = sorted({r for r, n in t.capacity.items() if n > 0} | t.listed)
        return {
            "instance_type": {
                "name": t.name,
                "description": f"{t.gpus}x {t.gpu_description}",
                "gpu_description": t.gpu_description,
                "price_cents_per_hour": t.price_cents,
                "specs": {
                    "vcpus": 8 * t.gpus,
                    "memory_gib": 64 * t.gpus,
                    "storage_gib": 512,
                    "gpus": t.gpus,
                },
            },
            "regions_with_capacity_available": [{"name": r, "description": r} for r in regions],
        }


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "suggestion": ""}}


class _Handler(JsonHandler):
    cloud: LambdaLab

    def _key(self) -> str:
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Basic "):
            return base64.b64decode(auth[6:]).decode().partition(":")[0]
        return self._bearer() or ""

    def _serve(self, method: str) -> None:
        lab = self.cloud
        path = urlparse(self.path).path.removeprefix("/api/v1")
        lab.requests.append((method, path))
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        key = self._key()
        if key not in (API_KEY, lab.self_key) or not key:
            return self._send(
                401, _error("global/invalid-api-key", "API key was invalid, expired, or deleted.")
            )
        by = "account" if key == API_KEY else "self"
        if (method, path) == ("GET", "/instance-types"):
            with lab._lock:
                return self._send(
                    200, {"data": {n: lab.type_json(t) for n, t in lab.types.items()}}
                )
        if (method, path) == ("POST", "/instance-operations/launch"):
            if body.get("instance_type_name") not in lab.types:
                return self._send(
                    404, _error("global/object-does-not-exist", "Instance type not found")
                )
            made = lab.launch(body)
            if made is None:
                return self._send(
                    400, _error("instance-operations/launch/insufficient-capacity", NO_CAPACITY)
                )
            return self._send(200, {"data": {"instance_ids": [i.id for i in made]}})
        if (method, path) == ("GET", "/instances"):
            with lab._lock:
                return self._send(
                    200, {"data": [lab.instance_json(i) for i in lab.instances.values()]}
                )
        one = re.fullmatch(r"/instances/([0-9a-f]+)", path)
        if one and method == "GET":
            with lab._lock:
                inst = lab.instances.get(one[1])
            if inst is None:
                return self._send(404, _error("global/object-does-not-exist", "Not found"))
            return self._send(200, {"data": lab.instance_json(inst)})
        if (method, path) == ("POST", "/instance-operations/terminate"):
            gone = []
            for ident in body.get("instance_ids") or []:
                with lab._lock:
                    inst = lab.instances.get(str(ident))
                if inst is not None:
                    gone.append(lab.instance_json(inst))
                    lab.terminate(inst, by)
            return self._send(200, {"data": {"terminated_instances": gone}})
        if path == "/ssh-keys" and method == "GET":
            return self._send(200, {"data": list(lab.keys.values())})
        if path == "/ssh-keys" and method == "POST":
            ident = secrets.token_hex(8)
            lab.keys[ident] = {"id": ident, "name": body["name"], "public_key": body["public_key"]}
            return self._send(200, {"data": lab.keys[ident]})
        key_path = re.fullmatch(r"/ssh-keys/([0-9a-f]+)", path)
        if key_path and method == "DELETE":
            if lab.keys.pop(key_path[1], None) is None:
                return self._send(404, _error("global/object-does-not-exist", "Not found"))
            return self._send(200, {"data": {}})
        return self._send(404, _error("global/object-does-not-exist", f"no route {path}"))


@pytest.fixture(name="lambda_lab")
def lambda_lab_fixture() -> Iterator[LambdaLab]:
    yield from LambdaLab.running()


__all__ = ["API_KEY", "LambdaLab", "lambda_lab_fixture"]
