"""The Verda provider on the lab's stand-in (``_verda.py``): its REST API as the official
``verda`` client calls it; instances are real sshd in network namespaces, reachable only
at their public address, port 22, after a boot delay (0.5 s). One lab for the module."""

from __future__ import annotations

import glob
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any

import pytest
from _procs import wait_until
from _standin import interrupted_while_booting, killed_client
from _verda import (  # noqa: F401 - the fixtures
    CLIENT_ID,
    CLIENT_SECRET,
    VerdaLab,
    verda_fixture,
    verda_lab_fixture,
)
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture

import flotilla as sky
from flotilla._errors import ConfigurationError

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

A100 = ("1A100.22V", "A100 SXM4 80GB", 1, 1.29)


@sky.function
def place() -> tuple[int, str, str, list[str]]:
    info = sky.instance_info()
    return info.node, info.addr, info.head_addr, [p.addr for p in info.peers]


@sky.function
def boom() -> float:
    return 1 / 0


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), 1):
            return True
    except OSError:
        return False


def test_the_official_client_drives_the_stand_in(verda: VerdaLab) -> None:
    """verda 1.25's own calls: token, types, availability, key, script, an instance
    provisioning then running (its sshd answering), no room elsewhere, delete."""
    from verda import VerdaClient
    from verda.exceptions import APIException

    verda.add_type(*A100, capacity={"FIN-01": 1})
    client = VerdaClient(CLIENT_ID, CLIENT_SECRET, base_url=verda.url)
    (t,) = client.instance_types.get()
    assert (t.instance_type, t.price_per_hour, t.gpu["number_of_gpus"]) == ("1A100.22V", 1.29, 1)
    assert client.instances.get_availabilities(is_spot=False) == [
        {"location_code": "FIN-01", "availabilities": ["1A100.22V"]}
    ]
    key = client.ssh_keys.create("k", "ssh-ed25519 AAAA t")
    script = client.startup_scripts.create("s", "#!/bin/sh\ntrue\n")
    inst = client.instances.create(
        "1A100.22V",
        "ubuntu-24.04-cuda-13.0-open",
        "doc",
        "doc",
        ssh_key_ids=[key.id],
        location="FIN-01",
        startup_script_id=script.id,
    )
    assert inst.status == "provisioning" and inst.location == "FIN-01"
    assert wait_until(lambda: client.instances.get_by_id(inst.id).status == "running", 60)
    assert wait_until(lambda: _answers(str(client.instances.get_by_id(inst.id).ip), 22), 30)
    with pytest.raises(APIException, match="not available in FIN-01"):
        client.instances.create("1A100.22V", "ubuntu-24.04", "x", "x", location="FIN-01")
    # shut down: sshd gone, the disk kept; started again: it boots and answers
    (lab_inst,) = verda.live()
    assert lab_inst.host is not None
    (lab_inst.host.home / "kept.txt").write_text("kept\n")
    client.instances.action(inst.id, "shutdown")
    assert client.instances.get_by_id(inst.id).status == "offline"
    assert verda.lab.pids(lab_inst.host) == [] and not _answers(str(inst_ip(client, inst.id)), 22)
    client.instances.action([inst.id], "start")
    assert wait_until(lambda: client.instances.get_by_id(inst.id).status == "running", 60)
    assert wait_until(lambda: _answers(str(inst_ip(client, inst.id)), 22), 30)
    assert (lab_inst.host.home / "kept.txt").read_text() == "kept\n"
    assert verda.actions == [("shutdown", inst.id), ("start", inst.id)]
    client.instances.action(inst.id, "delete")
    client.ssh_keys.delete_by_id(key.id)
    client.startup_scripts.delete_by_id(script.id)
    assert verda.live() == [] and verda.keys == {} and verda.scripts == {}
    with pytest.raises(APIException, match="Invalid client credentials"):
        VerdaClient(CLIENT_ID, "wrong", base_url=verda.url)


