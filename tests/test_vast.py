"""The Vast.ai provider on the lab's stand-in marketplace (``_vast.py``): real sshd in
network namespaces at a public address and mapped port, a boot delay, physical clusters and
overlay networks."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

import pytest
from _procs import interruptible, wait_until
from _standin import interrupted_while_booting, killed_client, start_client
from _vast import API_KEY, VastLab, vast_lab_fixture  # noqa: F401 - the vast_lab fixture

import flotilla as sky
from flotilla._errors import ConfigurationError, ProvisionError

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@sky.function
def place() -> tuple[int, str, str, list[str]]:
    info = sky.instance_info()
    return info.node, info.addr, info.head_addr, [p.addr for p in info.peers]


def _rented(lab: VastLab) -> int:
    return sum(1 for method, path in lab.requests if method == "PUT" and "/asks/" in path)


def _overlay_subnet(lab: VastLab) -> str:
    (overlay,) = lab.overlays.values()
    return overlay.subnet + "."


@sky.function
def train() -> None:
    info = sky.instance_info()
    print(f"Node {info.node} of {info.total_nodes}")


def test_reference_example_four_nodes_on_one_cluster(
    vast_lab: VastLab, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reference document's first example (000), unchanged but for the import; the key
    and URL come from the environment (VAST_API_KEY, VAST_URL)."""
    vast_lab.add_machines(4, cluster_id=7, dph_total=1.5)
    vast_lab.add_machines(3, cluster_id=None, dph_total=0.4)  # cheaper, but no cluster
    assert os.environ["VAST_API_KEY"] == API_KEY and os.environ["VAST_URL"] == vast_lab.url
    with sky.Compute(
        provider=sky.VastAI(), accelerator=sky.accelerators.A100(), nodes=4
    ) as compute:
        train() @ compute  # runs on all 4 nodes
        pool = compute
        places = place() @ pool
        subnet = _overlay_subnet(vast_lab)
        live = vast_lab.live()
        assert {i.machine.spec.cluster_id for i in live} == {7}
    assert [p[0] for p in places] == [0, 1, 2, 3]
    # peers talk over the overlay network: every address is an overlay address
    assert all(p[1].startswith(subnet) and p[2] == places[0][1] for p in places), places
    assert all(sorted(p[3]) == sorted(q[1] for q in places) for p in places)
    # nothing left: every instance destroyed by the client, the overlay deleted
    assert vast_lab.live() == [] and vast_lab.overlays == {}
    assert set(vast_lab.destroyed.values()) == {"account"}
    out = capsys.readouterr().out
    assert sorted(line for line in out.splitlines() if "Node" in line) == [
        f"(node-{k}, rank={k}) Node {k} of 4" for k in range(4)
    ]


def test_standalone_pool_spans_machines_anywhere(vast_lab: VastLab) -> None:
    vast_lab.add_machines(1, cluster_id=1, dph_total=0.3)
    vast_lab.add_machines(1, cluster_id=None, dph_total=0.2, geolocation="SE")
    vast_lab.add_machines(1, cluster_id=2, dph_total=0.9)  # the dearest: not rented
    with sky.Compute(
        provider=sky.VastAI(),
        accelerator="A100",
        nodes=2,
        options=sky.Options(cluster=False),
    ) as pool:
        rented = sorted(i.machine.spec.dph_total for i in vast_lab.live())
        nodes = place() @ pool
        assert vast_lab.overlays == {}
    assert rented == [0.2, 0.3] and sorted(n[0] for n in nodes) == [0, 1]
    assert vast_lab.live() == []


def test_no_cluster_for_n_nodes_says_so_before_renting(vast_lab: VastLab) -> None:
    vast_lab.add_machines(2, cluster_id=1)
    vast_lab.add_machines(2, cluster_id=2)
    with pytest.raises(ProvisionError, match="no physical cluster") as info:
        sky.Compute(provider=sky.VastAI(), accelerator="A100", nodes=3).open()
    assert "Options(cluster=False)" in str(info.value) and "fewer nodes" in str(info.value)
    assert _rented(vast_lab) == 0


