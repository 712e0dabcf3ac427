"""The Kubernetes provider against a real API server and scheduler (see ``_k8s``: etcd,
kube-apiserver, kube-scheduler and kubectl are real; the kubelets are the tests' stand-in).

Tests that need the lab need root; they skip with the reason otherwise.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _ddp import assert_ddp_averages
from _k8s import K8sLab, k8s_lab_fixture  # noqa: F401 - the k8s_lab fixture
from _procs import assert_all_gone, cmdline, interruptible, wait_until

import flotilla as sky
from flotilla._errors import ConfigurationError, ProvisionCause, ProvisionError
from flotilla._providers.k8s import Kubernetes
from flotilla._providers.k8s.provider import MANAGED, POOL_LABEL


def provider(lab: K8sLab, **kwargs: Any) -> Kubernetes:
    """The provider on the lab: its kubeconfig and kubectl; pods run this interpreter (the
    lab's nodes run host processes, so the pods' "image" is this machine)."""
    options: dict[str, Any] = {
        "kubeconfig": str(lab.kubeconfig),
        "kubectl": lab.kubectl_path,
        "python": sys.executable,
    }
    options.update(kwargs)
    return Kubernetes(**options)


@sky.function
def where() -> dict[str, object]:
    info = sky.instance_info()
    return {
        "node": info.node,
        "addr": info.addr,
        "head": info.head_addr,
        "peers": [(p.node, p.addr) for p in info.peers],
        "pod": os.environ.get("HOSTNAME"),
    }


def pool_pods(lab: K8sLab, pool_id: str) -> list[dict[str, Any]]:
    return lab.pods(selector=f"{POOL_LABEL}={pool_id}")


def live_pods(lab: K8sLab) -> list[str]:
    """Pods of any flotilla pool that are not ended (Pending, Running, or terminating)."""
    return [
        p["metadata"]["name"]
        for p in lab.pods(selector="app.kubernetes.io/managed-by=flotilla")
        if p["status"].get("phase") not in ("Succeeded", "Failed")
        or p["metadata"].get("deletionTimestamp")
    ]


# -- pools ------------------------------------------------------------------------------------
def test_three_pod_pool_broadcast_with_peers(k8s_lab: K8sLab) -> None:
    with sky.Compute(provider=provider(k8s_lab), nodes=3) as pool:
        infos = where() @ pool
        pods = pool_pods(k8s_lab, pool.pool_id)
        ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
        assert all(p["status"]["phase"] == "Running" for p in pods)
    assert [i["node"] for i in infos] == [0, 1, 2]
    assert [i["pod"] for i in infos] == [f"flotilla-{pool.pool_id}-{k}" for k in range(3)]
    assert [i["addr"] for i in infos] == [ips[str(i["pod"])] for i in infos]
    peers = [(k, ips[f"flotilla-{pool.pool_id}-{k}"]) for k in range(3)]
    assert all(i["peers"] == peers for i in infos)
    assert {i["head"] for i in infos} == {peers[0][1]}
    assert pool_pods(k8s_lab, pool.pool_id) == []  # deleted when the block ended


def test_unschedulable_gpu_request_names_the_shortage_and_leaves_nothing(
    k8s_lab: K8sLab,
) -> None:
    before = {p["metadata"]["name"] for p in k8s_lab.pods()}
    with pytest.raises(ProvisionError) as raised:
        sky.Compute(
            provider=provider(k8s_lab, pending_timeout=2), nodes=2, accelerator="A100:8"
        ).open()
    message = str(raised.value)
    assert "Insufficient nvidia.com/gpu" in message, message
    assert "0/3 nodes are available" in message, message
    assert {p["metadata"]["name"] for p in k8s_lab.pods()} == before


def test_pods_are_listed_when_the_watch_ends(
    k8s_lab: K8sLab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's start watches its pods (``kubectl get --watch``); a watch that ends
    (a proxy cutting long requests) leaves the start to listing them."""
    from flotilla._providers.k8s import kubectl

    made: list[kubectl.Watch] = []

    def ending(self: kubectl.Kubectl, kind: str, selector: str) -> kubectl.Watch:
        watch = kubectl.Watch(self, kind, selector)
        watch.argv = [sys.executable, "-c", ""]  # ends at once, having said nothing
        made.append(watch)
        return watch

    monkeypatch.setattr(kubectl.Kubectl, "watch", ending)
    with sky.Compute(provider=provider(k8s_lab), nodes=2) as pool:
        assert [i["node"] for i in where() @ pool] == [0, 1]
    assert made  # the start did watch


