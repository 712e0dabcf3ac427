"""A RunPod cloud on this machine: a stand-in for its GraphQL API and REST API v1 whose
pods boot.

No emulator of RunPod exists, so this is a small one, serving what the official client
``runpod`` (``runpod-python`` 1.12.0, pinned in the test extra) and flotilla send:

* the endpoints: GraphQL at ``$RUNPOD_API_BASE_URL/graphql`` (``api/graphql.py``
  ``run_graphql_query``), REST v1 at ``$RUNPOD_API_BASE_URL/v1`` (the repository's
  ``api/rest.py`` ``_build_url``: ``RUNPOD_API_BASE_URL`` + path; flotilla reads
  ``RUNPOD_REST_API_BASE_URL`` first); the key as ``Authorization: Bearer`` (also
  ``?api_key=``, the older clients'); a refused key is a 401;
* GraphQL (``_graphql.py`` parses the documents): ``gpuTypes(input: {id})`` with
  ``id displayName memoryInGb secureCloud communityCloud maxGpuCount securePrice
  communityPrice secureSpotPrice communitySpotPrice lowestPrice(input: {gpuCount,
  secureCloud}) {minimumBidPrice uninterruptablePrice stockStatus}`` (``queries/gpus.py``);
  ``myself { id pods {...} }`` and ``pod(input: {podId})`` with the fields of
  ``queries/pods.py`` (``runtime { ports { ip isIpPublic privatePort publicPort type } }``,
  null until the pod runs); ``podFindAndDeployOnDemand(input)``, ``podRentInterruptable
  (input)`` (``mutations/pods.py``: ``name imageName gpuTypeId cloudType gpuCount
  dataCenterId dockerArgs ports env [{key, value}] startSsh supportPublicIp``...),
  ``podTerminate(input: {podId})``, ``podStop(input: {podId})`` and ``podResume(input:
  {podId, gpuCount})`` (``stop_pod``/``resume_pod``: ``id desiredStatus imageName env
  machineId machine {podHostId}``);
* REST v1 (RunPod's published OpenAPI, ``rest.runpod.io/v1``): ``POST /pods`` (``name
  imageName gpuTypeIds gpuCount cloudType dataCenterIds interruptible globalNetworking
  supportPublicIp ports dockerStartCmd env{} containerDiskInGb``), ``GET /pods``,
  ``GET /pods/{id}``, ``DELETE /pods/{id}``, ``PATCH /pods/{id}`` (``name``); a pod:
  ``id name desiredStatus publicIp portMappings{"22": port} costPerHr interruptible
  gpu{id count displayName} machine{dataCenterId} env image volumeInGb volumeMountPath``;
* no capacity: RunPod's own message, "There are no longer any instances available with
  the requested specifications. Please refresh and try again." (GraphQL ``errors``, REST
  500).

Inside a pod, as on RunPod: ``RUNPOD_POD_ID``, ``RUNPOD_API_KEY`` (a key for that pod
only: reading and terminating it), ``RUNPOD_PUBLIC_IP``, ``RUNPOD_TCP_PORT_22``,
``PUBLIC_KEY`` and the env given.

Pods: each data center has a public subnet (the lab bridge); creating a pod makes a
network-namespace host at once, and ``boot_delay`` s later runs its start command (REST
``dockerStartCmd``, GraphQL ``dockerArgs``; none: the image's, which starts sshd) as root
with its own /root, /tmp, /etc/ssh and /run. The image's sshd configuration makes sshd
listen ONLY on the public address and the pod's mapped port (what RunPod's NAT of port
22 gives), with whatever host key is in ``/etc/ssh`` and ~/.ssh/authorized_keys; then the
pod runs and its address and port are reported. Pods with ``globalNetworking`` are on
one private network (a bridge of its own) and reach each other at
``{pod id}.runpod.internal`` (each pod's /etc/hosts, standing in for RunPod's DNS).
Terminating a pod stops its host and everything in it. Stopping one (``podStop``:
``desiredStatus`` EXITED) stops everything in it, gives its GPUs back to the data center
and wipes its container disk (its /root, /etc/ssh, /tmp), keeping only its volume disk
(``volumeInGb``, mounted at ``volumeMountPath``; the stand-in mounts it only under /root,
the pod's own, and refuses other paths): ``podResume`` takes GPUs again (RunPod's "There
are not enough free GPUs on the host machine to start this pod." when none is free) and
boots it ``boot_delay`` s later with its start command, at the same address and port.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import pytest
from _graphql import GraphQLError, execute
from _hosts import SSHD, TestHost, free_subnet, keygen
from _standin import PATH, SSHD_OPTIONS, JsonHandler, StandIn, nvidia_smi

API_KEY = "rp-test-key-0123456789abcdef"
"""The account's key the lab's tests use."""
NO_GPUS_TO_RESUME = "There are not enough free GPUs on the host machine to start this pod."
NO_CAPACITY = (
    "There are no longer any instances available with the requested specifications. "
    "Please refresh and try again."
)


@dataclass
class GpuType:
    """A GPU type on the lab's market and how many pods of it each data center can hold."""

    id: str
    display_name: str
    memory_gb: int
    secure_price: float = 1.5
    community_price: float = 1.0
    secure_spot_price: float = 0.8
    community_spot_price: float = 0.5
    stock: dict[str, int] = field(default_factory=lambda: {"EU-RO-1": 4})
    community_stock: dict[str, int] = field(default_factory=lambda: {"EU-RO-1": 4})
    secure: bool = True
    community: bool = True


