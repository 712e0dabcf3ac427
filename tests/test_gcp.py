"""The GCP provider on the lab's stand-in Compute Engine (``_gcp.py``): Google's official
client and google-auth against the stand-in API and token endpoint; instances are real sshd
in network namespaces at their external address, on a VPC network of their own, booting in
2 s."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest
from _gcp import PROJECT, GcpLab, gcp_lab_fixture  # noqa: F401 - the gcp_lab fixture
from _procs import wait_until
from _standin import interrupted_while_booting, killed_client

import flotilla as sky
from flotilla._errors import ConfigurationError, ProvisionError

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def lab_gcp(**kw: Any) -> sky.GCP:
    """The provider as the lab's instances need it: root login (the lab's hosts have no
    other user), the client's interpreter."""
    kw.setdefault("ssh_user", "root")
    kw.setdefault("python", sys.executable)
    return sky.GCP(**kw)


@sky.function
def place() -> tuple[int, str, str, list[str]]:
    info = sky.instance_info()
    return info.node, info.addr, info.head_addr, [p.addr for p in info.peers]


@sky.function
def boom() -> float:
    return 1 / 0


def test_the_official_client_drives_the_stand_in(gcp_lab: GcpLab) -> None:
    """google-cloud-compute (REST, ``api_endpoint``, anonymous credentials) inserts an
    instance with ``insert_unary``, waits with a ZoneOperationsClient at the same endpoint,
    reads it and its guest attributes, lists, stops, updates the metadata of, starts and
    deletes it."""
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1 as c

    gcp_lab.anonymous = True
    options = ClientOptions(api_endpoint=gcp_lab.url)
    kw: dict[str, Any] = {"credentials": AnonymousCredentials(), "client_options": options}
    instances, ops = c.InstancesClient(**kw), c.ZoneOperationsClient(**kw)
    zone = "us-central1-b"
    body = c.Instance(
        name="probe-1",
        machine_type=f"zones/{zone}/machineTypes/n2-standard-2",
        labels={"team": "x"},
        network_interfaces=[
            c.NetworkInterface(access_configs=[c.AccessConfig(type_="ONE_TO_ONE_NAT")])
        ],
        metadata=c.Metadata(items=[c.Items(key="enable-guest-attributes", value="TRUE")]),
    )
    op = instances.insert_unary(project=PROJECT, zone=zone, instance_resource=body)
    op = ops.wait(project=PROJECT, zone=zone, operation=op.name)
    assert op.status == c.Operation.Status.DONE and not op.error.errors
    got = instances.get(project=PROJECT, zone=zone, instance="probe-1")
    assert got.status == "RUNNING" and got.network_interfaces[0].access_configs[0].nat_i_p
    assert got.network_interfaces[0].network_i_p.startswith(gcp_lab.vpc_subnet + ".")
    from google.api_core.exceptions import NotFound

    def host_keys() -> list[str]:
        request = c.GetGuestAttributesInstanceRequest(
            project=PROJECT, zone=zone, instance="probe-1", query_path="hostkeys/"
        )
        try:  # 404 until the guest agent publishes them
            found = instances.get_guest_attributes(request=request)
        except NotFound:
            return []
        return [i.value for i in found.query_value.items if i.namespace == "hostkeys"]

    assert host_keys() == []
    assert wait_until(lambda: bool(host_keys()), 30)
    assert host_keys()[0].startswith("ssh-ed25519 ")
    listed = instances.list(
        request=c.ListInstancesRequest(project=PROJECT, zone=zone, filter='labels.team = "x"')
    )
    assert [i.name for i in listed] == ["probe-1"]
    # stop keeps the instance (TERMINATED, guest attributes gone); setMetadata with the
    # current fingerprint; start boots it again with the same host key
    key = host_keys()[0]
    op = instances.stop_unary(project=PROJECT, zone=zone, instance="probe-1")
    assert ops.wait(project=PROJECT, zone=zone, operation=op.name).status == op.Status.DONE
    got = instances.get(project=PROJECT, zone=zone, instance="probe-1")
    assert got.status == "TERMINATED" and host_keys() == []
    meta = c.Metadata(
        fingerprint=got.metadata.fingerprint,
        items=[*got.metadata.items, c.Items(key="flotilla-client", value="me")],
    )
    op = instances.set_metadata_unary(
        project=PROJECT, zone=zone, instance="probe-1", metadata_resource=meta
    )
    ops.wait(project=PROJECT, zone=zone, operation=op.name)
    with pytest.raises(Exception, match="fingerprint"):  # a stale fingerprint: 412
        instances.set_metadata_unary(
            project=PROJECT, zone=zone, instance="probe-1", metadata_resource=meta
        )
    op = instances.start_unary(project=PROJECT, zone=zone, instance="probe-1")
    ops.wait(project=PROJECT, zone=zone, operation=op.name)
    got = instances.get(project=PROJECT, zone=zone, instance="probe-1")
    assert got.status == "RUNNING" and got.metadata.items[-1].value == "me"
    assert wait_until(lambda: host_keys() == [key], 30), host_keys()
    op = instances.delete_unary(project=PROJECT, zone=zone, instance="probe-1")
    ops.wait(project=PROJECT, zone=zone, operation=op.name)
    assert gcp_lab.live() == []
    # a zone out of capacity: the insert's operation ends DONE with Google's error code
    gcp_lab.capacity[zone] = 0
    body.name = "probe-2"
    op = instances.insert_unary(project=PROJECT, zone=zone, instance_resource=body)
    op = ops.wait(project=PROJECT, zone=zone, operation=op.name)
    assert [e.code for e in op.error.errors] == ["ZONE_RESOURCE_POOL_EXHAUSTED"]