_PROBE = """
def probe():
    import os, sys
    loaded = "flotilla._info" in sys.modules  # what the executor's start imported
    from flotilla._info import in_task
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a fork the task makes is in the task too
        os.write(w, b"1" if in_task() else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    return loaded, in_task(), os.read(r, 1) == b"1"
"""


def test_a_pods_executor_starts_without_instance_info_and_its_tasks_know_they_are_tasks(
    k8s_lab: K8sLab,
) -> None:
    """A pool without plugin hooks: the executor's start imports no ``flotilla._info`` (its
    two frozen dataclasses cost every executor start ~2 ms); a task, and a fork it made,
    are still in a task (``in_task``: a flotilla function called there runs there). The
    probe is sent by value (a module of no file), so that nothing imports flotilla for it."""
    namespace: dict[str, Any] = {"__name__": "flotilla_test_probe"}
    exec(_PROBE, namespace)
    with sky.Compute(provider=provider(k8s_lab), nodes=1) as pool:
        assert sky.function(namespace["probe"])() >> pool == (False, True, True)


def test_a_gpu_pod_lands_on_the_gpu_node(k8s_lab: K8sLab) -> None:
    with sky.Compute(provider=provider(k8s_lab), nodes=1, accelerator="A100:1") as pool:
        pods = pool_pods(k8s_lab, pool.pool_id)
    assert [p["spec"]["nodeName"] for p in pods] == ["node-3"]
    limits = pods[0]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "1"}


def test_a_deleted_pod_is_replaced_at_its_rank(k8s_lab: K8sLab) -> None:
    with sky.Compute(provider=provider(k8s_lab), nodes=2) as pool:
        first = where() @ pool
        lost = pool._nodes[1]
        k8s_lab.kubectl("delete", "pod", f"flotilla-{pool.pool_id}-1", "--wait=false")
        assert wait_until(
            lambda: pool._nodes[1] is not lost and pool._nodes[1].state.value == "ready",
            timeout=120,
        ), "node 1 was not replaced"
        second = where() @ pool

        def names() -> list[str]:
            return sorted(p["metadata"]["name"] for p in pool_pods(k8s_lab, pool.pool_id))

        assert wait_until(lambda: f"flotilla-{pool.pool_id}-1" not in names(), 30), names()
        assert names() == [f"flotilla-{pool.pool_id}-0", f"flotilla-{pool.pool_id}-1-1"]
    assert [i["node"] for i in second] == [0, 1]
    assert second[0]["pod"] == first[0]["pod"]
    assert second[1]["pod"] == f"flotilla-{pool.pool_id}-1-1"
    assert pool._renewals.replaced == 1


@sky.function
def pod_of(i: int) -> tuple[int, int, str]:
    return i, sky.instance_info().node, os.environ.get("HOSTNAME", "")


