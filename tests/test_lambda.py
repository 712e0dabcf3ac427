"""The Lambda Cloud provider on the lab's stand-in (``_lambda.py``): its REST API as Lambda's
OpenAPI specification documents it; instances are real sshd in network namespaces,
reachable only at their public address, port 22, after a boot delay (0.5 s), on a private
network per region."""

from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request

import pytest
from _lambda import API_KEY, LambdaLab, lambda_lab_fixture  # noqa: F401 - the fixture
from _procs import wait_until
from _standin import interrupted_while_booting, killed_client

import flotilla as sky
from flotilla._errors import ConfigurationError, ProvisionError

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@sky.function
def place() -> tuple[int, str, str, list[str]]:
    info = sky.instance_info()
    return info.node, info.addr, info.head_addr, [p.addr for p in info.peers]


@sky.function
def boom() -> float:
    return 1 / 0


def lam(**kw: object) -> sky.LambdaCloud:
    """The provider as the lab's instances want it: their login user is root."""
    return sky.LambdaCloud(ssh_user="root", **kw)  # type: ignore[arg-type]


def test_the_documented_calls_on_the_stand_in(lambda_lab: LambdaLab) -> None:
    """The API reference's calls, HTTP Basic auth as Lambda's examples use it (curl -u
    KEY:): instance types, a launch, the instance booting then active, terminated."""
    lambda_lab.boot_delay = 2.0  # long enough to see it booting, also on a loaded machine
    lambda_lab.add_type("gpu_1x_a10", "A10 (24 GB PCIe)", 1, 75)
    auth = "Basic " + base64.b64encode(f"{API_KEY}:".encode()).decode()

    def call(method: str, path: str, body: object = None) -> dict:  # type: ignore[type-arg]
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            lambda_lab.url + path,
            data=data,
            method=method,
            headers={"Authorization": auth, "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    types = call("GET", "/instance-types")["data"]
    assert types["gpu_1x_a10"]["regions_with_capacity_available"] == [
        {"name": "us-east-1", "description": "us-east-1"}
    ]
    key = call("POST", "/ssh-keys", {"name": "k", "public_key": "ssh-ed25519 AAAA t"})["data"]
    (ident,) = call(
        "POST",
        "/instance-operations/launch",
        {
            "region_name": "us-east-1",
            "instance_type_name": "gpu_1x_a10",
            "ssh_key_names": ["k"],
            "quantity": 1,
            "name": "doc",
        },
    )["data"]["instance_ids"]
    assert call("GET", f"/instances/{ident}")["data"]["status"] == "booting"
    assert wait_until(lambda: call("GET", f"/instances/{ident}")["data"]["status"] == "active", 60)
    ip = call("GET", f"/instances/{ident}")["data"]["ip"]
    assert wait_until(lambda: _answers(ip, 22), 30)
    done = call("POST", "/instance-operations/terminate", {"instance_ids": [ident]})
    assert [i["id"] for i in done["data"]["terminated_instances"]] == [ident]
    call("DELETE", f"/ssh-keys/{key['id']}")
    assert lambda_lab.live() == [] and lambda_lab.keys == {}


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), 1):
            return True
    except OSError:
        return False


def test_a_two_node_pool_on_the_private_network(lambda_lab: LambdaLab) -> None:
    lambda_lab.add_type("gpu_1x_a100_sxm4", "A100 (40 GB SXM4)", 1, 129)
    with sky.Compute(provider=lam(), accelerator="A100", nodes=2) as pool:
        places = place() @ pool
        live = lambda_lab.live()
        assert len(lambda_lab.keys) == 1  # the pool's login key, registered
    privates = {i.private_ip for i in live}
    assert sorted(p[0] for p in places) == [0, 1] and {p[1] for p in places} == privates
    assert all(sorted(p[3]) == sorted(privates) for p in places)
    (launch,) = lambda_lab.launches
    assert launch["quantity"] == 2 and launch["user_data"].startswith("#cloud-config")
    assert lambda_lab.live() == [] and lambda_lab.keys == {}
    assert set(lambda_lab.terminated.values()) == {"account"}


