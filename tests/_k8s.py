"""A real Kubernetes control plane on this machine: etcd, kube-apiserver and kube-scheduler,
with the tests' own node agent standing in for the kubelets.

``K8sLab`` builds it (root only) and tears everything down, also after failures::

    with K8sLab(nodes=[NodeSpec("n1"), NodeSpec("n2", gpus=1)]) as lab:
        lab.kubeconfig      # a kubeconfig for this API server (context "flotilla-lab")
        lab.kubectl("get", "nodes")

What is real: ``etcd`` (Debian's etcd-server), ``kube-apiserver``, ``kube-scheduler`` and
``kubectl``, upstream v1.20 built from Debian bookworm's ``kubernetes`` source package by
``tests/k8s/build.sh`` into a cache outside the checkout (``/var/cache/flotilla-k8s``, or
``$FLOTILLA_K8S_CACHE``): the first run on a machine builds them (about 10 minutes), later
runs start in seconds. What is stood in: the kubelets, by ``tests/k8s/node/main.go`` (one
process serving every node of the lab; see its header): it registers the Node objects, runs
each bound pod's command as a host process in its own network namespace with a pod IP on the
lab's bridge, reports pod status, kills a deleted pod's processes, and serves exec with the
kubelet's own streaming code, which the real API server proxies ``kubectl exec`` to.

Each lab has unique names (the pid: netns ``flotilla-<pid>k-h<slot>``, links
``flb<pid>k``/``flv<pid>kx<slot>``, which ``_hosts.remove_stale_labs`` also cleans after a
killed run), its own free /24 in 10.x, free ports and one temporary folder.

The pytest fixture ``k8s_lab`` (session scope, 3 nodes of 4 CPUs, the third with one
``nvidia.com/gpu`` labelled ``a100``) wraps it; test modules import it:
``from _k8s import k8s_lab_fixture  # noqa: F401``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _hosts import (
    LabError,
    SharedLab,
    add_bridge,
    free_subnet,
    next_lab_tag,
    remove_stale_labs,
    run,
)
from _lifecycle import Lifecycle

from flotilla._system.procs import die_with_parent

HERE = Path(__file__).resolve().parent
BUILD = HERE / "k8s" / "build.sh"
CONTEXT = "flotilla-lab"
TOKEN = "flotilla-lab-admin-token"
USER_TOKEN = "flotilla-lab-dev-token"
"""A user with no rights but those a test grants it (user ``dev``, see user_kubeconfig())."""


def lab_unavailable() -> str | None:
    """Why no lab can be built here (None: it can)."""
    if os.geteuid() != 0:
        return "the Kubernetes lab needs root (network namespaces, a bridge, apt-get)"
    if shutil.which("apt-get") is None and not _cached_bin():
        return "the Kubernetes lab builds from Debian's kubernetes source package (needs apt-get)"
    return None


def _cached_bin() -> Path | None:
    cache = Path(os.environ.get("FLOTILLA_K8S_CACHE", "/var/cache/flotilla-k8s"))
    version = cache / "version"
    if not version.exists():
        return None
    return cache / version.read_text().strip() / "bin"


def binaries() -> Path:
    """The folder with kube-apiserver, kube-scheduler, kubectl and flotilla-k8s-node, built
    into the cache first when missing (tests/k8s/build.sh)."""
    proc = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"building the Kubernetes lab failed: {proc.stderr.strip()[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1]) / "bin"


_build_error: str | None = None


def prepare() -> None:
    """Build the binaries now when they are missing (see conftest); a failure is kept for
    the fixture to report."""
    global _build_error
    if lab_unavailable() is None:
        try:
            binaries()
        except LabError as e:
            _build_error = str(e)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class NodeSpec:
    """One node of the lab: its name, CPUs, memory and GPUs (labelled ``accelerator``)."""

    name: str
    cpu: str = "4"
    memory: str = "8Gi"
    gpus: int = 0
    accelerator: str = ""


DEFAULT_NODES = (
    NodeSpec("node-1"),
    NodeSpec("node-2"),
    NodeSpec("node-3", gpus=1, accelerator="a100"),
)


class K8sLab(Lifecycle):
    """etcd + kube-apiserver + kube-scheduler + the node stand-in; a context manager that
    removes everything it made."""

    def __init__(self, nodes: tuple[NodeSpec, ...] = DEFAULT_NODES) -> None:
        self.nodes = nodes
        self.tag = next_lab_tag()  # unique among every lab of this process
        self.bridge = f"flb{self.tag}"[:15]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dir = Path(tempfile.mkdtemp(prefix="flotilla-k8s-"))
        self.kubeconfig = self.dir / "kubeconfig"
        self.bin = Path()
        self.subnet = ""
        self.server = ""

    # -- helpers -----------------------------------------------------------------------
    @property
    def kubectl_path(self) -> str:
        return str(self.bin / "kubectl")

    def env(self) -> dict[str, str]:
        """os.environ with this lab's kubectl first on PATH and KUBECONFIG set."""
        return {
            **os.environ,
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "KUBECONFIG": str(self.kubeconfig),
        }

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        proc = subprocess.run(
            [self.kubectl_path, f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=60,
        )
        if check and proc.returncode != 0:
            raise LabError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def get_json(self, *args: str) -> dict[str, object]:
        out: dict[str, object] = json.loads(self.kubectl("get", *args, "-o", "json"))
        return out

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        # a killed test run takes its lab along (the node agent stops its pods on SIGTERM)
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM, None),
        )
        log.close()
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def _wait(self, what: str, ok: object, timeout: float, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(ok) and ok():
                return
            if proc.poll() is not None:
                raise LabError(f"{what} exited ({proc.returncode}): {self.log(what)}")
            time.sleep(0.1)
        raise LabError(f"{what} not ready within {timeout:g} s: {self.log(what)}")

    # -- set up ------------------------------------------------------------------------
    def start(self) -> None:
        remove_stale_labs()
        self.bin = binaries()
        d = self.dir
        # etcd
        etcd_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        etcd = self._spawn(
            "etcd",
            [
                "etcd",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
            ],
        )
        # keys and tokens
        run("openssl", "genrsa", "-out", str(d / "sa.key"), "2048")
        (d / "tokens.csv").write_text(
            f'{TOKEN},admin,admin,"system:masters"\n{USER_TOKEN},dev,dev\n'
        )
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        self.kubeconfig.write_text(self._config("admin", TOKEN))
        self._wait("etcd", lambda: _port_open(etcd_port), 30, etcd)
        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                "--insecure-port=0",
                f"--cert-dir={d / 'certs'}",
                f"--token-auth-file={d / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-cluster-ip-range=10.0.0.0/24",
                f"--service-account-key-file={d / 'sa.key'}",
                f"--service-account-signing-key-file={d / 'sa.key'}",
                "--service-account-issuer=https://flotilla-lab.invalid",
                "--disable-admission-plugins=ServiceAccount",
                "--endpoint-reconciler-type=none",
                "--kubelet-preferred-address-types=InternalIP",
                "--enable-priority-and-fairness=false",
            ],
        )
        self._wait("kube-apiserver", self._ready, 90, apiserver)
        sched_port = free_port()
        scheduler = self._spawn(
            "kube-scheduler",
            [
                str(self.bin / "kube-scheduler"),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--port=0",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
            ],
        )
        # the pods' bridge
        self.subnet = free_subnet(os.getpid() + 77)
        add_bridge(self.bridge)
        run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        node_args = []
        for n in self.nodes:
            spec = f"name={n.name},cpu={n.cpu},memory={n.memory},gpus={n.gpus},port={free_port()}"
            if n.accelerator:
                spec += f",accelerator={n.accelerator}"
            node_args += ["--node", spec]
        agent = self._spawn(
            "flotilla-k8s-node",
            [
                str(self.bin / "flotilla-k8s-node"),
                f"--kubeconfig={self.kubeconfig}",
                f"--bridge={self.bridge}",
                f"--subnet={self.subnet}",
                f"--netns-prefix=flotilla-{self.tag}-h",
                f"--veth-prefix=flv{self.tag}x",
                f"--state-dir={d / 'nodes'}",
                *node_args,
            ],
        )
        self._wait("flotilla-k8s-node", self._nodes_ready, 60, agent)
        self._wait("kube-scheduler", lambda: _port_open(sched_port), 60, scheduler)

    def _config(self, user: str, token: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": CONTEXT,
                        "cluster": {"server": self.server, "insecure-skip-tls-verify": True},
                    }
                ],
                "users": [{"name": user, "user": {"token": token}}],
                "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user}}],
                "current-context": CONTEXT,
            }
        )

    def user_kubeconfig(self) -> Path:
        """A kubeconfig for user ``dev``, who may do only what RBAC grants it."""
        path = self.dir / "kubeconfig-dev"
        path.write_text(self._config("dev", USER_TOKEN))
        return path

    def _ready(self) -> bool:
        proc = subprocess.run(
            [self.kubectl_path, f"--kubeconfig={self.kubeconfig}", "get", "--raw", "/readyz"],
            capture_output=True,
            text=True,
        )
        return proc.returncode == 0 and proc.stdout.strip() == "ok"

    def _nodes_ready(self) -> bool:
        nodes = self.get_json("nodes").get("items", [])
        assert isinstance(nodes, list)
        ready = {
            n["metadata"]["name"]
            for n in nodes
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
        }
        return ready >= {n.name for n in self.nodes}

    # -- queries for tests -------------------------------------------------------------
    def pods(self, namespace: str = "default", selector: str = "") -> list[dict[str, object]]:
        args = ["pods", "-n", namespace] + ([f"-l={selector}"] if selector else [])
        items = self.get_json(*args).get("items", [])
        assert isinstance(items, list)
        return items

    def running_pod_processes(self) -> list[str]:
        """The names of the lab's pod network namespaces that still hold a process."""
        from _hosts import pids_in_netns

        out = []
        for line in run("ip", "netns", "list").stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(f"flotilla-{self.tag}-h") and pids_in_netns(name):
                out.append(name)
        return out

    # -- tear down ---------------------------------------------------------------------
    def close(self) -> None:
        for proc in reversed(self.procs):  # the node agent first: it stops the pods
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        for line in run("ip", "netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(f"flotilla-{self.tag}-h"):
                from _hosts import pids_in_netns

                for pid in pids_in_netns(name):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                run("ip", "netns", "del", name, check=False)
        run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="session", name="k8s_lab")
def k8s_lab_fixture() -> Iterator[K8sLab]:
    why = lab_unavailable()
    if why:
        pytest.skip(why)
    if _build_error is not None:
        raise LabError(_build_error)
    with _K8S.use() as lab:
        yield lab


_K8S = SharedLab(lambda: K8sLab().__enter__())
"""The session's lab: the modules that import the fixture get one fixture each, one lab."""