def test_an_elastic_pool_of_pods_starts_empty_and_scales_to_zero(k8s_lab: K8sLab) -> None:
    """``Nodes(0, max=2, min=0)``: no pod before the first call; a burst runs on up to 2
    pods (created as the pool grows); idle, every pod is deleted, and the next call
    creates one again."""
    options = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0, start_timeout=300)
    nodes = sky.Nodes(0, max=2, min=0)
    with sky.Compute(provider=provider(k8s_lab), nodes=nodes, options=options) as pool:
        pool_id = pool.pool_id
        assert pool.current_nodes() == 0 and pool_pods(k8s_lab, pool_id) == []
        out = pool.map(pod_of, range(20))
        assert [i for i, _, _ in out] == list(range(20))
        assert {node for _, node, _ in out} <= {0, 1}
        pods = {pod for _, _, pod in out}
        assert 1 <= len(pods) <= 2 and all(p.startswith(f"flotilla-{pool_id}-") for p in pods)
        assert wait_until(lambda: pool.current_nodes() == 0, timeout=120)
        assert wait_until(lambda: live_pods(k8s_lab) == [], timeout=60), live_pods(k8s_lab)
        assert (pod_of(1) >> pool)[:2] == (1, 0)
        assert len(live_pods(k8s_lab)) == 1
    assert wait_until(lambda: pool_pods(k8s_lab, pool_id) == [], timeout=60)


def test_two_pod_gloo_ddp_through_the_torch_plugin(k8s_lab: K8sLab) -> None:
    pytest.importorskip("torch")
    with sky.Compute(
        provider=provider(k8s_lab), nodes=2, plugins=[sky.plugins.torch(backend="gloo")]
    ) as pool:
        assert_ddp_averages(pool, 2)


# -- nothing left --------------------------------------------------------------------------
_CLIENT = """
import sys, time
sys.path[:0] = {path!r}
import flotilla as sky
from flotilla._providers.k8s import Kubernetes
provider = Kubernetes(kubeconfig={kubeconfig!r}, kubectl={kubectl!r}, python={python!r})
options = sky.Options(heartbeat_timeout=3, env={{"API_TOKEN": sky.Secret("killed-secret")}})
with sky.Compute(provider=provider, nodes=2, options=options) as pool:
    print(pool.pool_id, " ".join(str(n.hello_info["pid"]) for n in pool._nodes), flush=True)
    time.sleep(600)
"""


def _client(lab: K8sLab) -> tuple[subprocess.Popen[str], str, list[int]]:
    code = _CLIENT.format(
        path=[str(Path(__file__).parent), *sys.path],
        kubeconfig=str(lab.kubeconfig),
        kubectl=lab.kubectl_path,
        python=sys.executable,
    )
    client = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,  # a test sends it Ctrl-C (SIGINT)
    )
    assert client.stdout is not None
    line = client.stdout.readline()
    if not line:
        client.wait()
        raise AssertionError(client.stderr.read() if client.stderr else "no output")
    pool_id, *pids = line.split()
    return client, pool_id, [int(p) for p in pids]


def pool_objects(lab: K8sLab, pool_id: str) -> list[str]:
    """The pool's Services and Secrets, as ``kind/name``."""
    out = lab.kubectl("get", "services,secrets", "-l", f"{POOL_LABEL}={pool_id}", "-o", "name")
    return sorted(out.split())


def test_ctrl_c_leaves_no_pod(k8s_lab: K8sLab) -> None:
    client, pool_id, pids = _client(k8s_lab)
    assert pool_objects(k8s_lab, pool_id) == [
        f"secret/flotilla-{pool_id}",
        f"service/flotilla-{pool_id}",
    ]
    client.send_signal(signal.SIGINT)
    client.wait(60)
    assert pool_pods(k8s_lab, pool_id) == []
    assert pool_objects(k8s_lab, pool_id) == []
    assert_all_gone(pids, timeout=10, what="the agents")


def holders(lab: K8sLab) -> dict[str, str]:
    """The lab's pods' holders: pod name -> the program the holder runs (its ``exe``)."""
    from _hosts import pids_in_netns

    found = {}
    for name in sorted(os.listdir("/run/netns")):
        for pid in pids_in_netns(name) if name.startswith(f"flotilla-{lab.tag}-h") else []:
            with contextlib.suppress(OSError):
                if "flotilla-holder" in cmdline(pid) or "free_since" in cmdline(pid):
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    pod = next(v[9:] for v in environ if v.startswith(b"HOSTNAME="))
                    found[pod.decode()] = os.path.realpath(f"/proc/{pid}/exe")
    return found