@dataclass
class Pod:
    id: str
    name: str
    gpu: GpuType
    count: int
    data_center: str
    cloud: str
    interruptible: bool
    image: str
    command: list[str] | None  # REST dockerStartCmd
    docker_args: str  # GraphQL dockerArgs
    env: dict[str, str]
    global_net: bool
    key: str  # the pod's RUNPOD_API_KEY
    addr: str
    port: int
    price: float
    status: str = "RUNNING"
    running: bool = False
    host: TestHost | None = None
    private: str = ""
    volume_gb: int = 0
    volume_path: str = "/workspace"
    holds_gpus: bool = True
    stopped: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    created_at: float = field(default_factory=time.monotonic)
    booted_at: float = 0.0


class RunPodLab(StandIn):
    """The stand-in API server and its pods (see the module docstring). A context manager;
    ``url`` and ``env`` (``RUNPOD_API_BASE_URL``, ``RUNPOD_API_KEY``) are what a client
    needs."""

    def __init__(self, boot_delay: float = 0.5) -> None:
        super().__init__(boot_delay)
        self.gpus: dict[str, GpuType] = {}
        self.pods: dict[str, Pod] = {}
        self.creates: list[dict[str, Any]] = []  # every create request's input
        self.destroyed: dict[str, str] = {}  # pod id -> "account" | "self"
        self.failing: dict[tuple[str, str], int] = {}
        self._count = 0
        self.bridge = ""
        self.private_subnet = ""

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        self.lab.start()
        self.url = f"http://{self.addr}:{self.serve(_Handler, 'runpod')}"
        self.private_subnet = free_subnet(os.getpid() + 97)
        self.bridge = self.add_bridge(f"flb{self.lab.tag}g"[:15])
        self.set_env(
            {"RUNPOD_API_BASE_URL": self.url, "RUNPOD_API_KEY": API_KEY},
            clear=["RUNPOD_REST_API_BASE_URL"],
        )

    def close(self) -> None:
        self.closing = True
        for pod in list(self.pods.values()):
            self._stop(pod)
        self.bridge = ""
        self.shut()

    # -- the market ------------------------------------------------------------------
    def add_gpu(self, gpu_id: str, display: str, memory_gb: int, **fields: Any) -> GpuType:
        with self._lock:
            gpu = GpuType(gpu_id, display, memory_gb, **fields)
            self.gpus[gpu_id] = gpu
        return gpu

    def live(self, which: str = "") -> list[Pod]:
        """The pods not terminated (whose name starts with ``which``)."""
        with self._lock:
            return [p for p in self.pods.values() if p.name.startswith(which)]

    # -- pods ------------------------------------------------------------------------
    def create(self, spec: dict[str, Any]) -> Pod:
        """A pod for ``spec`` (the REST body's fields); GraphQLError(NO_CAPACITY) when no
        data center allowed has room."""
        path = str(spec.get("volumeMountPath") or "/workspace")
        if spec.get("volumeInGb") and not path.startswith("/root/"):
            raise GraphQLError(f"the stand-in mounts volumes under /root only, not {path}")
        with self._lock:
            self.creates.append(spec)
            cloud = str(spec.get("cloudType") or "SECURE").upper()
            count = int(spec.get("gpuCount") or 1)
            centers = list(spec.get("dataCenterIds") or [])
            for gpu_id in spec.get("gpuTypeIds") or []:
                gpu = self.gpus.get(gpu_id)
                if gpu is None:
                    raise GraphQLError(f"There is no GPU type {gpu_id!r}")
                if (cloud == "SECURE" and not gpu.secure) or (
                    cloud == "COMMUNITY" and not gpu.community
                ):
                    continue
                stock = gpu.stock if cloud == "SECURE" else gpu.community_stock
                for dc, free in stock.items():
                    if free >= 1 and (not centers or dc in centers):
                        stock[dc] -= 1
                        return self._new_pod(gpu, count, dc, cloud, spec)
            raise GraphQLError(NO_CAPACITY)

    def _new_pod(self, gpu: GpuType, count: int, dc: str, cloud: str, spec: dict[str, Any]) -> Pod:
        self._count += 1
        n = self._count
        spot = bool(spec.get("interruptible"))
        price = (
            (gpu.secure_spot_price if spot else gpu.secure_price)
            if cloud == "SECURE"
            else (gpu.community_spot_price if spot else gpu.community_price)
        )
        pod = Pod(
            id=f"{secrets.token_hex(5)}{n}",
            name=str(spec.get("name") or ""),
            gpu=gpu,
            count=count,
            data_center=dc,
            cloud=cloud,
            interruptible=spot,
            image=str(spec.get("imageName") or ""),
            command=spec.get("dockerStartCmd"),
            docker_args=str(spec.get("dockerArgs") or ""),
            env={str(k): str(v) for k, v in dict(spec.get("env") or {}).items()},
            global_net=bool(spec.get("globalNetworking")),
            key="rp-pod-" + secrets.token_hex(12),
            addr=f"{self.lab.subnet}.{10 + n}",
            port=41000 + n,
            price=round(price * count, 4),
            volume_gb=int(spec.get("volumeInGb") or 0),
            volume_path=str(spec.get("volumeMountPath") or "/workspace"),
        )
        if pod.global_net:
            pod.private = f"{self.private_subnet}.{10 + n}"
        self.pods[pod.id] = pod
        threading.Thread(target=self._life, args=(pod,), daemon=True).start()
        return pod

    def terminate(self, pod: Pod, by: str) -> None:
        with self._lock:
            if self.pods.pop(pod.id, None) is None:
                return
            self.destroyed[pod.id] = by
            if pod.holds_gpus:
                self._stock(pod)[pod.data_center] += 1
        threading.Thread(target=self._stop, args=(pod,), daemon=True).start()
        self._write_hosts()

    def _stock(self, pod: Pod) -> dict[str, int]:
        stock = pod.gpu.stock if pod.cloud == "SECURE" else pod.gpu.community_stock
        stock.setdefault(pod.data_center, 0)
        return stock

    def stop(self, pod: Pod) -> None:
        """``podStop``: everything in it stopped, its GPUs given back, its container disk
        wiped; its volume kept."""
        with self._lock:
            if pod.holds_gpus:
                self._stock(pod)[pod.data_center] += 1
                pod.holds_gpus = False
            pod.status = "EXITED"
        with pod.lock:
            pod.running = False
            host = pod.host
            if host is not None:
                self.kill_processes(host)
                for disk in ("home", "etc-ssh", "bin"):
                    shutil.rmtree(host.folder / disk, ignore_errors=True)
                (host.folder / "etc-ssh").mkdir()

    def resume(self, pod: Pod) -> None:
        """``podResume``: its GPUs taken again (GraphQLError when none is free), booted
        ``boot_delay`` s later."""
        with self._lock:
            if pod.status != "EXITED":
                raise GraphQLError(f"Pod {pod.id} is not stopped")
            stock = self._stock(pod)
            if stock[pod.data_center] < 1:
                raise GraphQLError(NO_GPUS_TO_RESUME)
            stock[pod.data_center] -= 1
            pod.holds_gpus = True
            pod.status = "RUNNING"
        since = time.monotonic()

        def boot() -> None:
            if pod.stopped.wait(max(0.0, since + self.boot_delay - time.monotonic())):
                return
            with pod.lock:
                if pod.stopped.is_set() or self.closing or pod.status != "RUNNING":
                    return
                assert pod.host is not None
                self._boot(pod, pod.host)
                pod.booted_at = time.monotonic()
                pod.running = True
            self._write_hosts()

        threading.Thread(target=boot, daemon=True).start()

    def _life(self, pod: Pod) -> None:
        with pod.lock:
            if pod.stopped.is_set():
                return
            host = self.lab.new_host(self._count_of(pod), pod.addr, pod.id)
            pod.host = host
            (host.folder / "etc-ssh").mkdir()
            if pod.global_net:
                veth = f"flv{self.lab.tag}p{self._count_of(pod)}"[-15:]
                self.plug(host, self.bridge, veth, "gn0", pod.private)
        if pod.stopped.wait(max(0.0, pod.created_at + self.boot_delay - time.monotonic())):
            return
        with pod.lock:
            if pod.stopped.is_set() or self.closing:
                return
            self._boot(pod, host)
            pod.booted_at = time.monotonic()
            pod.running = True
        self._write_hosts()

    def _count_of(self, pod: Pod) -> int:
        return pod.port - 41000

    def _hosts_text(self, pod: Pod) -> str:
        lines = ["127.0.0.1 localhost", f"{pod.addr} {pod.id}"]
        with self._lock:
            lines += [
                f"{p.private} {p.id}.runpod.internal"
                for p in self.pods.values()
                if p.global_net and p.private and pod.global_net
            ]
        return "\n".join(lines) + "\n"

    def _write_hosts(self) -> None:
        """Every running pod's /etc/hosts: its peers on the global network (RunPod's DNS),
        rewritten in place (the file is bind-mounted)."""
        for pod in self.live():
            host = pod.host
            if host is not None and pod.running:
                with contextlib.suppress(OSError), open(host.folder / "hosts", "r+") as f:
                    f.truncate(0)
                    f.write(self._hosts_text(pod))

    def _boot(self, pod: Pod, host: TestHost) -> None:
        """The pod's start command in its container; the image's sshd configuration."""
        etc = host.folder / "etc-ssh"
        bin_dir = nvidia_smi(host.folder, [pod.gpu.display_name] * pod.count, pod.id)
        path = f"{bin_dir}:{PATH}"
        (etc / "sshd_config").write_text(
            f"SetEnv PATH={path}\n"
            f"ListenAddress {pod.addr}:{pod.port}\n"
            "HostKey /etc/ssh/ssh_host_ed25519_key\n"
            "PidFile /run/sshd.pid\n"
            "AuthorizedKeysFile .ssh/authorized_keys\n" + SSHD_OPTIONS
        )
        keygen(etc / "ssh_host_ed25519_key", pod.id)  # the image's own key
        image_start = (  # what RunPod's images' /start.sh does: PUBLIC_KEY, then sshd
            'mkdir -p ~/.ssh && echo "$PUBLIC_KEY" >> ~/.ssh/authorized_keys && '
            f"mkdir -p /run/sshd && exec {SSHD} -D -e"
        )
        if pod.command:
            argv = [str(a) for a in pod.command]
        elif pod.docker_args:
            argv = ["sh", "-c", pod.docker_args]
        else:
            argv = ["sh", "-c", image_start]
        script = host.folder / "start.json"
        script.write_text(json.dumps(argv))
        env = {
            "PATH": path,
            "HOME": "/root",
            **pod.env,
            "RUNPOD_POD_ID": pod.id,
            "RUNPOD_API_KEY": pod.key,
            "RUNPOD_PUBLIC_IP": pod.addr,
            "RUNPOD_TCP_PORT_22": str(pod.port),
            "RUNPOD_DC_ID": pod.data_center,
        }
        volume = ""
        if pod.volume_gb:  # the volume disk, kept when the pod stops
            (host.folder / "volume").mkdir(exist_ok=True)
            disk = host.folder / "volume"
            volume = f"mkdir -p {pod.volume_path} && mount --bind {disk} {pod.volume_path} && "
        start = (
            f"{volume}mount --bind {etc} /etc/ssh && mount -t tmpfs -o mode=755 tmpfs /run && "
            f"cd / && exec python3 -c 'import json,os,sys; a=json.load(open(sys.argv[1])); "
            f"os.execvp(a[0], a)' {script}"
        )
        self.lab.start_daemon(
            host,
            start,
            "pod.log",
            hosts_text=self._hosts_text(pod),
            env=env,
            own_files=[etc, script],
        )

    def _stop(self, pod: Pod) -> None:
        pod.stopped.set()
        with pod.lock:
            self.stop_host(pod.host)
            pod.host = None

    def log(self, pod_id: str) -> str:
        """What the pod's start command, watchdog and guard said."""
        return self.logs("h*/pod.log", "h*/home/.flotilla/**/*.log")

    # -- JSON views ------------------------------------------------------------------
    def gpu_json(self, gpu: GpuType) -> dict[str, Any]:
        free = sum(gpu.stock.values()) + sum(gpu.community_stock.values())

        def lowest(args: dict[str, Any]) -> dict[str, Any]:
            given = args.get("input") or {}
            n = int(given.get("gpuCount") or 1)
            secure = given.get("secureCloud")
            on_demand = gpu.secure_price if secure or secure is None else gpu.community_price
            spot = gpu.secure_spot_price if secure or secure is None else gpu.community_spot_price
            if secure is None:
                on_demand = min(gpu.secure_price, gpu.community_price)
                spot = min(gpu.secure_spot_price, gpu.community_spot_price)
            return {
                "minimumBidPrice": round(spot * n, 4),
                "uninterruptablePrice": round(on_demand * n, 4),
                "stockStatus": "High" if free >= 3 else ("Low" if free else None),
                "totalCount": free,
                "rentedCount": 0,
                "minVcpu": 8,
                "minMemory": 32,
            }

        return {
            "id": gpu.id,
            "displayName": gpu.display_name,
            "memoryInGb": gpu.memory_gb,
            "manufacturer": "AMD" if gpu.id.startswith("AMD") else "Nvidia",
            "cudaCores": 0,
            "secureCloud": gpu.secure,
            "communityCloud": gpu.community,
            "maxGpuCount": 8,
            "maxGpuCountSecureCloud": 8,
            "maxGpuCountCommunityCloud": 8,
            "securePrice": gpu.secure_price,
            "communityPrice": gpu.community_price,
            "secureSpotPrice": gpu.secure_spot_price,
            "communitySpotPrice": gpu.community_spot_price,
            "oneMonthPrice": None,
            "threeMonthPrice": None,
            "oneWeekPrice": None,
            "lowestPrice": lowest,
            "nodeGroupDatacenters": [{"id": dc} for dc, n in gpu.stock.items() if n > 0],
        }

    def pod_rest(self, pod: Pod) -> dict[str, Any]:
        return {
            "id": pod.id,
            "name": pod.name,
            "desiredStatus": pod.status,
            "publicIp": pod.addr if pod.running else "",
            "portMappings": {"22": pod.port} if pod.running else {},
            "ports": ["22/tcp"],
            "costPerHr": pod.price,
            "adjustedCostPerHr": pod.price,
            "interruptible": pod.interruptible,
            "image": pod.image,
            "env": dict(pod.env),
            "gpu": {"id": pod.gpu.id, "count": pod.count, "displayName": pod.gpu.display_name},
            "machine": {"dataCenterId": pod.data_center, "gpuTypeId": pod.gpu.id},
            "machineId": f"m-{pod.data_center}-{pod.port}",
            "globalNetworking": pod.global_net,
            "volumeInGb": pod.volume_gb,
            "volumeMountPath": pod.volume_path,
        }

    def pod_graphql(self, pod: Pod) -> dict[str, Any]:
        ports = (
            [
                {
                    "ip": pod.addr,
                    "isIpPublic": True,
                    "privatePort": 22,
                    "publicPort": pod.port,
                    "type": "tcp",
                }
            ]
            if pod.running
            else []
        )
        return {
            "id": pod.id,
            "name": pod.name,
            "containerDiskInGb": 20,
            "costPerHr": pod.price,
            "desiredStatus": pod.status,
            "dockerArgs": pod.docker_args,
            "dockerId": None,
            "env": [f"{k}={v}" for k, v in pod.env.items()],
            "gpuCount": pod.count,
            "imageName": pod.image,
            "lastStatusChange": "",
            "machineId": f"m-{pod.data_center}-{pod.port}",
            "memoryInGb": 32,
            "podType": "INTERRUPTABLE" if pod.interruptible else "RESERVED",
            "port": None,
            "ports": "22/tcp",
            "uptimeSeconds": 0,
            "vcpuCount": 8,
            "volumeInGb": pod.volume_gb,
            "volumeMountPath": pod.volume_path,
            "runtime": {"ports": ports} if pod.running else None,
            "machine": {"gpuDisplayName": pod.gpu.display_name, "podHostId": f"{pod.id}-host"},
        }


