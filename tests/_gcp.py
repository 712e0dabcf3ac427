"""Google Compute Engine on this machine: a stand-in for the Compute REST API, Google's
OAuth2 token endpoint and the instances' metadata server, whose instances boot.

No emulator of Compute Engine exists, so this is a small one, serving the requests, bodies
and answers of the official client ``google-cloud-compute`` (1.56.0, REST transport: its
``services/*/transports/rest_base.py`` give every route's method and URI) and of
``google-auth`` (2.x):

* tokens: ``POST {token_uri}`` with ``grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer``
  and ``assertion``, a JWT signed RS256 by the service account's key (google-auth's
  ``service_account.Credentials``, ``_client.jwt_grant``); the signature is checked with the
  account's public key; a bad one answers 400 ``invalid_grant`` "Invalid JWT Signature." as
  Google does; answer ``{"access_token", "expires_in", "token_type"}``. Every Compute call
  needs ``Authorization: Bearer`` with such a token (401 ``UNAUTHENTICATED`` otherwise),
  unless ``anonymous`` is set (the official client's own test, with
  ``AnonymousCredentials``);
* Compute ``/compute/v1/projects/{project}/...``: ``zones`` (list), ``aggregated/
  machineTypes``, ``aggregated/acceleratorTypes``, ``aggregated/instances`` (with
  ``filter``), ``zones/{zone}/instances`` (insert with ``requestId``: the same id twice is
  one instance; list with ``filter``), ``zones/{zone}/instances/{name}`` (get, delete),
  ``.../getGuestAttributes?queryPath=hostkeys/``, ``zones/{zone}/operations/{op}`` (get)
  and ``.../wait`` (POST: returns when the operation is DONE or after 2 s, as Google's
  does after up to 2 minutes); errors as ``{"error": {"code", "message", "errors":
  [{"reason", "message"}]}}``. An insert into a zone out of capacity (``capacity``)
  answers an operation that ends DONE with ``error.errors[0].code ==
  "ZONE_RESOURCE_POOL_EXHAUSTED"``, as Google's does;
* the metadata server, at ``http://metadata.google.internal`` (port 80 of the lab's bridge
  address; the instances' /etc/hosts name it so): ``Metadata-Flavor: Google`` required;
  ``instance/name``, ``instance/zone``, ``project/project-id``, ``instance/preempted``,
  ``instance/attributes/{key}``, ``instance/service-accounts/default/token`` (a token that
  may read and delete that instance only), and guest attributes written by the instance
  (``PUT instance/guest-attributes/{namespace}/{key}``).

Instances: an insert makes the instance RUNNING at once, with an external address on the
lab's bridge (``natIP``: the only address this machine reaches it at) and an internal one
on the VPC network (``networkIP``: a bridge of its own, which this machine has no address
on; only the instances reach each other there). ``boot_delay`` s later the guest agent's
part: the ``startup-script`` metadata runs (``/bin/sh``, as root, output to
``startup.log``), the ``ssh-keys`` metadata of user ``root`` become its authorized keys,
sshd starts (listening on ``natIP:22`` and ``networkIP:22`` only) with a host key the
instance made itself, and (``enable-guest-attributes=TRUE``) that key is published as the
guest attribute ``hostkeys/ssh-ed25519``. Deleting an instance stops everything in it.
``.../instances/{name}/stop`` (POST) stops everything in it too but keeps the instance
TERMINATED with its boot disk (its folder: the host key, ``/root/.flotilla``, ``/var/lib``)
and clears its guest attributes; ``.../start`` makes it RUNNING again and boots it
``boot_delay`` s later (the startup script again, sshd with the same host key, published
again); ``.../setMetadata`` (POST ``{fingerprint, items}``) replaces its metadata when the
fingerprint is the current one (412 ``conditionNotMet`` otherwise), as Google's does.
``preempt(name)`` sets ``instance/preempted`` to TRUE and deletes the instance a second
later (a SPOT instance's ``instanceTerminationAction: DELETE``).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from _hosts import SSHD, TestHost, free_subnet, keygen, lab_unavailable
from _standin import SSHD_OPTIONS, JsonHandler, StandIn

PROJECT = "flotilla-lab"
ACCOUNT = "flotilla-test@flotilla-lab.iam.gserviceaccount.com"
GOOGLE_TOKEN = "https://oauth2.googleapis.com/token"
ZONES = ("us-central1-a", "us-central1-b", "us-central1-c", "us-west1-b")
MACHINE_TYPES = {
    "n2-standard-2": (2, 8192),
    "n2-standard-4": (4, 16384),
    "n1-standard-8": (8, 30720),
    "n1-standard-16": (16, 61440),
    "a2-highgpu-1g": (12, 87040),
    "a2-highgpu-2g": (24, 174080),
    "g2-standard-4": (4, 16384),
}
ACCELERATOR_TYPES = ("nvidia-tesla-a100", "nvidia-tesla-t4", "nvidia-l4")


def _private_key() -> str:
    """A new RSA private key (PEM), as a service account's."""
    return subprocess.run(
        ["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@functools.cache
def _trusted_key() -> tuple[str, bytes]:
    """The key (private PEM, public PEM) every lab of this process trusts, made once: an
    RSA key took a good part of a lab's start (a lab per test)."""
    private = _private_key()
    public = subprocess.run(
        ["openssl", "pkey", "-pubout"], input=private.encode(), capture_output=True, check=True
    ).stdout
    return private, public


@dataclass
class LabInstance:
    name: str
    zone: str
    body: dict[str, Any]
    nat_ip: str
    network_ip: str
    index: int
    id: int = field(default_factory=lambda: secrets.randbelow(10**18))
    status: str = "RUNNING"
    token: str = field(default_factory=lambda: "inst-" + secrets.token_hex(16))
    preempted: bool = False
    guest: dict[tuple[str, str], str] = field(default_factory=dict)
    host: TestHost | None = None
    stopped: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    created_at: float = field(default_factory=time.monotonic)
    created_wall: float = field(default_factory=time.time)

    def metadata(self, key: str) -> str | None:
        for item in (self.body.get("metadata") or {}).get("items") or []:
            if item.get("key") == key:
                return str(item.get("value", ""))
        return None


@dataclass
class Operation:
    name: str
    zone: str
    kind: str
    target: str
    done: threading.Event = field(default_factory=threading.Event)
    error: list[dict[str, str]] = field(default_factory=list)


class GcpLab(StandIn):
    """The stand-in servers and the instances (see the module docstring). A context manager;
    ``env`` is what a client needs (``GOOGLE_APPLICATION_CREDENTIALS``,
    ``GOOGLE_CLOUD_PROJECT``, ``CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE``), set in
    ``os.environ`` while the lab runs."""

    def __init__(self, boot_delay: float = 2.0) -> None:
        super().__init__(boot_delay)
        self.instances: dict[tuple[str, str], LabInstance] = {}
        self.made: list[LabInstance] = []  # every instance ever inserted
        self.powered: list[tuple[str, str]] = []  # (name, "stop" | "start") of each call
        self.operations: dict[str, Operation] = {}
        self.capacity: dict[str, int] = {}
        """zone -> how many more instances it can hold (absent: any number)."""
        self.spot_capacity: dict[str, int] = {}
        """zone -> how many more SPOT instances it can hold (absent: any number)."""
        self.anonymous = False
        self.impostor = False
        """Instances publish a host key their sshd does not use (someone in the middle)."""
        self.destroyed: dict[str, str] = {}  # name -> "account" | "self" | "preempted"
        self.destroyed_at: dict[str, float] = {}
        self.tokens: dict[str, str] = {}  # account token -> account
        self.key_file: Path | None = None
        self._public_pem = b""
        self._request_ids: dict[str, str] = {}
        self._inserts = 0  # insert requests, a retry of one not counted (see inserts())
        self._insert_ids: set[str] = set()
        self._verified: dict[str, dict[str, Any]] = {}
        self._index = 0
        self.vpc_bridge = ""
        self.vpc_subnet = ""

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        self.lab.start()
        self.url = f"http://{self.addr}:{self.serve(_ApiHandler, 'gcp')}"
        self.serve(_MetadataHandler, "gcp", 80)
        self.vpc_subnet = free_subnet(os.getpid() + 53)
        # as remove_stale_labs knows
        self.vpc_bridge = self.add_bridge(f"flb{self.lab.tag}x9"[:15])
        self.key_file = self.write_key_file(self.lab.tmp / "service-account.json")
        self.set_env(
            {
                "GOOGLE_APPLICATION_CREDENTIALS": str(self.key_file),
                "GOOGLE_CLOUD_PROJECT": PROJECT,
                "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": f"{self.url}/compute/v1/",
            }
        )

    def write_key_file(self, path: Path, token_uri: str = "") -> Path:
        """A service-account key file (JSON, as the console downloads it) whose
        ``token_uri`` is the lab's token endpoint; the lab trusts the first one's key (the
        same in every lab of this process: :func:`_trusted_key`), each other one is new."""
        if not self._public_pem:
            private, self._public_pem = _trusted_key()
        else:
            private = _private_key()
        data = {
            "type": "service_account",
            "project_id": PROJECT,
            "private_key_id": secrets.token_hex(20),
            "private_key": private,
            "client_email": ACCOUNT,
            "client_id": "1234567890",
            "auth_uri": "https://accounts.google.com/o/oauth2/auth",
            "token_uri": token_uri or f"{self.url}/token",
        }
        path.write_text(json.dumps(data))
        path.chmod(0o600)
        return path

    def close(self) -> None:
        for inst in list(self.made):  # deleted ones too: their stop may still run
            self._stop(inst)
        self.instances.clear()
        self.vpc_bridge = ""
        self.shut()

    # -- what tests look at ----------------------------------------------------------
    def live(self, which: str = "") -> list[LabInstance]:
        """The instances not deleted (of pool ``which``)."""
        with self._lock:
            return [
                i
                for i in self.instances.values()
                if not which or (i.body.get("labels") or {}).get("flotilla-pool") == which
            ]

    def inserts(self) -> int:
        """The inserts asked for: a retry of one (the same ``requestId``, which Compute
        Engine answers with the first one's operation) is not another."""
        with self._lock:
            return self._inserts

    def count_insert(self, request_id: str) -> None:
        """One more insert asked for, unless it retries one already counted."""
        with self._lock:
            if not request_id or request_id not in self._insert_ids:
                self._insert_ids.add(request_id)
                self._inserts += 1

    def log(self, inst: LabInstance) -> str:
        folder = self.lab.tmp / f"h{inst.index}"
        out = []
        for name in ("startup.log", "sshd.log"):
            with contextlib.suppress(OSError):
                out.append(f"{name}: {(folder / name).read_text(errors='replace')}")
        watch = folder / "flotilla" / "watchdog"
        for path in sorted(watch.glob("*")) if watch.is_dir() else []:
            with contextlib.suppress(OSError):
                out.append(f"{path.name}: {path.read_text(errors='replace')}")
        return "\n".join(out)

    def contact(self, inst: LabInstance) -> float:
        path = self.lab.tmp / f"h{inst.index}" / "flotilla" / "watchdog" / inst.name
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    # -- tokens ----------------------------------------------------------------------
    def grant(self, assertion: str) -> str | None:
        """An access token for a valid JWT-bearer assertion (google-auth's), else None."""
        claims = self.signed_by_account(assertion)
        # google-auth posts to the key's token_uri with Google's token endpoint as the
        # JWT's audience (``_GOOGLE_OAUTH2_TOKEN_ENDPOINT``), which Google accepts
        if claims is None or claims.get("aud") not in (f"{self.url}/token", GOOGLE_TOKEN):
            return None
        token = "ya29." + secrets.token_hex(24)
        with self._lock:
            self.tokens[token] = ACCOUNT
        return token

    def signed_by_account(self, jwt: str) -> dict[str, Any] | None:
        """The claims of ``jwt`` when the service account's key signed it (RS256) and it
        has not expired, else None. The official
        client sends such a self-signed JWT as its bearer token (google-auth's
        ``always_use_jwt_access``), as Google accepts."""
        with self._lock:
            if jwt in self._verified:
                return self._verified[jwt]
        try:
            head, body, sig = jwt.split(".")
            claims = json.loads(_unb64(body))
            signed = f"{head}.{body}".encode()
            pem = self.lab.tmp / "public.pem"
            pem.write_bytes(self._public_pem)
            sig_file = self.lab.tmp / f"sig-{secrets.token_hex(4)}"
            sig_file.write_bytes(_unb64(sig))
            try:
                ok = subprocess.run(
                    [
                        "openssl",
                        "dgst",
                        "-sha256",
                        "-verify",
                        str(pem),
                        "-signature",
                        str(sig_file),
                    ],
                    input=signed,
                    capture_output=True,
                ).returncode
            finally:
                sig_file.unlink()
        except (ValueError, KeyError):
            return None
        if ok != 0 or claims.get("iss") != ACCOUNT or claims.get("exp", 0) < time.time():
            return None
        with self._lock:
            self._verified[jwt] = claims
        return dict(claims)

    # -- instances -------------------------------------------------------------------
    def insert(self, zone: str, body: dict[str, Any], request_id: str) -> Operation:
        with self._lock:
            if request_id and request_id in self._request_ids:
                return self.operations[self._request_ids[request_id]]
            name = str(body["name"])
            op = Operation(f"operation-{secrets.token_hex(8)}", zone, "insert", name)
            self.operations[op.name] = op
            if request_id:
                self._request_ids[request_id] = op.name
            if (zone, name) in self.instances:
                op.error = [{"code": "RESOURCE_ALREADY_EXISTS", "message": f"{name} exists"}]
                op.done.set()
                return op
            spot = (body.get("scheduling") or {}).get("provisioningModel") == "SPOT"
            pool = self.spot_capacity if spot else self.capacity
            left = pool.get(zone)
            if left is not None and left <= 0:
                op.error = [
                    {
                        "code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                        "message": f"The zone 'projects/{PROJECT}/zones/{zone}' does not have "
                        "enough resources available to fulfill the request.  Try a different "
                        "zone, or try again later.",
                    }
                ]
                op.done.set()
                return op
            if left is not None:
                pool[zone] = left - 1
            self._index += 1
            inst = LabInstance(
                name,
                zone,
                body,
                nat_ip=f"{self.lab.subnet}.{10 + self._index}",
                network_ip=f"{self.vpc_subnet}.{10 + self._index}",
                index=self._index,
            )
            self.instances[(zone, name)] = inst
            self.made.append(inst)
        threading.Thread(target=self._life, args=(inst,), daemon=True).start()
        op.done.set()
        return op

    def delete(self, inst: LabInstance, by: str) -> Operation:
        op = Operation(f"operation-{secrets.token_hex(8)}", inst.zone, "delete", inst.name)
        with self._lock:
            self.operations[op.name] = op
            if self.instances.pop((inst.zone, inst.name), None) is None:
                op.done.set()
                return op
            inst.status = "STOPPING"
            self.destroyed[inst.name] = by
            self.destroyed_at[inst.name] = time.time()

        def stop() -> None:
            self._stop(inst)
            op.done.set()

        threading.Thread(target=stop, daemon=True).start()
        return op

    def preempt(self, inst: LabInstance, grace: float | None = 1.0) -> None:
        """Compute Engine takes the SPOT instance back: ``preempted`` TRUE, then deleted
        ``grace`` s later (Google gives 30 s; None: not before its pool deletes it, so that
        only the notice can tell the pool)."""
        inst.preempted = True
        if grace is None:
            return

        def later() -> None:
            time.sleep(grace)
            self.delete(inst, "preempted")

        threading.Thread(target=later, daemon=True).start()

    def power(self, inst: LabInstance, verb: str) -> Operation:
        """``instances.stop`` (everything in it killed, its disk kept, TERMINATED) or
        ``instances.start`` (RUNNING, booted ``boot_delay`` s later)."""
        op = Operation(f"operation-{secrets.token_hex(8)}", inst.zone, verb, inst.name)
        with self._lock:
            self.operations[op.name] = op
            self.powered.append((inst.name, verb))

        def stop() -> None:
            with inst.lock:
                inst.status = "STOPPING"
                if inst.host is not None:
                    self.kill_processes(inst.host)
                inst.guest.clear()
                inst.status = "TERMINATED"
            op.done.set()

        if verb == "stop":
            threading.Thread(target=stop, daemon=True).start()
            return op
        with inst.lock:
            if inst.status == "TERMINATED" and inst.host is not None:
                inst.status = "RUNNING"
                threading.Thread(
                    target=self._boot, args=(inst, inst.host, time.monotonic()), daemon=True
                ).start()
            elif inst.status != "RUNNING":
                op.error = [
                    {"code": "RESOURCE_NOT_READY", "message": f"{inst.name} is {inst.status}"}
                ]
        op.done.set()
        return op

    def _life(self, inst: LabInstance) -> None:
        with inst.lock:
            if inst.stopped.is_set():
                return
            host = self.lab.new_host(inst.index, inst.nat_ip, inst.name)
            inst.host = host
            veth = f"flv{self.lab.tag}y{inst.index}"[-15:]
            self.plug(host, self.vpc_bridge, veth, "ens5", inst.network_ip)
            for sub in ("etc-ssh", "flotilla", "var-lib"):
                (host.folder / sub).mkdir()
            (host.folder / "hosts").write_text(
                f"127.0.0.1 localhost\n{inst.nat_ip} {inst.name}\n"
                f"{self.lab.subnet}.1 metadata.google.internal metadata\n"
            )
            keys = inst.metadata("ssh-keys") or ""
            (host.folder / "authorized_keys").write_text(
                "".join(
                    line.partition(":")[2] + "\n"
                    for line in keys.splitlines()
                    if line.startswith("root:")
                )
            )
        self._boot(inst, host, inst.created_at)

    def _boot(self, inst: LabInstance, host: TestHost, since: float) -> None:
        """``boot_delay`` s after ``since``: the startup script, then sshd (the guest
        agent's part), unless the instance was deleted or stopped meanwhile."""
        if inst.stopped.wait(max(0.0, since + self.boot_delay - time.monotonic())):
            return
        with inst.lock:
            if inst.stopped.is_set() or inst.status != "RUNNING":
                return
            self._startup(inst, host)
            key = host.folder / "etc-ssh" / "ssh_host_ed25519_key"
            if key.exists():  # its boot disk's, made at the first boot
                public = key.with_suffix(".pub").read_text().strip()
            else:
                public = keygen(key, inst.name)  # the instance's own host key
            if self.impostor:
                public = keygen(host.folder / "other_key", inst.name)
            config = host.folder / "sshd_config"
            config.write_text(
                f"ListenAddress {inst.nat_ip}:22\nListenAddress {inst.network_ip}:22\n"
                "HostKey /etc/ssh/ssh_host_ed25519_key\n"
                f"PidFile {host.folder}/sshd.pid\n"
                f"AuthorizedKeysFile {host.folder}/authorized_keys .ssh/authorized_keys\n"
                + SSHD_OPTIONS
            )
            self.lab.start_daemon(
                host,
                self._container(host) + f"exec {SSHD} -D -e -f {config}",
                "sshd.log",
                hosts_text=(host.folder / "hosts").read_text(),
            )
            if (inst.metadata("enable-guest-attributes") or "").upper() == "TRUE":
                inst.guest[("hostkeys", "ssh-ed25519")] = " ".join(public.split()[:2])

    def _container(self, host: TestHost) -> str:
        """Shell lines that give a process the instance's own /etc/ssh, /root/.flotilla,
        /var/lib, /run and /dev/shm (the rest of the file system is this machine's)."""
        return (
            f"mount --bind {host.folder / 'etc-ssh'} /etc/ssh && "
            "mkdir -p /root/.flotilla && "
            f"mount --bind {host.folder / 'flotilla'} /root/.flotilla && "
            f"mount --bind {host.folder / 'var-lib'} /var/lib && "
            f"mount --bind {host.folder / 'hosts'} /etc/hosts && "
            "mount -t tmpfs -o mode=755 tmpfs /run && mkdir -p /run/sshd && "
            "mount -t tmpfs -o size=512m,mode=1777 tmpfs /dev/shm && "
        )

    def _startup(self, inst: LabInstance, host: TestHost) -> None:
        script = inst.metadata("startup-script")
        if not script:
            return
        path = host.folder / "startup.sh"
        path.write_text(script)
        self.run_script(host, path, "startup.log", {}, self._container(host))

    def _stop(self, inst: LabInstance) -> None:
        inst.stopped.set()
        with inst.lock:
            self.stop_host(inst.host)
            inst.host = None
            inst.status = "TERMINATED"

    def by_address(self, addr: str) -> LabInstance | None:
        with self._lock:
            return next((i for i in self.instances.values() if i.nat_ip == addr), None)

    # -- JSON views ------------------------------------------------------------------
    def base(self) -> str:
        return f"{self.url}/compute/v1/projects/{PROJECT}"

    def instance_json(self, inst: LabInstance) -> dict[str, Any]:
        body = inst.body
        nics = body.get("networkInterfaces") or [{}]
        return {
            "kind": "compute#instance",
            "id": str(inst.id),
            "name": inst.name,
            "zone": f"{self.base()}/zones/{inst.zone}",
            "status": inst.status,
            "machineType": f"{self.base()}/zones/{inst.zone}/{body.get('machineType', '')}",
            "creationTimestamp": time.strftime(
                "%Y-%m-%dT%H:%M:%S.000-00:00", time.gmtime(inst.created_wall)
            ),
            "labels": body.get("labels") or {},
            "metadata": {
                **(body.get("metadata") or {}),
                "fingerprint": _fingerprint(body.get("metadata")),
            },
            "scheduling": body.get("scheduling") or {},
            "guestAccelerators": body.get("guestAccelerators") or [],
            "serviceAccounts": body.get("serviceAccounts") or [],
            "networkInterfaces": [
                {
                    "name": "nic0",
                    "network": f"{self.base()}/{nics[0].get('network', 'global/networks/default')}",
                    "networkIP": inst.network_ip,
                    "accessConfigs": [
                        {
                            "kind": "compute#accessConfig",
                            "type": "ONE_TO_ONE_NAT",
                            "name": "External NAT",
                            "natIP": inst.nat_ip,
                        }
                    ],
                }
            ],
            "selfLink": f"{self.base()}/zones/{inst.zone}/instances/{inst.name}",
        }

    def operation_json(self, op: Operation) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "compute#operation",
            "id": str(abs(hash(op.name)) % 10**18),
            "name": op.name,
            "zone": f"{self.base()}/zones/{op.zone}",
            "operationType": op.kind,
            "targetLink": f"{self.base()}/zones/{op.zone}/instances/{op.target}",
            "status": "DONE" if op.done.is_set() else "RUNNING",
            "progress": 100 if op.done.is_set() else 0,
            "selfLink": f"{self.base()}/zones/{op.zone}/operations/{op.name}",
        }
        if op.error:
            out["error"] = {"errors": op.error}
            out["httpErrorStatusCode"] = 503
            out["httpErrorMessage"] = "SERVICE UNAVAILABLE"
        return out


def _fingerprint(metadata: Any) -> str:
    """The metadata's fingerprint: a digest of its items (Google's is opaque base64)."""
    items = (metadata or {}).get("items") or []
    digest = hashlib.sha256(json.dumps(items, sort_keys=True).encode()).digest()
    return base64.b64encode(digest[:8]).decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _matches(inst: dict[str, Any], expression: str) -> bool:
    """Compute's ``filter`` for what flotilla asks: ``labels.K = "V"`` and ``labels.K:*``."""
    expression = expression.strip()
    if not expression:
        return True
    labels = inst.get("labels") or {}
    if expression.endswith(":*") and expression.startswith("labels."):
        return expression[len("labels.") : -2] in labels
    left, eq, right = expression.partition("=")
    if eq and left.strip().startswith("labels."):
        return labels.get(left.strip()[len("labels.") :]) == right.strip().strip('"')
    raise ValueError(f"unsupported filter {expression!r}")


class _Handler(JsonHandler):
    gcp: GcpLab

    def _send(self, code: int, body: Any, text: bool = False) -> None:
        data = (body if text else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/text" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        if text:
            self.send_header("Metadata-Flavor", "Google")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, status: str, message: str, reason: str = "") -> None:
        self._send(
            code,
            {
                "error": {
                    "code": code,
                    "message": message,
                    "status": status,
                    "errors": [
                        {"message": message, "domain": "global", "reason": reason or status}
                    ],
                }
            },
        )


class _ApiHandler(_Handler):
    def _serve(self, method: str) -> None:
        lab = self.gcp
        url = urlparse(self.path)
        path, query = url.path, {k: v[0] for k, v in parse_qs(url.query).items()}
        lab.requests.append((method, path))
        if method == "POST" and path.endswith("/instances"):
            lab.count_insert(query.get("requestId", ""))
        raw = self._raw()
        if path == "/token" and method == "POST":
            form = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
            if form.get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer":
                return self._send(400, {"error": "unsupported_grant_type"})
            token = lab.grant(form.get("assertion", ""))
            if token is None:
                return self._send(
                    400, {"error": "invalid_grant", "error_description": "Invalid JWT Signature."}
                )
            return self._send(
                200, {"access_token": token, "expires_in": 3599, "token_type": "Bearer"}
            )
        prefix = f"/compute/v1/projects/{PROJECT}/"
        if not path.startswith("/compute/v1/projects/"):
            return self._error(404, "NOT_FOUND", f"no route {path}")
        if not path.startswith(prefix):
            return self._error(
                404, "NOT_FOUND", "The resource 'projects/x' was not found", "notFound"
            )
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip()
        rest = path[len(prefix) :].strip("/").split("/")
        with lab._lock:
            account = lab.tokens.get(token)
            own = next((i for i in lab.instances.values() if i.token == token), None)
        if account is None and token.count(".") == 2 and lab.signed_by_account(token):
            account = ACCOUNT  # a self-signed JWT of the account's
        if account is None and not (lab.anonymous and not auth):
            # an instance's own token: its own instance only (reading and deleting it)
            mine = (
                own is not None
                and len(rest) == 4
                and rest[:3] == ["zones", own.zone, "instances"]
                and rest[3] == own.name
                and method in ("GET", "DELETE")
            )
            if not mine:
                return self._error(
                    401,
                    "UNAUTHENTICATED",
                    "Request is missing required authentication credential.",
                    "required",
                )
        body = json.loads(raw) if raw else {}
        try:
            self._route(method, rest, query, body, by="self" if account is None else "account")
        except (ValueError, KeyError) as e:
            self._error(400, "INVALID_ARGUMENT", str(e), "invalid")

    def _route(
        self, method: str, rest: list[str], query: dict[str, str], body: Any, by: str
    ) -> None:
        lab = self.gcp
        if rest == ["zones"] and method == "GET":
            return self._send(
                200,
                {
                    "kind": "compute#zoneList",
                    "items": [
                        {
                            "kind": "compute#zone",
                            "name": z,
                            "status": "UP",
                            "region": f"{lab.base()}/regions/{z.rsplit('-', 1)[0]}",
                        }
                        for z in ZONES
                    ],
                },
            )
        if rest[:1] == ["aggregated"] and method == "GET" and len(rest) == 2:
            kind = rest[1]
            items: dict[str, Any] = {}
            for zone in ZONES:
                if kind == "machineTypes":
                    rows = [
                        {
                            "kind": "compute#machineType",
                            "name": n,
                            "guestCpus": c,
                            "memoryMb": m,
                            "zone": zone,
                        }
                        for n, (c, m) in MACHINE_TYPES.items()
                    ]
                    items[f"zones/{zone}"] = {"machineTypes": rows}
                elif kind == "acceleratorTypes":
                    rows = [
                        {"kind": "compute#acceleratorType", "name": a, "zone": zone}
                        for a in ACCELERATOR_TYPES
                    ]
                    items[f"zones/{zone}"] = {"acceleratorTypes": rows}
                elif kind == "instances":
                    with lab._lock:
                        found = [
                            lab.instance_json(i) for i in lab.instances.values() if i.zone == zone
                        ]
                    found = [i for i in found if _matches(i, query.get("filter", ""))]
                    items[f"zones/{zone}"] = (
                        {"instances": found}
                        if found
                        else {"warning": {"code": "NO_RESULTS_ON_PAGE", "message": "none"}}
                    )
                else:
                    return self._error(404, "NOT_FOUND", f"no aggregated {kind}")
            return self._send(200, {"kind": f"compute#{kind}AggregatedList", "items": items})
        if len(rest) >= 3 and rest[0] == "zones" and rest[1] in ZONES:
            zone = rest[1]
            if rest[2] == "instances" and len(rest) == 3:
                if method == "POST":
                    op = lab.insert(zone, body, query.get("requestId", ""))
                    return self._send(200, lab.operation_json(op))
                if method == "GET":
                    with lab._lock:
                        rows = [
                            lab.instance_json(i) for i in lab.instances.values() if i.zone == zone
                        ]
                    rows = [r for r in rows if _matches(r, query.get("filter", ""))]
                    return self._send(200, {"kind": "compute#instanceList", "items": rows})
            if rest[2] == "instances" and len(rest) >= 4:
                with lab._lock:
                    inst = lab.instances.get((zone, rest[3]))
                if inst is None:
                    return self._error(
                        404,
                        "NOT_FOUND",
                        f"The resource 'projects/{PROJECT}/zones/{zone}/instances/{rest[3]}' "
                        "was not found",
                        "notFound",
                    )
                if len(rest) == 4 and method == "GET":
                    return self._send(200, lab.instance_json(inst))
                if len(rest) == 4 and method == "DELETE":
                    return self._send(200, lab.operation_json(lab.delete(inst, by)))
                if rest[4:] in (["stop"], ["start"]) and method == "POST":
                    return self._send(200, lab.operation_json(lab.power(inst, rest[4])))
                if rest[4:] == ["setMetadata"] and method == "POST":
                    if body.get("fingerprint") != _fingerprint(inst.body.get("metadata")):
                        return self._error(
                            412,
                            "FAILED_PRECONDITION",
                            "Supplied fingerprint does not match current metadata fingerprint.",
                            "conditionNotMet",
                        )
                    with inst.lock:
                        items = [{"key": i["key"], "value": i["value"]} for i in body["items"]]
                        inst.body["metadata"] = {"items": items}
                    op = Operation(
                        f"operation-{secrets.token_hex(8)}", zone, "setMetadata", inst.name
                    )
                    op.done.set()
                    with lab._lock:
                        lab.operations[op.name] = op
                    return self._send(200, lab.operation_json(op))
                if rest[4:] == ["getGuestAttributes"] and method == "GET":
                    path = query.get("queryPath", "")
                    found = [
                        {"namespace": ns, "key": k, "value": v}
                        for (ns, k), v in sorted(inst.guest.items())
                        if f"{ns}/{k}".startswith(path)
                    ]
                    if not found:
                        return self._error(
                            404,
                            "NOT_FOUND",
                            f"The resource 'projects/{PROJECT}/zones/{zone}/instances/"
                            f"{inst.name}/guestAttributes/{path}' was not found",
                            "notFound",
                        )
                    return self._send(
                        200,
                        {
                            "kind": "compute#guestAttributes",
                            "queryPath": path,
                            "queryValue": {"items": found},
                        },
                    )
            if rest[2] == "operations" and len(rest) >= 4:
                with lab._lock:
                    op = lab.operations.get(rest[3])
                if op is None or op.zone != zone:
                    return self._error(404, "NOT_FOUND", f"no operation {rest[3]}", "notFound")
                if rest[4:] == ["wait"] and method == "POST":
                    op.done.wait(2.0)
                    return self._send(200, lab.operation_json(op))
                if len(rest) == 4 and method == "GET":
                    return self._send(200, lab.operation_json(op))
        return self._error(404, "NOT_FOUND", f"no route {method} {'/'.join(rest)}")


class _MetadataHandler(_Handler):
    def _serve(self, method: str) -> None:
        lab = self.gcp
        path = urlparse(self.path).path
        raw = self._raw()
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._send(403, "Missing required header: Metadata-Flavor", text=True)
        inst = lab.by_address(self.client_address[0])
        if inst is None or not path.startswith("/computeMetadata/v1/"):
            return self._send(404, "not found", text=True)
        key = path[len("/computeMetadata/v1/") :]
        if method == "PUT" and key.startswith("instance/guest-attributes/"):
            ns, _, name = key[len("instance/guest-attributes/") :].partition("/")
            inst.guest[(ns, name)] = raw.decode()
            return self._send(200, "", text=True)
        values = {
            "instance/name": inst.name,
            "instance/hostname": f"{inst.name}.{inst.zone}.c.{PROJECT}.internal",
            "instance/zone": f"projects/123456789/zones/{inst.zone}",
            "instance/id": str(inst.id),
            "project/project-id": PROJECT,
            "instance/preempted": "TRUE" if inst.preempted else "FALSE",
        }
        if key == "instance/service-accounts/default/token":
            return self._send(
                200, {"access_token": inst.token, "expires_in": 3599, "token_type": "Bearer"}
            )
        if key.startswith("instance/attributes/"):
            value = inst.metadata(key[len("instance/attributes/") :])
            if value is None:
                return self._send(404, "not found", text=True)
            return self._send(200, value, text=True)
        if key in values:
            return self._send(200, values[key], text=True)
        return self._send(404, "not found", text=True)


def gcp_unavailable() -> str | None:
    return lab_unavailable()


@pytest.fixture(name="gcp_lab")
def gcp_lab_fixture() -> Iterator[GcpLab]:
    """A fresh Compute Engine per test."""
    pytest.importorskip("google.cloud.compute_v1")
    yield from GcpLab.running()


__all__ = ["ACCOUNT", "PROJECT", "GcpLab", "gcp_lab_fixture"]