def test_a_client_killed_with_sigkill_leaves_no_running_pod(k8s_lab: K8sLab) -> None:
    """The agents end with the killed client's exec streams, and the pods' holders (the
    shell's: the lab's "image" has ``flock``) end the pods ``IDLE`` s later."""
    client, pool_id, pids = _client(k8s_lab)
    sh = os.path.realpath(str(shutil.which("sh")))
    pods = {f"flotilla-{pool_id}-{k}": sh for k in range(2)}
    assert {k: v for k, v in holders(k8s_lab).items() if k in pods} == pods
    client.kill()
    client.wait()
    assert_all_gone(pids, timeout=30, what="the killed client's agents")

    def running() -> list[str]:
        return [
            p["metadata"]["name"]
            for p in pool_pods(k8s_lab, pool_id)
            if p["status"].get("phase") in ("Pending", "Running")
        ]

    assert wait_until(lambda: not running(), timeout=60), running()
    # what is left (ended pods) goes with `flotilla down --orphans`
    from flotilla._providers.k8s.orphans import remove_orphans

    found = remove_orphans(provider(k8s_lab).settings)
    assert pool_id in found.pools
    assert {f"secret/flotilla-{pool_id}", f"service/flotilla-{pool_id}"} <= set(found.others)
    assert pool_pods(k8s_lab, pool_id) == []
    assert pool_objects(k8s_lab, pool_id) == []


# -- refused before anything starts --------------------------------------------------------
def test_a_missing_kubeconfig_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no such file"):
        sky.Compute(provider=Kubernetes(kubeconfig=str(tmp_path / "none")), nodes=1).open()


def test_an_unknown_context_is_refused(k8s_lab: K8sLab) -> None:
    with pytest.raises(ConfigurationError, match="no such context"):
        sky.Compute(provider=provider(k8s_lab, context="elsewhere"), nodes=1).open()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="namespace"):
        Kubernetes(namespace="Not A Name")
    with pytest.raises(ConfigurationError, match="pending_timeout"):
        Kubernetes(pending_timeout=-1)


def test_pod_spec_uses_only_stable_core_fields(k8s_lab: K8sLab) -> None:
    """The pod the provider makes is accepted by a v1.20 server as it is (server-side dry
    run), and names its pool, rank and client."""
    from flotilla._providers.base import Options, PoolSpec

    spec = PoolSpec("abcd1234", 1, None, None, (), Options(), vcpus=1.5, memory_gb=2)
    pod = provider(k8s_lab).pod(spec, 0, "flotilla-abcd1234-0")
    out = k8s_lab.kubectl(
        "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod)
    )
    made = json.loads(out)
    assert made["metadata"]["labels"][POOL_LABEL] == "abcd1234"
    assert made["spec"]["containers"][0]["resources"]["requests"] == {
        "cpu": "1500m",
        "memory": "2Gi",
    }
    assert made["spec"]["restartPolicy"] == "Never"


@sky.function
def read_env(name: str) -> str | None:
    return os.environ.get(name)


def secret_value(lab: K8sLab, name: str, key: str) -> str | None:
    """The value of ``key`` in the Secret ``name`` (None: no such Secret or key)."""
    out = lab.kubectl("get", "secret", name, "-o", "json", "--ignore-not-found")
    if not out.strip():
        return None
    data = json.loads(out).get("data") or {}
    return base64.b64decode(data[key]).decode() if key in data else None