def test_two_nodes_broadcast_over_the_vpc_network(gcp_lab: GcpLab) -> None:
    """Credentials, project and endpoint from the environment (a service-account key file
    whose token_uri is the stand-in's, GOOGLE_CLOUD_PROJECT, gcloud's endpoint override);
    peers talk over the VPC network's internal addresses; everything is deleted after."""
    assert os.environ["GOOGLE_CLOUD_PROJECT"] == PROJECT
    with sky.Compute(provider=lab_gcp(), accelerator="A100", nodes=2) as pool:
        places = place() @ pool
        live = gcp_lab.live(pool.pool_id)
        assert len(live) == 2 and {i.zone for i in live} == {"us-central1-a"}
        assert {i.body["machineType"] for i in live} == {
            "zones/us-central1-a/machineTypes/a2-highgpu-1g"
        }
    vpc = gcp_lab.vpc_subnet + "."
    assert [p[0] for p in places] == [0, 1]
    assert all(p[1].startswith(vpc) and p[2] == places[0][1] for p in places), places
    assert gcp_lab.live() == [] and set(gcp_lab.destroyed.values()) == {"account"}


def test_ddp_over_the_vpc_network(gcp_lab: GcpLab) -> None:
    pytest.importorskip("torch")
    from _ddp import assert_ddp_averages

    from flotilla import plugins

    with sky.Compute(
        provider=lab_gcp(), accelerator="T4", nodes=2, plugins=[plugins.torch()]
    ) as pool:
        (inst, _) = gcp_lab.live(pool.pool_id)
        assert inst.body["guestAccelerators"][0]["acceleratorType"].endswith("nvidia-tesla-t4")
        assert_ddp_averages(pool, 2)
    assert gcp_lab.live() == []


def test_a_zone_out_of_capacity_moves_the_pool_to_the_next_zone(gcp_lab: GcpLab) -> None:
    """us-central1-a holds one more instance only: the pool's instance that got it is
    deleted and both go to us-central1-b."""
    gcp_lab.capacity["us-central1-a"] = 1
    with sky.Compute(provider=lab_gcp(), nodes=2) as pool:
        assert {i.zone for i in gcp_lab.live(pool.pool_id)} == {"us-central1-b"}
        assert [p[0] for p in place() @ pool] == [0, 1]
        first = [n for n, by in gcp_lab.destroyed.items() if by == "account"]
    assert len(first) == 1 and first[0] in {f"flotilla-{pool.pool_id}-{r}" for r in (0, 1)}
    assert gcp_lab.live() == []


def test_every_zone_full_falls_back_to_the_next_provider(gcp_lab: GcpLab) -> None:
    gcp_lab.capacity["us-central1-a"] = 0
    with sky.Compute(
        provider=[lab_gcp(zone="us-central1-a"), lab_gcp(zone="us-west1-b")], nodes=2
    ) as pool:
        assert {i.zone for i in gcp_lab.live(pool.pool_id)} == {"us-west1-b"}
        assert [p[0] for p in place() @ pool] == [0, 1]
    assert gcp_lab.live() == []