def test_ddp_over_the_private_network(lambda_lab: LambdaLab) -> None:
    pytest.importorskip("torch")
    from _ddp import assert_ddp_averages

    from flotilla import plugins

    lambda_lab.add_type("gpu_1x_a10", "A10 (24 GB PCIe)", 1, 75)
    with sky.Compute(
        provider=lam(python=sys.executable), accelerator="A10", nodes=2, plugins=[plugins.torch()]
    ) as pool:
        assert_ddp_averages(pool, 2)
    assert lambda_lab.live() == []


def test_capacity_moves_to_the_next_region_then_the_next_type(lambda_lab: LambdaLab) -> None:
    """The cheapest type is listed with room in us-east-1 but has none (the listing is
    older than the launch); the next region has 1 (not 2): the next type is launched."""
    lambda_lab.add_type(
        "gpu_1x_a100",
        "A100 (40 GB PCIe)",
        1,
        110,
        capacity={"us-east-1": 0, "us-west-1": 1},
        listed={"us-east-1"},
    )
    lambda_lab.add_type("gpu_1x_a100_sxm4", "A100 (40 GB SXM4)", 1, 129, capacity={"us-south-1": 2})
    with sky.Compute(provider=lam(), accelerator="A100", nodes=2) as pool:
        assert sorted(p[0] for p in place() @ pool) == [0, 1]
        assert {(i.type.name, i.region) for i in lambda_lab.live()} == {
            ("gpu_1x_a100_sxm4", "us-south-1")
        }
    tried = [(b["instance_type_name"], b["region_name"]) for b in lambda_lab.launches]
    assert tried == [
        ("gpu_1x_a100", "us-east-1"),
        ("gpu_1x_a100", "us-west-1"),
        ("gpu_1x_a100_sxm4", "us-south-1"),
    ]
    assert lambda_lab.live() == []


def test_variants_and_counts_select_the_types(lambda_lab: LambdaLab) -> None:
    lambda_lab.add_type("gpu_1x_a100", "A100 (40 GB PCIe)", 1, 110)
    lambda_lab.add_type("gpu_8x_a100_80gb_sxm4", "A100 (80 GB SXM4)", 8, 1432)
    lambda_lab.add_type("gpu_8x_h100_sxm5", "H100 (80 GB SXM5)", 8, 2392)
    spec = sky.PoolSpec("o", 1, sky.accelerators.A100(8, memory="80GB"), None, (), sky.Options())
    assert [(o.detail, o.hourly, o.count, o.region) for o in lam().offers(spec)] == [
        ("gpu_8x_a100_80gb_sxm4", 14.32, 8, "us-east-1")
    ]
    one = sky.PoolSpec("o", 1, sky.Accelerator("A100"), None, (), sky.Options())
    assert [o.detail for o in lam().offers(one)] == ["gpu_1x_a100"]
    with pytest.raises(ConfigurationError, match="no Lambda Cloud offer is accelerator 'H200'"):
        sky.Compute(provider=lam(), accelerator="H200").open()
    assert lambda_lab.launches == []


def test_a_bad_key_is_refused_before_launching_naming_the_variable(lambda_lab: LambdaLab) -> None:
    lambda_lab.add_type("gpu_1x_a10", "A10", 1, 75)
    os.environ["LAMBDA_API_KEY"] = "secret_wrong_" + "1" * 20
    with pytest.raises(ConfigurationError, match="refused the API key from LAMBDA_API_KEY") as e:
        sky.Compute(provider=lam(), accelerator="A10").open()
    assert "1" * 20 not in str(e.value) and lambda_lab.launches == []


def test_nothing_left_after_an_exception(lambda_lab: LambdaLab) -> None:
    lambda_lab.add_type("gpu_1x_a10", "A10", 1, 75)
    with (
        pytest.raises(ZeroDivisionError),
        sky.Compute(provider=lam(), accelerator="A10", nodes=2) as pool,
    ):
        boom() @ pool
    assert lambda_lab.live() == [] and lambda_lab.keys == {}


_BOOTING = """
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
import flotilla as sky
with sky.Compute(provider=sky.LambdaCloud(ssh_user="root"), accelerator="A10", nodes=2,
                 options=sky.Options(heartbeat_timeout=2, start_timeout=600)):
    print("opened", flush=True)
"""