def test_a_secret_goes_into_a_kubernetes_secret_of_the_pool_never_a_pod_spec(
    k8s_lab: K8sLab,
) -> None:
    """The pool's Secret holds the value while the pool runs; the pods refer to it
    (``secretKeyRef``), the tasks see it, no pod spec holds it, and it goes with the pool."""
    value = "k8s-secret-value-4242"
    options = sky.Options(env={"API_TOKEN": sky.Secret(value), "PLAIN": "visible"})
    with sky.Compute(provider=provider(k8s_lab), nodes=2, options=options) as pool:
        seen = read_env("API_TOKEN") @ pool
        plain = read_env("PLAIN") @ pool
        name = f"flotilla-{pool.pool_id}"
        held = secret_value(k8s_lab, name, "API_TOKEN")
        secrets = k8s_lab.kubectl(
            "get", "secrets", "-l", f"{POOL_LABEL}={pool.pool_id}", "-o", "name"
        )
        specs = k8s_lab.kubectl("get", "pods", "-l", f"{POOL_LABEL}={pool.pool_id}", "-o", "json")
    assert seen == [value, value] and plain == ["visible", "visible"]
    assert held == value
    assert secrets.split() == [f"secret/{name}"]  # labelled with the pool
    assert pool.pool_id in specs and value not in specs
    for pod in json.loads(specs)["items"]:
        env = pod["spec"]["containers"][0]["env"]
        assert env == [
            {"name": "API_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": "API_TOKEN"}}}
        ]
    assert secret_value(k8s_lab, name, "API_TOKEN") is None  # deleted with the pool


def test_a_pool_without_secrets_makes_no_secret(k8s_lab: K8sLab) -> None:
    with sky.Compute(provider=provider(k8s_lab), nodes=1) as pool:
        secrets = k8s_lab.kubectl(
            "get", "secrets", "-l", f"{POOL_LABEL}={pool.pool_id}", "-o", "name"
        )
        pods = pool_pods(k8s_lab, pool.pool_id)
    assert secrets.strip() == ""
    assert "env" not in pods[0]["spec"]["containers"][0]


def test_a_headless_service_names_the_pools_pods_while_it_runs(k8s_lab: K8sLab) -> None:
    """Each pool has a headless Service selecting its pods (``<pod>.<service>.<namespace>.svc``
    in a cluster's DNS; the lab has none, peers stay pod IPs): it exists while the pool
    runs and goes with it."""
    with sky.Compute(provider=provider(k8s_lab), nodes=2) as pool:
        name = f"flotilla-{pool.pool_id}"
        service = k8s_lab.get_json("service", name)
        listed = k8s_lab.kubectl(
            "get", "services", "-l", f"{POOL_LABEL}={pool.pool_id}", "-o", "name"
        )
        pods = pool_pods(k8s_lab, pool.pool_id)
        infos = where() @ pool
    spec = service["spec"]
    assert isinstance(spec, dict)
    assert spec["clusterIP"] == "None"
    assert spec["selector"] == {POOL_LABEL: pool.pool_id}
    assert listed.split() == [f"service/{name}"]
    assert all(p["spec"]["subdomain"] == name for p in pods)  # <pod>.<service> names
    ips = {int(p["metadata"]["labels"]["flotilla/rank"]): p["status"]["podIP"] for p in pods}
    assert all(i["peers"] == sorted(ips.items()) for i in infos)  # peers stay pod IPs
    gone = k8s_lab.kubectl("get", "service", name, "--ignore-not-found", "-o", "name")
    assert gone.strip() == ""


_ROLE = """
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: {name}, namespace: default}}
rules:
- apiGroups: [""]
  resources: [pods]
  verbs: [create, get, list, watch, delete]
- apiGroups: [""]
  resources: [services, secrets]
  verbs: [create, list, delete]
{exec_rule}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: {name}, namespace: default}}
subjects: [{{kind: User, name: dev, apiGroup: rbac.authorization.k8s.io}}]
roleRef: {{kind: Role, name: {name}, apiGroup: rbac.authorization.k8s.io}}
"""