def test_spot_if_available_takes_on_demand_when_no_zone_has_spot_capacity(
    gcp_lab: GcpLab,
) -> None:
    for zone in ("us-central1-a", "us-central1-b", "us-central1-c"):
        gcp_lab.spot_capacity[zone] = 0
    with sky.Compute(provider=lab_gcp(allocation="spot-if-available"), nodes=2) as pool:
        live = gcp_lab.live(pool.pool_id)
        assert {i.zone for i in live} == {"us-central1-a"}
        assert all("provisioningModel" not in i.body["scheduling"] for i in live)
        assert [p[0] for p in place() @ pool] == [0, 1]
    assert gcp_lab.live() == []


def test_no_zone_with_room_is_a_capacity_error(gcp_lab: GcpLab) -> None:
    for zone in ("us-central1-a", "us-central1-b", "us-central1-c"):
        gcp_lab.capacity[zone] = 0
    with pytest.raises(ProvisionError, match="no zone had room") as info:
        sky.Compute(provider=lab_gcp(), nodes=1).open()
    assert info.value.cause is sky.ProvisionCause.CAPACITY
    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in str(info.value)
    assert gcp_lab.live() == []


def test_refused_credentials_are_named_before_anything_is_created(
    gcp_lab: GcpLab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key file whose key the token endpoint does not know: a ConfigurationError naming
    GOOGLE_APPLICATION_CREDENTIALS, and no insert."""
    other = gcp_lab.write_key_file(gcp_lab.lab.tmp / "other.json")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(other))
    with pytest.raises(ConfigurationError, match="GOOGLE_APPLICATION_CREDENTIALS") as info:
        sky.Compute(provider=lab_gcp(), nodes=2).open()
    assert "refused the credentials" in str(info.value)
    assert gcp_lab.inserts() == 0
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(gcp_lab.lab.tmp / "missing.json"))
    with pytest.raises(ConfigurationError, match="no usable GCP credentials"):
        lab_gcp().check()


def test_bad_requests_are_refused_before_anything_is_created(gcp_lab: GcpLab) -> None:
    with pytest.raises(ConfigurationError, match="no GCP offer is accelerator 'RTX4090'") as info:
        sky.Compute(provider=lab_gcp(), accelerator="RTX4090").open()
    assert "gcp offers nvidia-a100-80gb" in str(info.value)
    with pytest.raises(ConfigurationError, match="nearest: "):
        sky.Compute(provider=lab_gcp(), accelerator="A1000000").open()
    # TPUs are the Cloud TPU API's, not Compute Engine's: refused, naming what GCP offers
    with pytest.raises(ConfigurationError, match=r"does not offer TPUv5e: .*Cloud TPU API") as tpu:
        sky.Compute(provider=lab_gcp(), accelerator=sky.accelerators.TPUv5e()).open()
    assert "it offers the GPUs nvidia-tesla-t4, " in str(tpu.value)
    assert "nvidia-b200" in str(tpu.value)
    with pytest.raises(ConfigurationError, match="no machine with 3 x A100"):
        sky.Compute(provider=lab_gcp(), accelerator="A100:3").open()
    with pytest.raises(ProvisionError, match=r"above max_hourly_cost=\$5\.00/h"):
        sky.Compute(provider=lab_gcp(), accelerator="A100", nodes=2, max_hourly_cost=5.0).open()
    with pytest.raises(ProvisionError, match=r"above max_node_hourly_cost=\$3\.00/h"):
        sky.Compute(sky.Spec(provider=lab_gcp(), accelerator="A100", max_hourly_cost=3.0)).open()
    with pytest.raises(ConfigurationError, match="zone"):
        sky.GCP(zone="nowhere")
    assert gcp_lab.inserts() == 0


def test_offers_list_each_zone_with_its_list_price(gcp_lab: GcpLab) -> None:
    found = [o for o in sky.offers("A100", providers=[lab_gcp()])]
    assert [(o.region, o.hourly, o.detail) for o in found] == [
        (z, 3.67, "a2-highgpu-1g") for z in ("us-central1-a", "us-central1-b", "us-central1-c")
    ]
    spot = sky.offers("T4:2", providers=[lab_gcp(allocation="spot", region="us-west1")])
    assert [(o.region, o.spot, o.detail) for o in spot] == [
        ("us-west1-b", True, "n1-standard-16 + 2 x nvidia-tesla-t4")
    ]
    assert spot[0].hourly == round((0.76 + 2 * 0.35) * 0.35, 4)


def test_host_keys_come_from_guest_attributes_and_are_pinned(gcp_lab: GcpLab) -> None:
    """An instance whose sshd presents another key than the one its guest agent
    published is refused, and nothing is left."""
    gcp_lab.impostor = True
    with pytest.raises(ProvisionError, match="REFUSED"):
        sky.Compute(provider=lab_gcp(), options=sky.Options(start_timeout=20)).open()
    assert gcp_lab.live() == []


def test_nothing_left_after_an_exception(gcp_lab: GcpLab) -> None:
    with (
        pytest.raises(ZeroDivisionError),
        sky.Compute(provider=lab_gcp(), nodes=2) as pool,
    ):
        boom() @ pool
    assert gcp_lab.live() == []


def test_a_preempted_spot_node_is_noticed_and_replaced(gcp_lab: GcpLab) -> None:
    """SPOT instances: Compute Engine preempts node 1 (``instance/preempted`` TRUE; the
    instance is left running here, so that only the notice can tell the pool): the node's
    poller tells the client, which replaces the node with a new SPOT instance in the pool's
    zone and deletes the old one; the next broadcast answers on 2 nodes."""
    with sky.Compute(provider=lab_gcp(allocation="spot"), nodes=2) as pool:
        allocation = pool._allocation
        assert allocation is not None
        old = allocation.machines[1]
        (inst,) = [i for i in gcp_lab.live() if i.name == old.ident]
        assert inst.body["scheduling"]["provisioningModel"] == "SPOT"
        assert inst.body["scheduling"]["instanceTerminationAction"] == "DELETE"
        gcp_lab.preempt(inst, grace=None)
        assert wait_until(lambda: allocation.machines[1].ident != old.ident, 120)
        new = allocation.machines[1]
        answers = place() @ pool
        assert [a[0] for a in answers] == [0, 1] and answers[1][1] == new.address
        assert wait_until(lambda: old.ident in gcp_lab.destroyed, 60)
        names = {i.name for i in gcp_lab.live(pool.pool_id)}
        assert names == {allocation.machines[0].ident, new.ident}
    assert gcp_lab.live() == []


_CLIENT = """
import sys, time
sys.path.insert(0, {tests!r})
import flotilla as sky
options = sky.Options(heartbeat_timeout=2, start_timeout={start_timeout!r})
provider = sky.GCP(ttl={ttl!r}, ssh_user="root", python=sys.executable)
with sky.Compute(provider=provider, nodes=2, options=options) as pool:
    print(pool.pool_id, flush=True)
    time.sleep(600)
"""


def _client(ttl: float, start_timeout: float = 60.0) -> str:
    return _CLIENT.format(tests=os.path.dirname(__file__), ttl=ttl, start_timeout=start_timeout)


@pytest.mark.timeout(480)  # a client process of its own: its start, under load
def test_kill9_instances_delete_themselves_and_orphans_are_found(gcp_lab: GcpLab) -> None:
    """A client killed with SIGKILL: each instance's watchdog deletes it through the API
    with the instance's own service-account token, ttl s after the client's last contact;
    then remove_orphans() deletes a pool left by a dead client of this machine (and the
    killed client's local key folder), and not a pool of a client elsewhere."""
    ttl = 3.0
    pool_id, mine = killed_client(gcp_lab, _client(ttl), which="{}")
    left = gcp_lab.wait_gone(120, pool_id)
    assert left == [], [gcp_lab.log(i) for i in left]
    assert all(gcp_lab.destroyed[i.name] == "self" for i in mine)
    for i in mine:  # not before ttl s after the client's last contact
        last = gcp_lab.contact(i)
        assert last > 0 and gcp_lab.destroyed_at[i.name] >= last + ttl
    dead = subprocess.Popen(["true"])
    dead.wait()
    _insert_labelled("deadbeef", f"{socket.gethostname()}:{dead.pid}:1")
    _insert_labelled("c0ffee01", "elsewhere:1:1")
    found = lab_gcp().remove_orphans(dry_run=True)
    assert found.pools == ("deadbeef",) and found.skipped == ("c0ffee01",)
    assert len(gcp_lab.live("deadbeef")) == 1
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-gcp-{pool_id}-*"))
    found = lab_gcp().remove_orphans()
    assert found.instances == ("us-central1-c/flotilla-deadbeef-0",)
    assert gcp_lab.live("deadbeef") == [] and len(gcp_lab.live("c0ffee01")) == 1
    # the killed client's local key folder went too
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-gcp-{pool_id}-*")) == []


def _insert_labelled(pool: str, client: str) -> None:
    from google.cloud import compute_v1 as c

    api = lab_gcp().api
    body = c.Instance(
        name=f"flotilla-{pool}-0",
        machine_type="zones/us-central1-c/machineTypes/n2-standard-2",
        labels={"flotilla-pool": pool},
        metadata=c.Metadata(items=[c.Items(key="flotilla-client", value=client)]),
    )
    op = api.client("InstancesClient").insert_unary(
        project=PROJECT, zone="us-central1-c", instance_resource=body
    )
    api.wait("us-central1-c", op, "insert", time.monotonic() + 30)


def test_guard_deletes_an_instance_no_agent_reaches(gcp_lab: GcpLab) -> None:
    """An instance whose agent never starts: its startup script's guard deletes it
    max(ttl, start_timeout) s after the boot, with its own token."""
    from google.cloud import compute_v1 as c

    from flotilla._providers.gcp.startup import startup_script

    script = startup_script(gcp_lab.url, 2.0, 1.0, "~/.flotilla", "root")
    api = lab_gcp().api
    body = c.Instance(
        name="guarded",
        machine_type="zones/us-central1-a/machineTypes/n2-standard-2",
        metadata=c.Metadata(items=[c.Items(key="startup-script", value=script)]),
    )
    op = api.client("InstancesClient").insert_unary(
        project=PROJECT, zone="us-central1-a", instance_resource=body
    )
    api.wait("us-central1-a", op, "insert", time.monotonic() + 30)
    (inst,) = gcp_lab.live()
    assert wait_until(lambda: "guarded" in gcp_lab.destroyed, 60), gcp_lab.log(inst)
    assert gcp_lab.destroyed["guarded"] == "self"


_BOOTING_CLIENT = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # even under a nohup'd suite
import flotilla as sky
options = sky.Options(heartbeat_timeout=2, start_timeout=600)
provider = sky.GCP(ttl=600, ssh_user="root")
with sky.Compute(provider=provider, nodes=2, options=options):
    print("opened", flush=True)
"""


@pytest.mark.timeout(480)  # a client process of its own: its start, under load
def test_ctrl_c_while_instances_boot_deletes_them_before_the_client_exits(
    gcp_lab: GcpLab,
) -> None:
    # the instances never publish host keys
    out, err = interrupted_while_booting(gcp_lab, _BOOTING_CLIENT, wait=240)
    assert "opened" not in out
    assert gcp_lab.live() == [], err
    assert set(gcp_lab.destroyed.values()) == {"account"}


def test_settings_from_a_task_file_infra() -> None:
    from flotilla._providers.gcp.settings import GCPSettings
    from flotilla._providers.options import task_values

    got = task_values(GCPSettings, "us-west1/us-west1-b", {"use_spot": True})
    assert (
        got["region"] == "us-west1" and got["zone"] == "us-west1-b" and got["allocation"] == "spot"
    )
    got = task_values(GCPSettings, "europe-west4", {})
    assert (
        got["region"] == "europe-west4" and got["zone"] is None and got["allocation"] == "on-demand"
    )
    assert GCPSettings(**got).zone is None


def test_skywards_spec_places_a_gcp_pool(gcp_lab: GcpLab) -> None:
    """Skyward's spelling: a Spec's region, disk_gb and allocation go to GCP's settings of
    that meaning (region, disk_size_gb, allocation)."""
    spec = sky.Spec(
        provider=lab_gcp(), accelerator="A100", region="us-west1", disk_gb=50, allocation="spot"
    )
    with sky.Compute(spec, nodes=1) as pool:
        (inst,) = gcp_lab.live(pool.pool_id)
        assert [n[0] for n in place() @ pool] == [0]
    assert inst.zone == "us-west1-b"
    assert inst.body["disks"][0]["initializeParams"]["diskSizeGb"] == "50"
    assert inst.body["scheduling"]["provisioningModel"] == "SPOT"
    assert gcp_lab.live() == []
