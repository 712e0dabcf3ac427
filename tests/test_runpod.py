"""The RunPod provider on the lab's stand-in (``_runpod.py``): its GraphQL and REST v1
APIs driven by the official client ``runpod`` and by flotilla; pods are real sshd in
network namespaces, reachable only at the public address and port the API reports, after
a boot delay (0.5 s)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any

import pytest
from _procs import wait_until
from _runpod import API_KEY, RunPodLab, runpod_lab_fixture  # noqa: F401 - the fixture
from _standin import interrupted_while_booting, killed_client

import flotilla as sky
from flotilla._errors import ConfigurationError, ProvisionError

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

A100 = ("NVIDIA A100 80GB PCIe", "A100 PCIe", 80)
A100_SXM = ("NVIDIA A100-SXM4-80GB", "A100 SXM", 80)
RTX4090 = ("NVIDIA GeForce RTX 4090", "RTX 4090", 24)


@sky.function
def place() -> tuple[int, str, str, list[str]]:
    info = sky.instance_info()
    return info.node, info.addr, info.head_addr, [p.addr for p in info.peers]


@sky.function
def boom() -> float:
    return 1 / 0


def _created(lab: RunPodLab) -> int:
    return sum(1 for m, p in lab.requests if (m, p) == ("POST", "/v1/pods"))


def test_the_official_client_drives_the_stand_in(runpod_lab: RunPodLab) -> None:
    """runpod 1.12.0 (GraphQL): GPU types, a pod created, listed with its public SSH port
    once it runs (where its sshd answers, and nowhere else), stopped (EXITED: no port, no
    sshd) and resumed (``stop_pod``/``resume_pod``), terminated."""
    runpod = pytest.importorskip("runpod")
    assert runpod.__version__ == "1.12.0"
    runpod_lab.add_gpu(*RTX4090, community_price=0.34)
    runpod.api_key = API_KEY
    (gpu,) = runpod.get_gpus()
    assert gpu == {"id": RTX4090[0], "displayName": "RTX 4090", "memoryInGb": 24}
    assert runpod.get_gpu(RTX4090[0])["communityPrice"] == 0.34
    pod = runpod.create_pod(
        "client-test",
        "runpod/base",
        RTX4090[0],
        cloud_type="COMMUNITY",
        env={"PUBLIC_KEY": "ssh-ed25519 AAAA test"},
    )
    assert [p["id"] for p in runpod.get_pods()] == [pod["id"]]

    def ports() -> list[dict[str, Any]]:
        runtime = runpod.get_pod(pod["id"])["runtime"]
        return runtime["ports"] if runtime else []

    assert wait_until(lambda: bool(ports()), 60)
    (port,) = ports()
    assert port["privatePort"] == 22 and port["isIpPublic"]
    assert wait_until(lambda: _answers(port["ip"], port["publicPort"]), 30)
    assert not _answers(port["ip"], 22)
    stopped = runpod.stop_pod(pod["id"])
    assert stopped == {"id": pod["id"], "desiredStatus": "EXITED"}
    assert ports() == [] and not _answers(port["ip"], port["publicPort"])
    resumed = runpod.resume_pod(pod["id"], 1)
    assert resumed["desiredStatus"] == "RUNNING" and resumed["machine"]["podHostId"]
    assert wait_until(lambda: ports() == [port], 60), ports()
    assert wait_until(lambda: _answers(port["ip"], port["publicPort"]), 30)
    runpod.terminate_pod(pod["id"])
    assert runpod.get_pods() == [] and runpod_lab.destroyed == {pod["id"]: "account"}
    runpod.api_key = "wrong"
    with pytest.raises(runpod.error.AuthenticationError):
        runpod.get_gpus()


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), 1):
            return True
    except OSError:
        return False


def test_a_two_node_pool_on_the_global_network(runpod_lab: RunPodLab) -> None:
    """Two A100 pods: the nodes' addresses are their names on RunPod's global network,
    a broadcast reaches both; everything is terminated at the end."""
    runpod_lab.add_gpu(*A100, secure_price=1.64)
    with sky.Compute(provider=sky.RunPod(), accelerator="A100", nodes=2) as pool:
        places = place() @ pool
        live = runpod_lab.live()
        assert pool._allocation is not None and pool._allocation.hourly == 3.28  # type: ignore[attr-defined]
    names = {f"{p.id}.runpod.internal" for p in live}
    assert sorted(p[0] for p in places) == [0, 1] and {p[1] for p in places} == names
    assert all(sorted(p[3]) == sorted(names) and p[2] == places[0][1] for p in places)
    (create,) = {str(c.get("cloudType")) for c in runpod_lab.creates}
    assert create == "SECURE" and all(c["globalNetworking"] for c in runpod_lab.creates)
    assert runpod_lab.live() == [] and set(runpod_lab.destroyed.values()) == {"account"}


def test_ddp_over_the_global_network(runpod_lab: RunPodLab) -> None:
    pytest.importorskip("torch")
    from _ddp import assert_ddp_averages

    from flotilla import plugins

    runpod_lab.add_gpu(*A100)
    provider = sky.RunPod(python=sys.executable)  # the interpreter with torch
    with sky.Compute(
        provider=provider, accelerator="A100", nodes=2, plugins=[plugins.torch()]
    ) as pool:
        assert_ddp_averages(pool, 2)
    assert runpod_lab.live() == []


def test_capacity_moves_to_the_next_data_center_then_the_next_gpu_type(
    runpod_lab: RunPodLab, capfd: pytest.CaptureFixture[str]
) -> None:
    """The cheapest type (A100 PCIe) has room for one pod in US-TX-3 and none in
    EU-RO-1; the second node goes to the next type (A100 SXM) in EU-RO-1."""
    runpod_lab.add_gpu(*A100, secure_price=1.0, stock={"EU-RO-1": 0, "US-TX-3": 1})
    runpod_lab.add_gpu(*A100_SXM, secure_price=2.0, stock={"EU-RO-1": 3})
    provider = sky.RunPod(data_centers=["EU-RO-1", "US-TX-3"])
    with sky.Compute(provider=provider, accelerator="A100", nodes=2) as pool:
        assert sorted(p[0] for p in place() @ pool) == [0, 1]
        kinds = {(p.gpu.id, p.data_center) for p in runpod_lab.live()}
    assert kinds == {(A100_SXM[0], "EU-RO-1"), (A100[0], "US-TX-3")}
    tried = [(c["gpuTypeIds"][0], c["dataCenterIds"][0]) for c in runpod_lab.creates]
    assert tried == [
        (A100[0], "EU-RO-1"),
        (A100[0], "US-TX-3"),
        (A100[0], "US-TX-3"),
        (A100_SXM[0], "EU-RO-1"),
    ]
    assert "no capacity for 1 x NVIDIA A100 80GB PCIe" in capfd.readouterr().err
    assert runpod_lab.live() == []


def test_no_capacity_anywhere_falls_back_to_the_next_spec(runpod_lab: RunPodLab) -> None:
    """Skyward's spelling: the first spec (secure cloud) has no room, the second
    (community cloud) starts the pool; what the first rented is terminated."""
    runpod_lab.add_gpu(*RTX4090, stock={"EU-RO-1": 1}, community_stock={"US-TX-3": 2})
    with sky.Compute(
        sky.Spec(sky.RunPod(), "RTX4090", nodes=2),
        sky.Spec(sky.RunPod(cloud_type="community"), "RTX4090", nodes=2),
        selection="first",
    ) as pool:
        assert sorted(p[0] for p in place() @ pool) == [0, 1]
        assert {p.cloud for p in runpod_lab.live()} == {"COMMUNITY"}
        assert len(runpod_lab.destroyed) == 1  # the first spec's one pod, given back
    first = [c for c in runpod_lab.creates if c["cloudType"] == "SECURE"]
    assert len(first) == 2
    assert runpod_lab.live() == []


def test_spot_pods_are_interruptible_at_the_bid_price(runpod_lab: RunPodLab) -> None:
    runpod_lab.add_gpu(*A100, secure_price=1.6, secure_spot_price=0.9)
    spec = sky.PoolSpec("s", 1, sky.Accelerator("A100", 2), None, (), sky.Options())
    (offer,) = sky.RunPod(allocation="spot").offers(spec)
    assert (offer.hourly, offer.spot, offer.count) == (1.8, True, 2)
    with sky.Compute(provider=sky.RunPod(allocation="spot"), accelerator="A100:2") as pool:
        assert [p[0] for p in place() @ pool] == [0]
        (pod,) = runpod_lab.live()
        assert pod.interruptible and pod.count == 2 and pod.price == 1.8
    assert runpod_lab.live() == []


def test_a_bad_key_is_refused_before_renting_naming_the_variable(runpod_lab: RunPodLab) -> None:
    runpod_lab.add_gpu(*A100)
    secret = "rp-" + "9" * 30
    os.environ["RUNPOD_API_KEY"] = secret
    with pytest.raises(ConfigurationError, match="refused the API key from RUNPOD_API_KEY") as info:
        sky.Compute(provider=sky.RunPod(), accelerator="A100").open()
    assert secret not in str(info.value) and secret not in repr(sky.RunPod(api_key=secret))
    assert _created(runpod_lab) == 0
    os.environ.pop("RUNPOD_API_KEY")
    with pytest.raises(ConfigurationError, match=r"no RunPod API key: looked in .*RUNPOD_API_KEY"):
        sky.RunPod().check()


def test_an_unknown_accelerator_names_the_nearest_and_what_runpod_has(
    runpod_lab: RunPodLab,
) -> None:
    runpod_lab.add_gpu(*A100)
    runpod_lab.add_gpu(*RTX4090)
    with pytest.raises(ConfigurationError) as info:
        sky.Compute(provider=sky.RunPod(), accelerator="A1000").open()
    text = str(info.value)
    assert "nearest: A100" in text and "runpod offers A100 PCIe, RTX 4090" in text
    with pytest.raises(ConfigurationError, match="no RunPod offer is accelerator 'H100'"):
        sky.Compute(provider=sky.RunPod(), accelerator="H100").open()
    assert _created(runpod_lab) == 0


def test_nothing_left_after_an_exception(runpod_lab: RunPodLab) -> None:
    runpod_lab.add_gpu(*A100)
    with (
        pytest.raises(ZeroDivisionError),
        sky.Compute(provider=sky.RunPod(), accelerator="A100", nodes=2) as pool,
    ):
        boom() @ pool
    assert runpod_lab.live() == []


_BOOTING_CLIENT = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # even under a nohup'd suite
import flotilla as sky
options = sky.Options(heartbeat_timeout=2, start_timeout=600)
with sky.Compute(provider=sky.RunPod(ttl=600), accelerator="A100", nodes=2, options=options):
    print("opened", flush=True)
"""