def test_the_rbac_the_readme_names_is_enough_and_exec_is_needed(k8s_lab: K8sLab) -> None:
    """A user with exactly the documented Role (pods: create/get/list/watch/delete; services and
    secrets: create/list/delete; pods/exec: create) runs a pool with a secret; without
    pods/exec the start fails naming the refusal, and nothing is left."""
    kubeconfig = str(k8s_lab.user_kubeconfig())
    exec_rule = '- apiGroups: [""]\n  resources: [pods/exec]\n  verbs: [create]'
    k8s_lab.kubectl("apply", "-f", "-", input=_ROLE.format(name="flotilla", exec_rule=exec_rule))
    try:
        options = sky.Options(env={"API_TOKEN": sky.Secret("rbac-secret-value")})
        with sky.Compute(
            provider=provider(k8s_lab, kubeconfig=kubeconfig), nodes=2, options=options
        ) as pool:
            assert [i["node"] for i in where() @ pool] == [0, 1]
            assert read_env("API_TOKEN") @ pool == ["rbac-secret-value"] * 2
        k8s_lab.kubectl("apply", "-f", "-", input=_ROLE.format(name="flotilla", exec_rule=""))
        with pytest.raises(ProvisionError, match="forbidden") as raised:
            sky.Compute(provider=provider(k8s_lab, kubeconfig=kubeconfig), nodes=2).open()
        assert raised.value.cause is ProvisionCause.AUTH
        assert live_pods(k8s_lab) == []
        assert k8s_lab.kubectl("get", "services,secrets", "-l", MANAGED, "-o", "name") == ""
    finally:
        k8s_lab.kubectl("delete", "role,rolebinding", "flotilla", "--ignore-not-found")