def inst_ip(client: Any, ident: str) -> str:
    return str(client.instances.get_by_id(ident).ip)


def test_two_nodes_broadcast_and_train_with_ddp(verda: VerdaLab) -> None:
    """A broadcast on 2 instances (they reach each other at their public addresses, the
    only network Verda gives), then gloo DDP on the same pool; all given back after."""
    pytest.importorskip("torch")
    from _ddp import assert_ddp_averages

    from flotilla import plugins

    verda.add_type(*A100)
    provider = sky.Verda(python=sys.executable)
    with sky.Compute(
        provider=provider, accelerator="A100", nodes=2, plugins=[plugins.torch()]
    ) as pool:
        places = place() @ pool
        live = verda.live()
        assert len(verda.keys) == 1 and verda.scripts == {}  # used, then deleted
        assert_ddp_averages(pool, 2)
    ips = {i.ip for i in live}
    assert sorted(p[0] for p in places) == [0, 1] and {p[1] for p in places} == ips
    assert all(sorted(p[3]) == sorted(ips) for p in places)
    assert all(c["startup_script_id"] and c["location_code"] == "FIN-01" for c in verda.creates)
    assert verda.wait_gone(30) == [] and verda.keys == {} and verda.scripts == {}
    assert set(verda.deleted.values()) == {"account"}


def test_the_images_own_host_key_is_refused_until_the_script_installs_the_pools(
    verda: VerdaLab,
) -> None:
    """The image's sshd answers with its own key for 6 s before the startup script
    installs the pool's: that key is never trusted, and the start is tried again until
    the pinned key answers."""
    verda.script_late = 6.0
    verda.add_type(*A100)
    with sky.Compute(provider=sky.Verda(), accelerator="A100", nodes=1) as pool:
        assert [p[0] for p in place() @ pool] == [0]


def test_capacity_moves_to_the_next_location_then_the_next_type(verda: VerdaLab) -> None:
    """The cheapest type is listed in FIN-01 but has no room there (the listing is older
    than the create), FIN-02 has room for 1 of 2 (given back); the next type starts."""
    verda.add_type(*A100, capacity={"FIN-01": 0, "FIN-02": 1}, listed={"FIN-01"})
    verda.add_type("1A100.40S.22V", "A100 SXM4 40GB", 1, 1.49, capacity={"ICE-01": 2})
    with sky.Compute(provider=sky.Verda(), accelerator="A100", nodes=2) as pool:
        assert sorted(p[0] for p in place() @ pool) == [0, 1]
        assert {(i.type.name, i.location) for i in verda.live()} == {("1A100.40S.22V", "ICE-01")}
    tried = [(c["instance_type"], c["location_code"]) for c in verda.creates]
    assert tried == [
        ("1A100.22V", "FIN-01"),
        ("1A100.22V", "FIN-02"),
        ("1A100.22V", "FIN-02"),
        ("1A100.40S.22V", "ICE-01"),
        ("1A100.40S.22V", "ICE-01"),
    ]
    assert len(verda.deleted) == 3  # the FIN-02 one given back at once, then the pool's


def test_no_spot_room_falls_back_to_the_next_provider_of_the_list(verda: VerdaLab) -> None:
    """Skyward's spelling: the first spec (spot) has no room anywhere, the second
    (on-demand) starts the pool."""
    verda.add_type(*A100, capacity={"FIN-03": 2}, spot_capacity={})
    with sky.Compute(
        sky.Spec(sky.Verda(allocation="spot"), "A100", nodes=2),
        sky.Spec(sky.Verda(), "A100", nodes=2),
        selection="first",
    ) as pool:
        assert sorted(p[0] for p in place() @ pool) == [0, 1]
        assert {i.is_spot for i in verda.live()} == {False}
    assert [c["is_spot"] for c in verda.creates] == [False, False]