def _graphql_input(given: dict[str, Any], interruptible: bool) -> dict[str, Any]:
    """A GraphQL deploy input as the REST body's fields."""
    env = {str(e["key"]): str(e["value"]) for e in given.get("env") or []}
    return {
        "name": given.get("name"),
        "imageName": given.get("imageName"),
        "gpuTypeIds": [given.get("gpuTypeId")],
        "gpuCount": given.get("gpuCount") or 1,
        "cloudType": "SECURE" if given.get("cloudType") in (None, "ALL") else given["cloudType"],
        "dataCenterIds": [given["dataCenterId"]] if given.get("dataCenterId") else [],
        "dockerArgs": given.get("dockerArgs") or "",
        "env": env,
        "interruptible": interruptible,
        "volumeInGb": given.get("volumeInGb") or 0,
        "volumeMountPath": given.get("volumeMountPath"),
    }


class _Handler(JsonHandler):
    runpod: RunPodLab

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def _serve(self, method: str) -> None:
        lab = self.runpod
        path = urlparse(self.path).path
        lab.requests.append((method, path))
        raw = self._raw()
        with lab._lock:
            if lab.failing.get((method, path), 0) > 0:
                lab.failing[(method, path)] -= 1
                return self._send(500, {"error": "internal server error", "status": 500})
        key = self._key()
        own = re.fullmatch(r"/v1/pods/([^/]+)", path)
        if key != API_KEY:
            with lab._lock:  # a pod's own RUNPOD_API_KEY: that pod only
                pod = next((p for p in lab.pods.values() if p.key == key), None)
            if pod is None or not own or own[1] != pod.id or method not in ("GET", "DELETE"):
                return self._send(401, {"error": "Unauthorized", "status": 401})
            return self._pod(method, pod, "self")
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return self._send(400, {"error": "invalid JSON", "status": 400})
        if path == "/graphql" and method == "POST":
            return self._graphql(body)
        if path == "/v1/pods" and method == "POST":
            try:
                pod = lab.create(body)
            except GraphQLError as e:
                return self._send(500, {"error": f"create pod: {e}", "status": 500})
            return self._send(201, lab.pod_rest(pod))
        if path == "/v1/pods" and method == "GET":
            with lab._lock:
                return self._send(200, [lab.pod_rest(p) for p in lab.pods.values()])
        if own and method == "PATCH":
            with lab._lock:
                pod = lab.pods.get(own[1])
                if pod is not None and "name" in body:
                    pod.name = str(body["name"])
            if pod is None:
                return self._send(404, {"error": "pod not found", "status": 404})
            return self._send(200, lab.pod_rest(pod))
        if own and method in ("GET", "DELETE"):
            with lab._lock:
                pod = lab.pods.get(own[1])
            return self._pod(method, pod, "account")
        return self._send(404, {"error": "not found", "status": 404})

    def _pod(self, method: str, pod: Pod | None, by: str) -> None:
        if pod is None:
            return self._send(404, {"error": "pod not found", "status": 404})
        if method == "GET":
            return self._send(200, self.runpod.pod_rest(pod))
        self.runpod.terminate(pod, by)
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _graphql(self, body: dict[str, Any]) -> None:
        lab = self.runpod

        def gpu_types(args: dict[str, Any]) -> list[dict[str, Any]]:
            wanted = (args.get("input") or {}).get("id")
            with lab._lock:
                return [lab.gpu_json(g) for g in lab.gpus.values() if wanted in (None, g.id)]

        def myself(args: dict[str, Any]) -> dict[str, Any]:
            with lab._lock:
                pods = [lab.pod_graphql(p) for p in lab.pods.values()]
            return {"id": "user-1", "email": "lab@example.com", "pods": pods, "pubKey": ""}

        def pod(args: dict[str, Any]) -> dict[str, Any] | None:
            with lab._lock:
                found = lab.pods.get(str((args.get("input") or {}).get("podId")))
                return lab.pod_graphql(found) if found else None

        def deploy(interruptible: bool) -> Any:
            def run_(args: dict[str, Any]) -> dict[str, Any]:
                created = lab.create(_graphql_input(args.get("input") or {}, interruptible))
                return lab.pod_graphql(created)

            return run_

        def found_pod(args: dict[str, Any]) -> Pod:
            with lab._lock:
                found = lab.pods.get(str((args.get("input") or {}).get("podId")))
            if found is None:
                raise GraphQLError("pod not found")
            return found

        def terminate(args: dict[str, Any]) -> None:
            lab.terminate(found_pod(args), "account")

        def stop(args: dict[str, Any]) -> dict[str, Any]:
            found = found_pod(args)
            lab.stop(found)
            return lab.pod_graphql(found)

        def resume(args: dict[str, Any]) -> dict[str, Any]:
            found = found_pod(args)
            lab.resume(found)
            return lab.pod_graphql(found)

        answer = execute(
            str(body.get("query") or ""),
            body.get("variables"),
            {"gpuTypes": gpu_types, "myself": myself, "pod": pod},
            {
                "podFindAndDeployOnDemand": deploy(False),
                "podRentInterruptable": deploy(True),
                "podTerminate": terminate,
                "podStop": stop,
                "podResume": resume,
            },
        )
        self._send(200, answer)


@pytest.fixture(name="runpod_lab")
def runpod_lab_fixture() -> Iterator[RunPodLab]:
    """A fresh RunPod per test (GPU types added by the test)."""
    yield from RunPodLab.running()


__all__ = ["API_KEY", "NO_CAPACITY", "RunPodLab", "runpod_lab_fixture"]