# -- without the lab -----------------------------------------------------------------------
def test_pod_states_name_the_shortage_and_how_a_pod_ended() -> None:
    from flotilla._providers.k8s.provider import PodState

    pending = PodState.of(
        {
            "metadata": {"name": "p0"},
            "status": {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                    }
                ],
            },
        }
    )
    assert pending.unschedulable == "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    assert pending.ended is None and pending.ip == ""
    failed = PodState.of(
        {
            "metadata": {"name": "p1", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "status": {
                "phase": "Failed",
                "podIP": "10.0.0.5",
                "containerStatuses": [
                    {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
                ],
            },
        }
    )
    assert failed.ended == "it ended (Failed, exit code 137: OOMKilled)"
    assert failed.deleting and failed.ip == "10.0.0.5"
    pulling = PodState.of(
        {
            "metadata": {"name": "p2"},
            "status": {
                "phase": "Pending",
                "containerStatuses": [
                    {"state": {"waiting": {"reason": "ErrImagePull", "message": "no such image"}}}
                ],
            },
        }
    )
    assert pulling.ended == "its container cannot start (ErrImagePull: no such image)"


def test_the_default_image_is_the_clients_python_and_gpus_select_their_type() -> None:
    from flotilla._accelerators import parse_accelerator
    from flotilla._providers.base import Options, PoolSpec

    spec = PoolSpec("abcd1234", 1, None, None, (), Options())
    pod = Kubernetes().pod(spec, 0, "flotilla-abcd1234-0")
    image = pod["spec"]["containers"][0]["image"]
    assert image == f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert "nodeSelector" not in pod["spec"]
    gpus = PoolSpec("abcd1234", 1, parse_accelerator("A100:2"), None, (), Options())
    pod = Kubernetes().pod(gpus, 0, "flotilla-abcd1234-0")
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {"nvidia.com/gpu": "2"}
    assert pod["spec"]["nodeSelector"] == {"skypilot.co/accelerator": "a100"}
    pod = Kubernetes(gpu_label=None).pod(gpus, 0, "flotilla-abcd1234-0")
    assert "nodeSelector" not in pod["spec"]


# -- the pods' holder, run here as a pod runs it (see HOLDER) ------------------------------
def _holder(tmp_path: Path, flock: bool, first: int = 1, idle: int = 1) -> subprocess.Popen[bytes]:
    """A pod's command for the lock ``~/agent.lock`` (HOME: ``tmp_path``); without
    ``flock``: on a PATH with only ``sh`` and ``sleep`` (an image without util-linux)."""
    from flotilla._providers.k8s.provider import holder_command

    path = os.environ["PATH"]
    if not flock:
        tools = tmp_path / "bin"
        tools.mkdir()
        for name in ("sh", "sleep"):
            (tools / name).symlink_to(str(shutil.which(name)))
        path = str(tools)
    argv = holder_command([sys.executable], first, idle, "~/agent.lock")
    return subprocess.Popen(argv, env={"PATH": path, "HOME": str(tmp_path)})


def _agent_lock(tmp_path: Path) -> int:
    """Take the pod's agent lock as an agent does (``bootstrap``: a shared ``flock``)."""
    fd = os.open(tmp_path / "agent.lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _runs_python(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return os.path.realpath(f"/proc/{pid}/exe") == os.path.realpath(sys.executable)
    return False


def _children(pid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(entry))
    return out


def _waits_in_flock(holder: subprocess.Popen[bytes]) -> bool:
    """The shell holder waits in ``flock`` for the agents' lock (it has seen the lock)."""
    return any(cmdline(p).startswith("flock -x") for p in _children(holder.pid))


def _counts_idle_seconds(holder: subprocess.Popen[bytes]) -> bool:
    """The shell holder has seen the lock free: it counts its idle seconds (``sleep``)."""
    return any(cmdline(p).startswith("sleep") for p in _children(holder.pid))


@pytest.mark.parametrize("flock", [True, False], ids=["shell", "no flock: python"])
def test_a_pods_holder_keeps_it_while_an_agent_runs_and_ends_it_idle_after(
    tmp_path: Path, flock: bool
) -> None:
    """The holder outlives its ``first`` and ``idle`` seconds while an agent holds the lock,
    and goes back to waiting when an agent takes the lock within ``idle`` s of the last one
    letting it go; ``idle`` s after the last agent let it go it ends (status 0: the pod is
    Succeeded). Where the image has ``flock`` no Python starts (the shell waits in
    ``flock``); without it the Python holder does the same."""
    fd = _agent_lock(tmp_path)
    holder = _holder(tmp_path, flock, first=1, idle=2)
    try:
        if flock:
            assert wait_until(lambda: _waits_in_flock(holder), timeout=60)
        else:
            assert wait_until(lambda: _runs_python(holder.pid), timeout=60)
        with pytest.raises(subprocess.TimeoutExpired):
            holder.wait(timeout=4)  # past first and idle: held, it stays
        os.close(fd)  # the agent ended...
        if flock:  # (the shell has seen it: it counts idle seconds)
            assert wait_until(lambda: _counts_idle_seconds(holder), timeout=60)
        fd = _agent_lock(tmp_path)  # ...and another one starts within idle seconds
        with pytest.raises(subprocess.TimeoutExpired):
            holder.wait(timeout=3)
        assert _runs_python(holder.pid) is not flock
        os.close(fd)
        fd = -1
        assert holder.wait(timeout=60) == 0
    finally:
        if fd >= 0:
            os.close(fd)
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("flock", [True, False], ids=["shell", "no flock: python"])
def test_a_pods_holder_ends_it_when_no_agent_starts(tmp_path: Path, flock: bool) -> None:
    holder = _holder(tmp_path, flock, first=1, idle=60)
    try:
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()
        holder.wait()


def test_a_pods_holder_ends_at_once_when_the_pod_is_deleted(tmp_path: Path) -> None:
    """SIGTERM (the pod's deletion) ends the shell holder while it waits in ``flock`` for a
    running agent, with status 0, and its ``flock`` with it."""
    fd = _agent_lock(tmp_path)
    holder = _holder(tmp_path, flock=True)
    try:
        assert wait_until(lambda: _waits_in_flock(holder), timeout=60)
        waiting = _children(holder.pid)
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=60) == 0  # the lock is still held
        assert_all_gone(waiting, timeout=30, what="the holder's flock")
    finally:
        os.close(fd)
        holder.kill()
        holder.wait()