def test_spot_offers_and_a_bad_secret_refused_before_renting(verda: VerdaLab) -> None:
    verda.add_type(*A100, spot=0.52, spot_capacity={"FIN-01": 1})
    verda.add_type("8H100.80S.176V", "H100 SXM5 80GB", 8, 23.92)
    spec = sky.PoolSpec("o", 1, sky.Accelerator("A100"), None, (), sky.Options())
    offers = sky.Verda().offers(spec)
    assert [(o.detail, o.hourly, o.spot, o.region) for o in offers] == [
        ("1A100.22V", 0.52, True, "FIN-01"),
        ("1A100.22V", 1.29, False, "FIN-01"),
    ]
    with pytest.raises(ConfigurationError, match="no Verda offer is accelerator 'H200'"):
        sky.Compute(provider=sky.Verda(), accelerator="H200").open()
    os.environ["VERDA_CLIENT_SECRET"] = "wrong-secret-" + "7" * 12
    with pytest.raises(
        ConfigurationError, match="refused the API key from VERDA_CLIENT_ID/VERDA_CLIENT_SECRET"
    ) as e:
        sky.Compute(provider=sky.Verda(), accelerator="A100").open()
    assert "7" * 12 not in str(e.value) and verda.creates == []
    os.environ.pop("VERDA_CLIENT_ID")
    with pytest.raises(ConfigurationError, match="set VERDA_CLIENT_ID and VERDA_CLIENT_SECRET"):
        sky.Compute(provider=sky.Verda(), accelerator="A100").open()


def test_a_lost_node_is_replaced_and_nothing_is_left_after_an_exception(verda: VerdaLab) -> None:
    """Node 1's agent dies: its instance is deleted and a new one created in the pool's
    location; then an exception in the block gives everything back."""
    verda.add_type(*A100, capacity={"FIN-01": 2, "FIN-02": 4})
    with (
        pytest.raises(ZeroDivisionError),
        sky.Compute(provider=sky.Verda(region="FIN-02"), accelerator="A100", nodes=2) as pool,
    ):
        lost = pool._nodes[1]
        assert pool._allocation is not None
        old = pool._allocation.machines[1].ident
        os.kill(int(lost.hello_info["pid"]), signal.SIGKILL)
        assert wait_until(
            lambda: pool._nodes[1] is not lost and pool._nodes[1].state.value == "ready",
            timeout=120,
        ), "node 1 was not replaced"
        assert sorted(p[0] for p in place() @ pool) == [0, 1]
        assert old not in {i.id for i in verda.live()} and verda.deleted[old] == "account"
        assert {i.location for i in verda.live()} == {"FIN-02"} and len(verda.creates) == 3
        boom() @ pool
    assert verda.wait_gone(30) == [] and verda.keys == {} and verda.scripts == {}


_BOOTING = """
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
import flotilla as sky
with sky.Compute(provider=sky.Verda(), accelerator="A100", nodes=2,
                 options=sky.Options(heartbeat_timeout=2, start_timeout=600)):
    print("opened", flush=True)
"""


def test_ctrl_c_while_instances_boot_deletes_them(verda: VerdaLab) -> None:
    verda.add_type(*A100)
    out, err = interrupted_while_booting(verda, _BOOTING)
    assert "opened" not in out
    assert verda.live() == [] and verda.keys == {} and verda.scripts == {}, err


_CLIENT = """
import time
import flotilla as sky
with sky.Compute(provider=sky.Verda(ttl=3, ttl_client_id="instances",
                                    ttl_client_secret={secret!r}),
                 accelerator="A100", nodes=2,
                 options=sky.Options(heartbeat_timeout=2, start_timeout=60)) as pool:
    print(pool.pool_id, flush=True)
    time.sleep(600)
"""