def test_unsatisfiable_request_is_refused_before_renting(vast_lab: VastLab) -> None:
    vast_lab.add_machines(2, cluster_id=1, gpu_name="RTX 4090")
    with pytest.raises(ProvisionError, match=r"no offer for 8 x H100") as info:
        sky.Compute(provider=sky.VastAI(), accelerator="H100:8", nodes=1).open()
    assert info.value.cause is sky.ProvisionCause.CAPACITY
    assert _rented(vast_lab) == 0


def test_max_hourly_cost_refuses_an_expensive_offer_before_renting(vast_lab: VastLab) -> None:
    vast_lab.add_machines(2, cluster_id=3, dph_total=2.0)
    with pytest.raises(ProvisionError, match=r"\$4\.00/h, above max_hourly_cost=\$3\.00/h"):
        sky.Compute(provider=sky.VastAI(), accelerator="A100", nodes=2, max_hourly_cost=3.0).open()
    assert _rented(vast_lab) == 0


def test_search_filters_as_the_official_client(vast_lab: VastLab) -> None:
    """The query's fields (vCPUs, memory in MB, reliability, region) select the offers."""
    vast_lab.add_machines(1, cpu_cores_effective=4, dph_total=0.1)
    vast_lab.add_machines(1, cpu_ram=8000, dph_total=0.1)
    vast_lab.add_machines(1, reliability=0.5, dph_total=0.1)
    vast_lab.add_machines(1, geolocation="CN", dph_total=0.1)
    (good,) = vast_lab.add_machines(1, dph_total=0.9)
    provider = sky.VastAI(regions=["us", "SE"], min_reliability=0.95)
    spec = sky.PoolSpec("x", 1, sky.Accelerator("A100", 1), None, (), sky.Options(), 8, 32)
    offers = provider.offers(spec)
    assert [o.detail for o in offers] == [f"offer {good.ask_id} (machine {good.machine_id})"]
    assert offers[0].hourly == 0.9 and offers[0].region == "US"


def test_host_key_is_pinned_not_trusted(vast_lab: VastLab) -> None:
    """An instance whose sshd presents another key than the one the pool installed
    through the on-start script is refused, and nothing is left."""
    vast_lab.add_machines(1)
    vast_lab.impostor = True
    with pytest.raises(ProvisionError, match="REFUSED"):
        sky.Compute(
            provider=sky.VastAI(), accelerator="A100", options=sky.Options(start_timeout=20)
        ).open()
    assert vast_lab.live() == []


def test_rate_limited_calls_are_retried(vast_lab: VastLab) -> None:
    vast_lab.add_machines(1)
    vast_lab.throttle = 2  # the next two requests answer 429
    with sky.Compute(provider=sky.VastAI(), accelerator="A100") as pool:
        assert [n[0] for n in place() @ pool] == [0]
    assert vast_lab.live() == []


def test_the_key_is_never_shown(vast_lab: VastLab) -> None:
    secret = "k-" + "7" * 30
    provider = sky.VastAI(api_key=secret)
    assert secret not in repr(provider) and secret not in repr(provider.settings)
    with pytest.raises(ConfigurationError) as info:
        provider.check()
    assert "refused the API key" in str(info.value) and secret not in str(info.value)