def test_ctrl_c_while_pods_boot_terminates_them_before_the_client_exits(
    runpod_lab: RunPodLab,
) -> None:
    runpod_lab.add_gpu(*A100)
    out, err = interrupted_while_booting(runpod_lab, _BOOTING_CLIENT)  # the pods never run
    assert "opened" not in out
    assert runpod_lab.live() == [], err
    assert set(runpod_lab.destroyed.values()) == {"account"}


_CLIENT = """
import sys, time
import flotilla as sky
options = sky.Options(heartbeat_timeout=2, start_timeout=60)
with sky.Compute(provider=sky.RunPod(ttl={ttl!r}), accelerator="A100", nodes=2,
                 options=options) as pool:
    print(pool.pool_id, flush=True)
    time.sleep(600)
"""


def test_kill9_pods_terminate_themselves_and_orphans_are_found(runpod_lab: RunPodLab) -> None:
    """A client killed with SIGKILL: each pod's watchdog terminates it with the pod's own
    key (RUNPOD_API_KEY inside the pod) ttl s after the client's last contact; a pool
    left by a dead client is found by its name by remove_orphans(), another client's
    pods and pods that are not flotilla's are not touched."""
    runpod_lab.add_gpu(*A100)
    pool_id, mine = killed_client(runpod_lab, _CLIENT.format(ttl=3.0))
    left = runpod_lab.wait_gone(120, f"flotilla:{pool_id}:")
    assert left == [], runpod_lab.log("")
    assert all(runpod_lab.destroyed[p.id] == "self" for p in mine)
    dead = subprocess.Popen(["true"])
    dead.wait()
    api = sky.RunPod().api
    for name in (
        f"flotilla:deadbeef:{socket.gethostname()}:{dead.pid}:1",
        "not-flotilla",
        f"flotilla:alive01:{socket.gethostname()}:{os.getpid()}:1",
    ):
        if name.startswith("flotilla:alive01"):
            from flotilla._providers.cloud.identity import client_id

            name = f"flotilla:alive01:{client_id()}"
        body = {"name": name, "imageName": "x", "gpuTypeIds": [A100[0]], "gpuCount": 1}
        api.call("POST", "/pods", "create", body)
    found = sky.RunPod().remove_orphans(dry_run=True)
    assert found.pools == ("deadbeef",) and len(runpod_lab.live()) == 3
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-runpod-{pool_id}-*"))
    found = sky.RunPod().remove_orphans()
    assert found.pools == ("deadbeef",) and len(found.pods) == 1
    # the killed client's local key folder went too
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-runpod-{pool_id}-*")) == []
    assert sorted(
        p.name.split(":")[0] + ":" + p.name.split(":")[1] if ":" in p.name else p.name
        for p in runpod_lab.live()
    ) == ["flotilla:alive01", "not-flotilla"]