def test_kill9_instances_delete_themselves_and_orphans_are_found(verda: VerdaLab) -> None:
    """A client killed with SIGKILL: each instance's watchdog runs its delete script (the
    ttl credentials, in a root-only file), which finds the instance by its own address;
    remove_orphans() finds a dead client's pool by its description, and leaves others."""
    verda.self_client = ("instances", "secret-for-instances-" + "3" * 8)
    verda.add_type(*A100, capacity={"FIN-01": 6})
    pool_id, mine = killed_client(verda, _CLIENT.format(secret=verda.self_client[1]))
    assert verda.wait_gone(120, f"flotilla:{pool_id}:") == [], verda.console()
    assert all(verda.deleted[i.id] == "self" for i in mine)
    _orphan_and_other(verda, "deadbeef")
    found = sky.Verda().remove_orphans(dry_run=True)
    assert found.pools == ("deadbeef",) and len(verda.live()) == 2
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-verda-{pool_id}-*"))
    found = sky.Verda().remove_orphans()
    assert found.pools == ("deadbeef",) and [i.description for i in verda.live()] == ["other"]
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-verda-{pool_id}-*")) == []
    # the killed pool's SSH key and the orphan's startup script went too
    assert verda.keys == {} and [s["name"] for s in verda.scripts.values()] == ["kept"]
    for inst in verda.live():
        verda.delete(inst, "test")


def _orphan_and_other(verda: VerdaLab, pool: str) -> None:
    """An instance of a dead client's pool on this machine (and its startup script), and
    one that is not flotilla's."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    api = sky.Verda().api
    for desc, script in (
        (f"flotilla:{pool}:{socket.gethostname()}:{dead.pid}:1", pool),
        ("other", ""),
    ):
        name = f"flotilla-{script}-1" if script else "kept"
        ident = api.call("POST", "/scripts", "script", {"name": name, "script": "true"})
        api.call(
            "POST",
            "/instances",
            "create",
            {
                "instance_type": A100[0],
                "image": "ubuntu-24.04",
                "location_code": "FIN-01",
                "description": desc,
                "hostname": "h",
                "startup_script_id": ident,
            },
        )


TASK = """\
num_nodes: 2
resources:
  infra: verda/FIN-02
  accelerators: A100:1
run: |
  echo "RUN $SKYPILOT_NODE_RANK $SKYPILOT_NUM_NODES $SKYPILOT_NUM_GPUS_PER_NODE"