def test_key_from_the_official_clients_file(
    vast_lab: VastLab, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VAST_API_KEY")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigurationError, match="no Vast API key"):
        sky.VastAI().check()
    (tmp_path / "vastai").mkdir()
    (tmp_path / "vastai" / "vast_api_key").write_text(API_KEY + "\n")
    assert "key accepted" in sky.VastAI().check()


def test_ddp_over_the_overlay(vast_lab: VastLab) -> None:
    pytest.importorskip("torch")
    from _ddp import assert_ddp_averages

    from flotilla import plugins

    vast_lab.add_machines(2, cluster_id=4)
    provider = sky.VastAI(python=sys.executable)  # the interpreter with torch
    with sky.Compute(
        provider=provider, accelerator="A100", nodes=2, plugins=[plugins.torch()]
    ) as pool:
        subnet = _overlay_subnet(vast_lab)
        assert all(p[1].startswith(subnet) for p in place() @ pool)
        assert_ddp_averages(pool, 2)
    assert vast_lab.live() == []


_CLIENT = """
import sys, time
sys.path.insert(0, {tests!r})
import flotilla as sky
options = sky.Options(heartbeat_timeout=2, start_timeout={start_timeout!r})
with sky.Compute(provider=sky.VastAI(ttl={ttl!r}), accelerator="A100", nodes=2,
                 options=options) as pool:
    print(pool.pool_id, flush=True)
    time.sleep(600)
"""


def _client(ttl: float, start_timeout: float = 60.0) -> str:
    return _CLIENT.format(tests=os.path.dirname(__file__), ttl=ttl, start_timeout=start_timeout)


def test_kill9_instances_destroy_themselves_and_orphans_are_found(vast_lab: VastLab) -> None:
    """A client killed with SIGKILL: each instance's watchdog destroys it (with the
    instance's own key) ttl s after the client's last contact; a pool left behind is
    found by its label by remove_orphans(), which removes the killed client's local key
    folder too."""
    ttl = 3.0
    # instances an earlier test's killed client left end by their own ttl: wait for them,
    # so that this test's count is of its own pool only
    assert vast_lab.wait_gone(120) == []
    vast_lab.add_machines(2, cluster_id=5)
    pool_id, mine = killed_client(vast_lab, _client(ttl))
    left = vast_lab.wait_gone(120, f"flotilla:{pool_id}:")
    assert left == [], [(i.id, vast_lab.watchdog_log(i.id)) for i in left]
    assert all(vast_lab.destroyed[i.id] == "self" for i in mine)
    for i in mine:  # not before ttl s after the client's last contact
        last = vast_lab.contact(i.id)
        assert last > 0 and vast_lab.destroyed_at[i.id] >= last + ttl
    # orphans: a rented instance labelled for a dead client on this machine
    vast_lab.add_machines(1)
    offer = sky.VastAI().offers(sky.PoolSpec("o", 1, None, None, (), sky.Options(cluster=False)))[0]
    dead = subprocess.Popen(["true"])
    dead.wait()
    import socket

    label = f"flotilla:deadbeef:{socket.gethostname()}:{dead.pid}:1"
    ask = int(offer.detail.split()[1])
    api = sky.VastAI().api
    api.call("PUT", f"/asks/{ask}/", "rent", {"client_id": "me", "label": label})
    assert len(vast_lab.live("flotilla:deadbeef:")) == 1
    found = sky.VastAI().remove_orphans(dry_run=True)
    assert found.pools == ("deadbeef",) and len(vast_lab.live("flotilla:deadbeef:")) == 1
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-vast-{pool_id}-*"))
    found = sky.VastAI().remove_orphans()
    assert found.pools == ("deadbeef",)
    assert vast_lab.wait_gone(10, "flotilla:deadbeef:") == []
    # the killed client's local key folder went too
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-vast-{pool_id}-*")) == []


def test_guard_destroys_an_instance_no_agent_reaches(vast_lab: VastLab) -> None:
    """Instances rented whose agent never starts: the on-start script's guard destroys
    each max(ttl, start_timeout) s after its start, with the instance's own key."""
    from flotilla._providers.cloud.keys import keygen
    from flotilla._providers.vast.onstart import onstart_script

    vast_lab.add_machines(1)
    key = keygen(str(vast_lab.lab.tmp), "guard_host_key", "t")
    script = onstart_script("g1", key, vast_lab.url, "/root/.flotilla", 2.0, 1.0)
    offer = sky.VastAI().offers(sky.PoolSpec("g", 1, None, None, (), sky.Options()))[0]
    ask = int(offer.detail.split()[1])
    reply = sky.VastAI().api.call(
        "PUT", f"/asks/{ask}/", "rent", {"client_id": "me", "label": "x", "onstart": script}
    )
    ident = int(reply["new_contract"])
    assert wait_until(lambda: ident in vast_lab.destroyed, 30), vast_lab.onstart_log(ident)
    assert vast_lab.destroyed[ident] == "self"


def test_nothing_left_after_ctrl_c(vast_lab: VastLab) -> None:
    vast_lab.add_machines(2, cluster_id=6)
    proc = start_client(_client(ttl=600), preexec_fn=interruptible)  # it gets Ctrl-C (SIGINT)
    try:
        assert proc.stdout is not None
        pool_id = proc.stdout.readline().strip()
        assert pool_id, proc.stderr.read() if proc.stderr else ""
        assert len(vast_lab.live(f"flotilla:{pool_id}:")) == 2
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "interrupted (Ctrl-C); the pool was closed" in err  # one line, no traceback
    assert vast_lab.live() == [] and vast_lab.overlays == {}
    assert set(vast_lab.destroyed.values()) == {"account"}


_BOOTING_CLIENT = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # even under a nohup'd suite
import flotilla as sky
options = sky.Options(heartbeat_timeout=2, start_timeout=600)
with sky.Compute(provider=sky.VastAI(ttl=600), accelerator="A100", nodes=2, options=options):
    print("opened", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_while_instances_boot_destroys_them_before_the_client_exits(
    vast_lab: VastLab, signum: int
) -> None:
    """Ctrl-C (or SIGTERM) while both instances of a 2-node pool are still loading: the
    client destroys them, and the overlay, before it exits (no ttl: they would have been
    billed until their watchdog)."""
    vast_lab.add_machines(2, cluster_id=7)

    def loading() -> None:  # they stay "loading"
        assert {vast_lab.instance_json(i)["actual_status"] for i in vast_lab.live()} == {"loading"}

    out, err = interrupted_while_booting(vast_lab, _BOOTING_CLIENT, signum, booting=loading)
    assert "opened" not in out
    # right after the exit, not eventually: nothing is rented any more
    assert vast_lab.live() == [], err
    assert vast_lab.overlays == {}, err
    assert set(vast_lab.destroyed.values()) == {"account"}


def test_a_pool_filling_its_cluster_replaces_a_lost_node_on_the_freed_machine(
    vast_lab: VastLab,
) -> None:
    """A 2-node pool fills physical cluster 7002: its node 1 is lost (the agent killed),
    and its replacement goes on the machine the lost instance freed (the only one left
    in the cluster), joined to the overlay; a cheaper cluster elsewhere is not used (its
    machines cannot join the pool's overlay)."""
    vast_lab.add_machines(2, cluster_id=7002)
    with sky.Compute(provider=sky.VastAI(), accelerator="A100", nodes=2) as pool:
        vast_lab.add_machines(2, cluster_id=7003, dph_total=0.2)  # after the choice
        lost = pool._nodes[1]
        assert pool._allocation is not None
        ident = int(pool._allocation.machines[1].ident)
        (before,) = [i for i in vast_lab.live() if i.id == ident]
        os.kill(int(lost.hello_info["pid"]), signal.SIGKILL)
        assert wait_until(
            lambda: pool._nodes[1] is not lost and pool._nodes[1].state.value == "ready",
            timeout=120,
        ), "node 1 was not replaced"
        places = place() @ pool
        live = vast_lab.live()
        assert {i.machine.spec.cluster_id for i in live} == {7002}
        assert before.machine.machine_id in {i.machine.machine_id for i in live}
        assert before.id not in {i.id for i in live}
    subnet = _overlay_subnet_of(places)
    assert [p[0] for p in places] == [0, 1] and all(p[1].startswith(subnet) for p in places)
    assert vast_lab.live() == [] and vast_lab.overlays == {}


def _overlay_subnet_of(places: list[tuple[int, str, str, list[str]]]) -> str:
    return places[0][1].rsplit(".", 1)[0] + "."


def test_a_server_error_while_making_the_overlay_is_tried_again(vast_lab: VastLab) -> None:
    """One HTTP 500 from the API when the overlay network is made: the call is tried
    again after a short wait, and the pool starts."""
    vast_lab.add_machines(2, cluster_id=8)
    vast_lab.failing[("POST", "/overlay/")] = 1
    vast_lab.failing[("PUT", "/overlay/")] = 1  # and one of the joins
    with sky.Compute(provider=sky.VastAI(), accelerator="A100", nodes=2) as pool:
        assert [p[0] for p in place() @ pool] == [0, 1]
    made = [r for r in vast_lab.requests if r == ("POST", "/api/v0/overlay/")]
    assert len(made) == 2
    assert vast_lab.failing == {("POST", "/overlay/"): 0, ("PUT", "/overlay/"): 0}
    assert vast_lab.live() == [] and vast_lab.overlays == {}


def test_nothing_left_after_an_exception(vast_lab: VastLab) -> None:
    vast_lab.add_machines(2, cluster_id=6)
    with (
        pytest.raises(ZeroDivisionError),
        sky.Compute(provider=sky.VastAI(), accelerator="A100", nodes=2) as pool,
    ):
        boom() @ pool
    assert vast_lab.live() == [] and vast_lab.overlays == {}


@sky.function
def boom() -> float:
    return 1 / 0


def test_offers_across_configured_providers(vast_lab: VastLab) -> None:
    """flotilla.offers(): every configured provider's offers (Vast here: its key is in the
    environment), cheapest first, with type, count, price, region and spot."""
    vast_lab.add_machines(1, gpu_name="H100 SXM", num_gpus=8, dph_total=19.5, geolocation="SE")
    vast_lab.add_machines(1, gpu_name="H100 PCIE", num_gpus=8, dph_total=16.0)
    vast_lab.add_machines(1, gpu_name="A100 SXM4", num_gpus=8, dph_total=9.0)
    found = [o for o in sky.offers("H100:8") if o.provider == "vast"]
    assert [(o.accelerator, o.count, o.hourly, o.region, o.spot) for o in found] == [
        ("H100 PCIE", 8, 16.0, "US", False),
        ("H100 SXM", 8, 19.5, "SE", False),
    ]
    assert _rented(vast_lab) == 0


def test_settings_vast_cannot_take_are_refused_before_renting(vast_lab: VastLab) -> None:
    vast_lab.add_machines(1)
    with pytest.raises(ConfigurationError, match=r"on-start script is \d+ characters"):
        sky.Compute(provider=sky.VastAI(workdir="/" + "w" * 900), accelerator="A100").open()
    with pytest.raises(ConfigurationError, match="ttl"):
        sky.Compute(provider=sky.VastAI(ttl=5), options=sky.Options(heartbeat_timeout=10)).open()
    assert vast_lab.requests == [] or _rented(vast_lab) == 0


def test_guard_leaves_a_live_pool_to_its_watchdog(vast_lab: VastLab) -> None:
    """The on-start guard of a pool whose agents started sees their watchdog's contact
    file and exits; nothing is destroyed while the client is alive and in contact."""
    vast_lab.add_machines(2, cluster_id=2)
    options = sky.Options(heartbeat_timeout=2, start_timeout=8)
    with sky.Compute(
        provider=sky.VastAI(ttl=3), accelerator="A100", nodes=2, options=options
    ) as pool:
        ids = [i.id for i in vast_lab.live()]
        assert wait_until(
            lambda: all("its watchdog is in charge" in vast_lab.onstart_log(i) for i in ids),
            60,
        ), [vast_lab.onstart_log(i) for i in ids]
        assert [n[0] for n in place() @ pool] == [0, 1]
        assert vast_lab.destroyed == {}
    assert set(vast_lab.destroyed.values()) == {"account"}