def test_the_guard_terminates_a_pod_no_agent_reaches(runpod_lab: RunPodLab) -> None:
    """A pod created with flotilla's start command whose agent never starts terminates
    itself max(ttl, start_timeout) s after its start, with its own key."""
    from flotilla._providers.cloud.keys import keygen
    from flotilla._providers.runpod.pool import RunPodAllocation

    runpod_lab.add_gpu(*A100)
    provider = sky.RunPod(ttl=2.0)
    spec = sky.PoolSpec("g1", 1, sky.Accelerator("A100"), None, (), sky.Options(start_timeout=1))
    allocation = RunPodAllocation(provider.settings, provider.api, spec)
    key = keygen(allocation.folder, "k", "t")
    body = {
        "name": "guarded",
        "imageName": "x",
        "gpuTypeIds": [A100[0]],
        "gpuCount": 1,
        "dockerStartCmd": allocation._start_command(key),
        "env": {"PUBLIC_KEY": "x"},
    }
    pod = provider.api.call("POST", "/pods", "create", body)
    try:
        assert wait_until(lambda: pod["id"] in runpod_lab.destroyed, 60), runpod_lab.log("")
        assert runpod_lab.destroyed[pod["id"]] == "self"
    finally:
        shutil.rmtree(allocation.folder)