"""


def test_task_file_with_infra_verda_runs_and_costs_are_reported(cli: CLI, verda: VerdaLab) -> None:
    verda.add_type(*A100, capacity={"FIN-01": 4, "FIN-02": 2})
    cli.env.update(verda.env)
    done = cli.ok("launch", cli.task("job.yaml", TASK), "-c", "gpus", timeout=300)
    assert node_lines(done.stdout, "RUN") == {0: "0 2 1", 1: "1 2 1"}, done
    live = verda.live()
    assert {i.location for i in live} == {"FIN-02"} and len(live) == 2
    rec = cli.record("gpus")
    assert rec is not None
    (node1,) = [i for i in live if i.ip == rec.nodes[1].ip]
    shell = cli.ok("ssh", "gpus", "--node", "1", "--", "hostname")
    assert shell.stdout.split() == [f"verda-{node1.number}"], shell
    cli.ok("down", "gpus", "-y", timeout=120)
    assert verda.wait_gone(30) == [] and verda.keys == {}
    report = cli.ok("cost-report").stdout
    (line,) = [row for row in report.splitlines() if row.startswith("gpus ")]
    assert line.split()[1:4] == ["verda", "2", "2.58"], report


def test_stop_keeps_the_disks_and_start_runs_the_same_instances_again(
    cli: CLI, verda: VerdaLab
) -> None:
    """``flotilla stop`` shuts a 2-instance cluster down (``PUT /instances`` action
    ``shutdown``): sshd ends, the files stay, the instances are no orphans; ``flotilla
    start`` starts the same ones (action ``start``, no create), their recorded host keys
    pinned, owned by the new daemon (no orphans), and a job finds the files; the stopped
    time costs no compute."""
    verda.add_type(*A100, capacity={"FIN-01": 4, "FIN-02": 2})
    cli.env.update(verda.env)
    cli.ok("launch", cli.task("job.yaml", TASK), "-c", "vst", timeout=300)
    mark = f"kept-{secrets.token_hex(4)}"
    cli.ok("exec", "vst", f"echo {mark}-$SKYPILOT_NODE_RANK > ~/kept.txt", timeout=120)
    live = sorted(verda.live(), key=lambda i: i.id)
    ids = [i.id for i in live]
    assert len(live) == 2 and len(verda.creates) == 2

    cli.ok("stop", "vst", timeout=180)
    assert [i.status for i in live] == ["offline", "offline"]
    assert all(i.host is not None and verda.lab.pids(i.host) == [] for i in live)
    assert sorted(verda.actions) == [("shutdown", i) for i in ids]
    assert "STOPPED" in cli.ok("status", "vst").stdout
    cli.ok("down", "--orphans", "--provider", "verda")  # a stopped cluster is no orphan
    assert sorted(i.id for i in verda.live()) == ids

    cli.ok("start", "vst", timeout=300)
    assert [i.status for i in live] == ["running", "running"] and len(verda.creates) == 2
    assert sorted(verda.actions) == sorted(
        [("shutdown", i) for i in ids] + [("start", i) for i in ids]
    )
    cli.ok("down", "--orphans", "--provider", "verda")  # owned by the new daemon
    assert sorted(i.id for i in verda.live()) == ids
    done = cli.ok("exec", "vst", 'echo "found: $(cat ~/kept.txt)"', timeout=120)
    assert node_lines(done.stdout, "found: ") == {0: f"{mark}-0", 1: f"{mark}-1"}

    cli.ok("stop", "vst", timeout=180)
    cli.ok("down", "vst", "-y", timeout=120)
    assert verda.wait_gone(30) == [] and verda.keys == {}
    assert not (cli.home / "clusters" / "vst").exists()
    # each run at the pool's price; the stopped time costs no compute (Verda bills a
    # shut-down instance's disk only, which cost-report does not count)
    report = cli.ok("cost-report").stdout
    rows = [row.split() for row in report.splitlines() if row.startswith("vst ")]
    assert [r[1:4] for r in rows] == [["verda", "2", "2.58"]] * 2, report


def test_show_gpus_check_and_orphans(cli: CLI, verda: VerdaLab) -> None:
    """``show-gpus A100`` lists Verda's offers with prices (on-demand and spot), ``check``
    names a refused secret's variables, ``down --orphans --provider verda`` deletes only a
    dead client's instances."""
    verda.add_type(*A100, spot=0.52, spot_capacity={"FIN-01": 1})
    verda.add_type("8H100.80S.176V", "H100 SXM5 80GB", 8, 23.92)
    cli.env.update(verda.env)
    shown = cli.ok("show-gpus", "A100").stdout
    rows = [re.split(r"\s{2,}", line) for line in shown.splitlines()[1:]]
    mine = [r for r in rows if r[0] == "verda"]
    assert [r[3] for r in mine] == ["0.52", "1.29"] and all("FIN-01" in r for r in mine), shown
    checked = cli.ok("check", "--provider", "verda").stdout
    assert any(line.split()[:2] == ["verda", "ok"] for line in checked.splitlines()), checked
    bad = cli.ok("check", "--provider", "verda", env={"VERDA_CLIENT_SECRET": "wrong-9876543"})
    (line,) = [r for r in bad.stdout.splitlines() if r.startswith("verda")]
    assert "VERDA_CLIENT_ID/VERDA_CLIENT_SECRET" in line and "9876543" not in bad.stdout
    _orphan_and_other(verda, "cafe01")
    listed = cli.ok("down", "--orphans", "--provider", "verda", "--dry-run").stderr
    assert "1 orphan pool(s): cafe01" in listed and "would delete 1 instance(s)" in listed
    cli.ok("down", "--orphans", "--provider", "verda")
    assert wait_until(lambda: [i.description for i in verda.live()] == ["other"], 10)
    for inst in verda.live():
        verda.delete(inst, "test")