def test_ctrl_c_while_instances_boot_terminates_them(lambda_lab: LambdaLab) -> None:
    lambda_lab.add_type("gpu_1x_a10", "A10", 1, 75)
    out, err = interrupted_while_booting(lambda_lab, _BOOTING)
    assert "opened" not in out
    assert lambda_lab.live() == [] and lambda_lab.keys == {}, err


_CLIENT = """
import time
import flotilla as sky
with sky.Compute(provider=sky.LambdaCloud(ssh_user="root", ttl=3, ttl_api_key={key!r}),
                 accelerator="A10", nodes=2,
                 options=sky.Options(heartbeat_timeout=2, start_timeout=60)) as pool:
    print(pool.pool_id, flush=True)
    time.sleep(600)
"""


def test_kill9_instances_terminate_themselves_and_orphans_are_found(lambda_lab: LambdaLab) -> None:
    """A client killed with SIGKILL: each instance's watchdog runs its terminate script
    (the ttl key, in a root-only file), which finds the instance by its own addresses;
    remove_orphans() finds a dead client's pool by name, and leaves others alone."""
    lambda_lab.self_key = "secret_instances_" + "2" * 16
    lambda_lab.add_type("gpu_1x_a10", "A10", 1, 75, capacity={"us-east-1": 6})
    pool_id, mine = killed_client(lambda_lab, _CLIENT.format(key=lambda_lab.self_key))
    assert lambda_lab.wait_gone(120, f"flotilla:{pool_id}:") == [], lambda_lab.console()
    assert all(lambda_lab.terminated[i.id] == "self" for i in mine)
    dead = subprocess.Popen(["true"])
    dead.wait()
    api = sky.LambdaCloud().api
    for name in (f"flotilla:deadbeef:{socket.gethostname()}:{dead.pid}:1", "other"):
        api.call(
            "POST",
            "/instance-operations/launch",
            "launch",
            {
                "region_name": "us-east-1",
                "instance_type_name": "gpu_1x_a10",
                "quantity": 1,
                "name": name,
            },
        )
    found = sky.LambdaCloud().remove_orphans(dry_run=True)
    assert found.pools == ("deadbeef",) and len(lambda_lab.live()) == 2
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-lambda-{pool_id}-*"))
    found = sky.LambdaCloud().remove_orphans()
    assert found.pools == ("deadbeef",) and [i.name for i in lambda_lab.live()] == ["other"]
    # the killed client's local key folder went too
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-lambda-{pool_id}-*")) == []


def test_the_guard_terminates_an_instance_no_agent_reaches(lambda_lab: LambdaLab) -> None:
    from flotilla._providers.lambda_cloud.pool import LambdaAllocation

    lambda_lab.add_type("gpu_1x_a10", "A10", 1, 75)
    provider = lam(ttl=2.0)
    spec = sky.PoolSpec("g1", 1, sky.Accelerator("A10"), None, (), sky.Options(start_timeout=1))
    allocation = LambdaAllocation(provider.settings, provider.api, API_KEY, spec)
    from flotilla._providers.cloud.keys import keygen

    allocation.login_key = keygen(allocation.folder, "login", "t")
    body = {
        "region_name": "us-east-1",
        "instance_type_name": "gpu_1x_a10",
        "quantity": 1,
        "name": "guarded",
        "user_data": allocation._user_data(keygen(allocation.folder, "h", "t")),
    }
    (ident,) = provider.api.call("POST", "/instance-operations/launch", "launch", body)["data"][
        "instance_ids"
    ]
    try:
        assert wait_until(lambda: ident in lambda_lab.terminated, 60), lambda_lab.console()
    finally:
        shutil.rmtree(allocation.folder)


def test_errors_are_provision_errors(lambda_lab: LambdaLab) -> None:
    lambda_lab.add_type("gpu_1x_a10", "A10", 1, 75, capacity={"us-east-1": 0})
    with pytest.raises(ProvisionError, match="no capacity") as info:
        sky.Compute(provider=lam(), accelerator="A10").open()
    assert info.value.cause is sky.ProvisionCause.CAPACITY
    assert lambda_lab.live() == [] and lambda_lab.keys == {}