def test_offers_and_the_configured_markets(runpod_lab: RunPodLab) -> None:
    runpod_lab.add_gpu(*A100, secure_price=1.64, community_price=1.19)
    runpod_lab.add_gpu(*A100_SXM, secure_price=1.89, community=False)
    runpod_lab.add_gpu(*RTX4090)
    found = [o for o in sky.offers("A100") if o.provider == "runpod"]
    assert [(o.accelerator, o.hourly, o.region, o.detail) for o in found] == [
        ("A100 PCIe", 1.64, "secure", A100[0]),
        ("A100 SXM", 1.89, "secure", A100_SXM[0]),
    ]
    sxm = [
        o.detail
        for o in sky.offers(sky.accelerators.A100(form_factor="SXM"))
        if o.provider == "runpod"
    ]
    assert sxm == [A100_SXM[0]]
    everywhere = sky.RunPod(cloud_type="all").offers(
        sky.PoolSpec("o", 1, sky.Accelerator("A100"), None, (), sky.Options())
    )
    assert [(o.hourly, o.region) for o in everywhere][:2] == [(1.19, "community"), (1.64, "secure")]
    assert _created(runpod_lab) == 0


def test_settings_runpod_cannot_take_are_refused(runpod_lab: RunPodLab) -> None:
    with pytest.raises(ConfigurationError, match="cloud_type='cheap'"):
        sky.RunPod(cloud_type="cheap")
    with pytest.raises(ConfigurationError, match="give the pool an accelerator"):
        sky.Compute(provider=sky.RunPod()).open()
    with pytest.raises(ConfigurationError, match="global_networking=True"):
        sky.Compute(
            provider=sky.RunPod(global_networking=False), accelerator="A100", nodes=2
        ).open()
    assert _created(runpod_lab) == 0


def test_a_lost_node_is_replaced(runpod_lab: RunPodLab) -> None:
    runpod_lab.add_gpu(*A100)
    with sky.Compute(provider=sky.RunPod(), accelerator="A100", nodes=2) as pool:
        lost = pool._nodes[1]
        assert pool._allocation is not None
        old = pool._allocation.machines[1].ident
        os.kill(int(lost.hello_info["pid"]), signal.SIGKILL)
        assert wait_until(
            lambda: pool._nodes[1] is not lost and pool._nodes[1].state.value == "ready",
            timeout=120,
        ), "node 1 was not replaced"
        assert sorted(p[0] for p in place() @ pool) == [0, 1]
        assert old not in {p.id for p in runpod_lab.live()}
    assert runpod_lab.live() == []


def test_errors_are_provision_errors(runpod_lab: RunPodLab) -> None:
    runpod_lab.add_gpu(*A100, stock={"EU-RO-1": 0})
    with pytest.raises(ProvisionError, match="RunPod has no capacity for A100") as info:
        sky.Compute(provider=sky.RunPod(), accelerator="A100").open()
    assert info.value.cause is sky.ProvisionCause.CAPACITY
    assert runpod_lab.live() == []
