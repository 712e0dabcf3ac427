"""A Verda cloud on this machine: a stand-in for its REST API (``/v1``) whose instances
boot.

No emulator of Verda's API exists, so this is a small one, serving the requests the
official Python client ``verda`` 1.25 sends (its ``authentication``, ``http_client``,
``instance_types``, ``instances``, ``ssh_keys`` and ``startup_scripts`` modules) and the
answers it reads:

* ``POST /oauth2/token`` (JSON ``grant_type client_id client_secret``, or ``refresh_token``)
  -> ``{"access_token", "refresh_token", "scope", "token_type", "expires_in"}``; other
  calls need ``Authorization: Bearer TOKEN``. Wrong credentials or token: 401 ``{"code":
  "unauthorized_request", "message": ...}``;
* ``GET /instance-types`` -> ``[{"id", "instance_type", "price_per_hour", "spot_price",
  "description", "cpu", "gpu" {"description", "number_of_gpus"}, "memory", "gpu_memory",
  "storage", "best_for", "model", "name", "p2p", "currency", "manufacturer",
  "display_name", "supported_os"}]`` (prices as strings, as Verda sends them);
* ``GET /instance-availability?isSpot=`` -> ``[{"location_code", "availabilities":
  [type...]}]``;
* ``POST /instances`` (``instance_type image ssh_key_ids startup_script_id hostname
  description location_code is_spot ...``) -> the new id as plain text; no room in that
  location: 400 ``{"code": "invalid_request", "message": "Instance type T is not
  available in L"}`` (an assumption: Verda documents no capacity error; flotilla also
  checks the availability first, as Skyward does);
* ``GET /instances`` (non-deleted), ``GET /instances/{id}`` -> ``{"id", "instance_type",
  "price_per_hour", "hostname", "description", "status", "created_at", "ssh_key_ids",
  "cpu", "gpu", "memory", "storage", "gpu_memory", "ip", "os_volume_id", "location",
  "image", "startup_script_id", "is_spot"}``; ``status`` ``provisioning`` then
  ``running``;
* ``PUT /instances`` (``{"id": id or [ids], "action": "delete"|"shutdown"|"start"}``):
  ``shutdown`` ends everything in the instance's netns and keeps its files (the OS
  volume), status ``offline``; ``start`` of an ``offline`` one: ``provisioning``, then,
  ``boot_delay`` s later, sshd again with the host key on its disk (the startup script ran
  at the first boot only), ``running``;
* ``GET/POST /sshkeys`` (``name key``; POST answers the id as text), ``DELETE
  /sshkeys/{id}``; ``GET/POST /scripts`` (``name script``), ``DELETE /scripts/{id}``.

Instances: a network-namespace host at a public address (the lab bridge; Verda gives no
private network between instances); ``boot_delay`` s after the create the image puts the
instance's registered SSH keys in root's ~/.ssh/authorized_keys and runs the startup
script as root (with its own /root, /tmp, /etc/ssh and /run), then sshd starts with
whatever host key is in /etc/ssh, listening ONLY on the public address, port 22; the
instance is then ``running``. With ``script_late`` (s), the image's sshd answers first
with the image's own host key, and the startup script runs that much later, after which
sshd restarts (what the script's ``systemctl restart ssh`` does on Verda). Each instance
has an ``nvidia-smi`` listing its type's GPUs.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shlex
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from _hosts import SERVE_POLL, SSHD, Lab, SharedLab, TestHost, keygen, lab_unavailable, run  # noqa: F401
from _lifecycle import Lifecycle, environment

CLIENT_ID = "verda-test-client"
CLIENT_SECRET = "verda-secret-0123456789abcdef"
STOPPED = "offline"
"""The status of a shut-down instance."""


@dataclass
class InstanceType:
    name: str
    gpu_description: str
    gpus: int
    price: float
    spot_price: float
    capacity: dict[str, int] = field(default_factory=lambda: {"FIN-01": 4})
    spot_capacity: dict[str, int] = field(default_factory=dict)
    listed: set[str] = field(default_factory=set)  # locations listed as available anyway


@dataclass
class Instance:
    id: str
    type: InstanceType
    location: str
    ip: str
    hostname: str
    description: str
    script: str
    keys: list[str]
    is_spot: bool
    status: str = "provisioning"
    host: TestHost | None = None
    stopped: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    created_at: float = field(default_factory=time.monotonic)
    number: int = 0
    boots: int = 0


class VerdaLab(Lifecycle):
    """The stand-in API server and its instances. A context manager; ``url`` and ``env``
    (``VERDA_BASE_URL``, ``VERDA_CLIENT_ID``, ``VERDA_CLIENT_SECRET``) are what a client
    needs (in ``os.environ`` only inside :meth:`environment`). ``self_client``: other
    credentials the test gives the instances (their deletes are recorded as "self")."""

    def __init__(self, boot_delay: float = 0.5) -> None:
        self.boot_delay = boot_delay
        self.lab = Lab()
        self.types: dict[str, InstanceType] = {}
        self.instances: dict[str, Instance] = {}
        self.keys: dict[str, dict[str, str]] = {}
        self.scripts: dict[str, dict[str, str]] = {}
        self.creates: list[dict[str, Any]] = []
        self.deleted: dict[str, str] = {}  # id -> "account" | "self"
        self.actions: list[tuple[str, str]] = []  # (action, id) of each PUT /instances
        self.tokens: dict[str, str] = {}  # token -> client id
        self.self_client = ("", "")
        self.script_late = 0.0
        self.url = ""
        self.env: dict[str, str] = {}
        self.closing = False
        self._lock = threading.RLock()
        self._count = 0
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        self.lab.start()
        addr = f"{self.lab.subnet}.1"
        lab = self

        class Handler(_Handler):
            cloud = lab

        self._server = ThreadingHTTPServer((addr, 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(SERVE_POLL,), daemon=True).start()
        self.url = f"http://{addr}:{self._server.server_port}/v1"
        self.env = {
            "VERDA_BASE_URL": self.url,
            "VERDA_CLIENT_ID": CLIENT_ID,
            "VERDA_CLIENT_SECRET": CLIENT_SECRET,
        }

    def environment(self) -> contextlib.AbstractContextManager[None]:
        return environment(self.env)

    def close(self) -> None:
        self.closing = True
        for inst in list(self.instances.values()):
            self._stop(inst)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.lab.close()

    def reset(self) -> None:
        """A fresh account for the next test of a shared lab (what an earlier failed test
        left running is deleted first)."""
        for inst in self.live():
            self.delete(inst, "reset")
        with self._lock:
            self.types.clear()
            self.keys.clear()
            self.scripts.clear()
            self.creates.clear()
            self.deleted.clear()
            self.actions.clear()
            self.self_client = ("", "")
        self.boot_delay = 0.5
        self.script_late = 0.0

    def add_type(
        self, name: str, gpu: str, gpus: int, price: float, spot: float = 0.0, **fields: Any
    ) -> InstanceType:
        with self._lock:
            t = InstanceType(name, gpu, gpus, price, spot or round(price * 0.4, 3), **fields)
            self.types[name] = t
        return t

    def live(self, prefix: str = "") -> list[Instance]:
        with self._lock:
            return [i for i in self.instances.values() if i.description.startswith(prefix)]

    def wait_gone(self, timeout: float, prefix: str = "") -> list[Instance]:
        deadline = time.monotonic() + timeout
        while True:
            left = self.live(prefix)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def create(self, body: dict[str, Any]) -> Instance | None:
        with self._lock:
            self.creates.append(body)
            t = self.types[str(body["instance_type"])]
            loc = str(body.get("location_code") or "FIN-03")
            spot = bool(body.get("is_spot"))
            room = t.spot_capacity if spot else t.capacity
            if room.get(loc, 0) < 1:
                return None
            room[loc] -= 1
            wanted = set(body.get("ssh_key_ids") or [])
            keys = [k["key"] for k in self.keys.values() if k["id"] in wanted]
            script = self.scripts.get(str(body.get("startup_script_id") or ""), {})
            self._count += 1
            n = self._count
            inst = Instance(
                id=str(uuid.uuid4()),
                type=t,
                location=loc,
                ip=f"{self.lab.subnet}.{10 + n}",
                hostname=str(body.get("hostname") or ""),
                description=str(body.get("description") or ""),
                script=script.get("script", ""),
                keys=keys,
                is_spot=spot,
                number=n,
            )
            self.instances[inst.id] = inst
        threading.Thread(target=self._life, args=(inst,), daemon=True).start()
        return inst

    def delete(self, inst: Instance, by: str) -> None:
        with self._lock:
            if self.instances.pop(inst.id, None) is None:
                return
            self.deleted[inst.id] = by
            room = inst.type.spot_capacity if inst.is_spot else inst.type.capacity
            room[inst.location] = room.get(inst.location, 0) + 1
        threading.Thread(target=self._stop, args=(inst,), daemon=True).start()

    def shutdown(self, inst: Instance) -> None:
        """``shutdown``: everything in the instance's netns ends; its host folder (the OS
        volume: /root, /etc/ssh) stays; ``offline``. Verda keeps the instance's place (its
        capacity is not given back)."""
        with inst.lock:
            inst.status = STOPPED
            inst.boots += 1  # a boot still waiting for D does not happen
            host = inst.host
            if host is not None:
                deadline = time.monotonic() + 5
                while self.lab.pids(host) and time.monotonic() < deadline:
                    self.lab.kill_all(host)
                    time.sleep(0.02)

    def power_on(self, inst: Instance) -> bool:
        """``start`` of an ``offline`` instance: ``provisioning``, booted again
        ``boot_delay`` s later from its kept disk (sshd with the host key /etc/ssh holds;
        the startup script ran at the first boot only), then ``running``."""
        with inst.lock:
            if inst.status != STOPPED:
                return False
            inst.status = "provisioning"
            inst.boots += 1
            boot = inst.boots
        threading.Thread(target=self._reboot, args=(inst, boot), daemon=True).start()
        return True

    def _reboot(self, inst: Instance, boot: int) -> None:
        if inst.stopped.wait(self.boot_delay):
            return
        with inst.lock:
            host = inst.host
            if inst.boots != boot or self.closing or host is None:
                return
            etc = host.folder / "etc-ssh"
            path = f"{host.folder / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
            path += ":/sbin:/bin"
            self.lab.start_daemon(
                host,
                f"mount --bind {etc} /etc/ssh && mount -t tmpfs -o mode=755 tmpfs /run && "
                f"mkdir -p /run/sshd && cd / && exec {SSHD} -D -e",
                "instance.log",
                env={"PATH": path, "HOME": "/root"},
                own_files=[etc],
            )
            inst.status = "running"

    def _life(self, inst: Instance) -> None:
        with inst.lock:
            if inst.stopped.is_set():
                return
            inst.host = self.lab.new_host(inst.number, inst.ip, f"verda-{inst.number}")
        if inst.stopped.wait(max(0.0, inst.created_at + self.boot_delay - time.monotonic())):
            return
        with inst.lock:
            if inst.stopped.is_set() or self.closing or inst.host is None:
                return
            self._boot(inst, inst.host)
            inst.status = "running"

    def _boot(self, inst: Instance, host: TestHost) -> None:
        """The image: registered keys authorized for root, the startup script as root,
        then sshd with whatever host key /etc/ssh holds."""
        etc = host.folder / "etc-ssh"
        etc.mkdir()
        bin_dir = host.folder / "bin"
        bin_dir.mkdir()
        listing = "".join(
            f"GPU {i}: NVIDIA {inst.type.gpu_description} (UUID: GPU-{inst.id[:8]}-{i})\n"
            for i in range(inst.type.gpus)
        )
        smi = bin_dir / "nvidia-smi"
        smi.write_text(
            f"#!/bin/sh\n[ \"$1\" = -L ] || exit 2\nprintf '%s' {shlex.quote(listing)}\n"
        )
        smi.chmod(0o755)
        path = f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        (etc / "sshd_config").write_text(
            f"SetEnv PATH={path}\n"
            f"ListenAddress {inst.ip}:22\n"
            "HostKey /etc/ssh/ssh_host_ed25519_key\n"
            "PidFile /run/sshd.pid\n"
            "AuthorizedKeysFile .ssh/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nUseDNS no\n"
            "MaxSessions 64\nMaxStartups 64\n"
        )
        keygen(etc / "ssh_host_ed25519_key", inst.id)  # the image's own key
        script = host.folder / "startup.sh"
        script.write_text(inst.script or "true\n")
        keys = host.folder / "keys"
        keys.write_text("".join(k + "\n" for k in inst.keys))
        start = (
            f"mount --bind {etc} /etc/ssh && mount -t tmpfs -o mode=755 tmpfs /run && cd / && "
            f"mkdir -p ~/.ssh /run/sshd && cat {keys} >> ~/.ssh/authorized_keys && "
        )
        if self.script_late:  # the image's sshd (its own key) first, the script later
            start += (
                f"{SSHD} -e -o PidFile=/run/image-sshd.pid && sleep {self.script_late} && "
                f"(sh {script} > {host.folder / 'console.log'} 2>&1); "
                "kill $(cat /run/image-sshd.pid); sleep 0.2; "
            )
        else:
            start += f"(sh {script} > {host.folder / 'console.log'} 2>&1); "
        start += f"exec {SSHD} -D -e"
        self.lab.start_daemon(
            host,
            start,
            "instance.log",
            env={"PATH": path, "HOME": "/root"},
            own_files=[etc, script, keys],
        )

    def _stop(self, inst: Instance) -> None:
        inst.stopped.set()
        with inst.lock:
            host = inst.host
            if host is not None and host in self.lab.hosts:
                deadline = time.monotonic() + 5
                while self.lab.pids(host) and time.monotonic() < deadline:
                    self.lab.kill_all(host)
                    time.sleep(0.02)
                with contextlib.suppress(Exception):
                    self.lab.remove_host(host)
            inst.host = None

    def console(self) -> str:
        out = []
        for path in sorted(self.lab.tmp.glob("h*/console.log")) + sorted(
            self.lab.tmp.glob("h*/home/.flotilla-verda-terminate.log")
        ):
            with contextlib.suppress(OSError):
                out.append(f"{path}: {path.read_text(errors='replace')}")
        return "\n".join(out)

    # -- JSON views ------------------------------------------------------------------
    def type_json(self, t: InstanceType) -> dict[str, Any]:
        return {
            "id": f"id-{t.name}",
            "instance_type": t.name,
            "price_per_hour": f"{t.price:.2f}",
            "spot_price": f"{t.spot_price:.3f}",
            "description": f"Dedicated {t.gpus}x {t.gpu_description}",
            "cpu": {"description": f"{22 * t.gpus} CPU", "number_of_cores": 22 * t.gpus},
            "gpu": {"description": f"{t.gpus}x {t.gpu_description}", "number_of_gpus": t.gpus},
            "memory": {"description": f"{120 * t.gpus}GB RAM", "size_in_gigabytes": 120 * t.gpus},
            "gpu_memory": {"description": "", "size_in_gigabytes": 80 * t.gpus},
            "storage": {"description": "dynamic"},
            "best_for": ["training"],
            "model": t.gpu_description.split()[0],
            "name": t.gpu_description,
            "p2p": "",
            "currency": "usd",
            "manufacturer": "NVIDIA",
            "display_name": t.gpu_description,
            "supported_os": ["ubuntu-24.04-cuda-13.0-open", "ubuntu-24.04"],
        }

    def availability(self, spot: bool) -> list[dict[str, Any]]:
        where: dict[str, list[str]] = {}
        with self._lock:
            for t in self.types.values():
                room = t.spot_capacity if spot else t.capacity
                for loc in sorted({r for r, n in room.items() if n > 0} | t.listed):
                    where.setdefault(loc, []).append(t.name)
        return [
            {"location_code": loc, "availabilities": names} for loc, names in sorted(where.items())
        ]

    def instance_json(self, inst: Instance) -> dict[str, Any]:
        t = self.type_json(inst.type)
        return {
            "id": inst.id,
            "instance_type": inst.type.name,
            "price_per_hour": inst.type.spot_price if inst.is_spot else inst.type.price,
            "hostname": inst.hostname,
            "description": inst.description,
            "status": inst.status,
            "created_at": "2026-01-01T00:00:00Z",
            "ssh_key_ids": [],
            "cpu": t["cpu"],
            "gpu": t["gpu"],
            "memory": t["memory"],
            "storage": t["storage"],
            "gpu_memory": t["gpu_memory"],
            "ip": inst.ip,
            "os_volume_id": None,
            "location": inst.location,
            "image": "ubuntu-24.04-cuda-13.0-open",
            "startup_script_id": None,
            "is_spot": inst.is_spot,
        }


def _error(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


class _Handler(BaseHTTPRequestHandler):
    cloud: VerdaLab

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: Any) -> None:
        text = isinstance(body, str)
        data = body.encode() if text else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _token(self, body: dict[str, Any]) -> None:
        lab = self.cloud
        grant = body.get("grant_type")
        if grant == "refresh_token":
            client = lab.tokens.get("r:" + str(body.get("refresh_token")))
        elif grant == "client_credentials":
            pair = (body.get("client_id"), body.get("client_secret"))
            known = {(CLIENT_ID, CLIENT_SECRET), lab.self_client}
            client = str(pair[0]) if pair in known and pair[0] else None
        else:
            client = None
        if client is None:
            return self._send(401, _error("unauthorized_request", "Invalid client credentials"))
        token, refresh = secrets.token_hex(16), secrets.token_hex(16)
        lab.tokens[token] = client
        lab.tokens["r:" + refresh] = client
        return self._send(
            200,
            {
                "access_token": token,
                "refresh_token": refresh,
                "scope": "cloud-api-v1",
                "token_type": "Bearer",
                "expires_in": 3600,
            },
        )

    def _serve(self, method: str) -> None:
        lab = self.cloud
        parsed = urlparse(self.path)
        path = parsed.path.removeprefix("/v1")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        if (method, path) == ("POST", "/oauth2/token"):
            return self._token(body)
        auth = self.headers.get("Authorization", "")
        client = (
            lab.tokens.get(auth.removeprefix("Bearer ")) if auth.startswith("Bearer ") else None
        )
        if client is None:
            return self._send(401, _error("unauthorized_request", "Invalid or expired token"))
        by = "account" if client == CLIENT_ID else "self"
        if (method, path) == ("GET", "/instance-types"):
            with lab._lock:
                return self._send(200, [lab.type_json(t) for t in lab.types.values()])
        if (method, path) == ("GET", "/instance-availability"):
            return self._send(200, lab.availability(query.get("isSpot") == "true"))
        if (method, path) == ("POST", "/instances"):
            name = body.get("instance_type")
            if name not in lab.types:
                return self._send(404, _error("not_found", f"Instance type {name} not found"))
            made = lab.create(body)
            if made is None:
                loc = body.get("location_code")
                return self._send(
                    400,
                    _error("invalid_request", f"Instance type {name} is not available in {loc}"),
                )
            return self._send(200, made.id)
        if (method, path) == ("GET", "/instances"):
            with lab._lock:
                rows = [lab.instance_json(i) for i in lab.instances.values()]
            if query.get("status"):
                rows = [r for r in rows if r["status"] == query["status"]]
            return self._send(200, rows)
        if method == "GET" and path.startswith("/instances/"):
            with lab._lock:
                inst = lab.instances.get(path.split("/")[2])
            if inst is None:
                return self._send(404, _error("not_found", "Instance not found"))
            return self._send(200, lab.instance_json(inst))
        if (method, path) == ("PUT", "/instances"):
            ids = body.get("id")
            action = body.get("action")
            if action not in ("delete", "shutdown", "start"):
                return self._send(400, _error("invalid_request", f"{action} is not stood in"))
            listed = [ids] if isinstance(ids, str) else ids or []
            with lab._lock:
                found = [lab.instances.get(str(i)) for i in listed]
            if action != "delete" and any(i is None for i in found):
                return self._send(404, _error("not_found", "Instance not found"))
            for inst in [i for i in found if i is not None]:
                if action == "delete":
                    lab.delete(inst, by)
                elif action == "shutdown":
                    lab.shutdown(inst)
                elif not lab.power_on(inst):
                    return self._send(
                        400, _error("invalid_request", f"Instance {inst.id} is not offline")
                    )
            lab.actions.extend((action, i.id) for i in found if i is not None)
            return self._send(202, "")
        for route, store, field_name in (
            ("/sshkeys", lab.keys, "key"),
            ("/scripts", lab.scripts, "script"),
        ):
            if path == route and method == "GET":
                return self._send(200, list(store.values()))
            if path == route and method == "POST":
                ident = str(uuid.uuid4())
                store[ident] = {"id": ident, "name": body["name"], field_name: body[field_name]}
                return self._send(201, ident)
            if path.startswith(route + "/") and method == "DELETE":
                if store.pop(path.split("/")[2], None) is None:
                    return self._send(404, _error("not_found", "Not found"))
                return self._send(202, "")
        return self._send(404, _error("not_found", f"no route {method} {path}"))


_VERDA = SharedLab(lambda: VerdaLab().started())


@pytest.fixture(name="verda_lab", scope="session")
def verda_lab_fixture() -> Iterator[VerdaLab]:
    """One lab for the whole session, shared by every module that imports this fixture
    (:class:`SharedLab`): each test gets it reset (``verda``), its account empty."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    with _VERDA.use() as lab:
        yield lab


@pytest.fixture(name="verda")
def verda_fixture(verda_lab: VerdaLab) -> Iterator[VerdaLab]:
    """The session's lab, reset for one test, its environment in ``os.environ`` while the
    test runs (as it was before afterwards: the lab lives on, the next test may not know
    it); nothing may be left running after it."""
    verda_lab.reset()
    with verda_lab.environment():  # (a pool still ending after the test needs it too)
        yield verda_lab
        left = verda_lab.wait_gone(60)
    assert left == [], [i.description for i in left]


__all__ = ["CLIENT_ID", "CLIENT_SECRET", "VerdaLab", "verda_fixture", "verda_lab_fixture"]
