"""``flotilla`` with ``--provider vast`` / ``infra: vast`` on the Vast stand-in (``_vast``),
``show-gpus``, ``check`` and ``cost-report`` (root only: the stand-in's instances are
namespace hosts)."""

from __future__ import annotations

from _vast import VastLab, vast_lab_fixture  # noqa: F401 - the vast_lab fixture
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture

TASK = """\
num_nodes: 2
resources:
  infra: vast
  cpus: 4
run: |
  echo "RUN $SKYPILOT_NODE_RANK $SKYPILOT_NUM_NODES"
  if [ "$SKYPILOT_NODE_RANK" = 0 ]; then
    for ip in $SKYPILOT_NODE_IPS; do echo "MESH $ip $(ssh "$ip" hostname)"; done
  fi
"""


def test_task_file_with_infra_vast_runs_and_costs_are_reported(cli: CLI, vast_lab: VastLab) -> None:
    vast_lab.add_machines(2, cluster_id=3, dph_total=1.25)
    vast_lab.add_machines(2, cluster_id=4, cpu_cores_effective=2, dph_total=0.1)  # too small
    cli.env.update(vast_lab.env)
    task = cli.task("job.yaml", TASK)
    done = cli.ok("launch", task, "-c", "gpus", timeout=300)
    assert node_lines(done.stdout, "RUN") == {0: "0 2", 1: "1 2"}
    live = sorted(vast_lab.live(), key=lambda i: i.id)
    assert len(live) == 2
    # node 0 logs in to every node over the overlay network (flotilla's mesh)
    (overlay,) = vast_lab.overlays.values()
    said = [
        line.split("MESH ", 1)[1].split() for line in done.stdout.splitlines() if "MESH " in line
    ]
    assert sorted(said) == sorted([overlay.members[i.id], f"C.{i.id}"] for i in live), done
    # flotilla ssh reaches node 1 at its public address and mapped port, host key pinned
    shell = cli.ok("ssh", "gpus", "--node", "1", "--", "hostname")
    rec = cli.record("gpus")
    assert rec is not None
    (node1,) = [i for i in live if overlay.members[i.id] == rec.nodes[1].ip]
    assert shell.stdout.split() == [f"C.{node1.id}"], shell
    cli.ok("down", "gpus", "-y", timeout=120)
    assert vast_lab.wait_gone(30) == []
    report = cli.ok("cost-report").stdout
    (line,) = [row for row in report.splitlines() if row.startswith("gpus ")]
    words = line.split()
    assert words[1:4] == ["vast", "2", "2.5"] and words[6] == "finished", report


def test_a_tasks_max_hourly_cost_refuses_offers_above_it_before_renting(
    cli: CLI, vast_lab: VastLab
) -> None:
    """``resources.max_hourly_cost`` reaches the pool: 2 nodes at $1.25/h are above $2/h,
    refused before anything is rented."""
    vast_lab.add_machines(2, cluster_id=3, dph_total=1.25)
    cli.env.update(vast_lab.env)
    task = cli.task("job.yaml", TASK.replace("  cpus: 4\n", "  cpus: 4\n  max_hourly_cost: 2\n"))
    done = cli("launch", task, "-c", "dear", timeout=300)
    assert done.returncode != 0, done.stderr
    assert "costs $2.50/h, above max_hourly_cost=$2.00/h: nothing was rented" in done.stderr
    assert vast_lab.live() == []


def test_a_tasks_max_node_hourly_cost_refuses_offers_above_it_before_renting(
    cli: CLI, vast_lab: VastLab
) -> None:
    """``resources.max_node_hourly_cost`` (Skyward's per-node ``Spec(max_hourly_cost=)``)
    reaches the pool: a node at $1.25/h is above $1/h, refused before anything is rented,
    though the pool of 2 ($2.50/h) has no pool cap."""
    vast_lab.add_machines(2, cluster_id=3, dph_total=1.25)
    cli.env.update(vast_lab.env)
    task = cli.task(
        "job.yaml", TASK.replace("  cpus: 4\n", "  cpus: 4\n  max_node_hourly_cost: 1\n")
    )
    done = cli("launch", task, "-c", "dear", timeout=300)
    assert done.returncode != 0, done.stderr
    assert "max_node_hourly_cost=$1.00/h" in done.stderr, done.stderr
    assert vast_lab.live() == []


def test_show_gpus_and_check(cli: CLI, vast_lab: VastLab) -> None:
    vast_lab.add_machines(1, gpu_name="H100 SXM", num_gpus=8, dph_total=20.0, geolocation="SE")
    vast_lab.add_machines(1, gpu_name="A100 PCIE", dph_total=0.9)
    cli.env.update(vast_lab.env)
    shown = cli.ok("show-gpus", "H100:8", "--provider", "vast").stdout
    (row,) = [line.split() for line in shown.splitlines()[1:]]
    assert row[:6] == ["vast", "H100", "SXM", "8", "20", "SE"], shown
    checked = cli.ok("check", "--provider", "vast").stdout
    assert any(line.split()[:2] == ["vast", "ok"] for line in checked.splitlines()), checked
    bad = cli.ok("check", "--provider", "vast", env={"VAST_API_KEY": "wrong-key-1234567"})
    (line,) = [row for row in bad.stdout.splitlines() if row.startswith("vast")]
    assert "not usable" in line and "refused the API key" in line
    assert "wrong-key-1234567" not in bad.stdout + bad.stderr


def test_down_orphans_destroys_what_a_killed_client_left(cli: CLI, vast_lab: VastLab) -> None:
    import socket
    import subprocess

    import flotilla as sky

    vast_lab.add_machines(2)
    cli.env.update(vast_lab.env)
    dead = subprocess.Popen(["true"])
    dead.wait()
    api = sky.VastAI().api
    offers = api.call("POST", "/bundles/", "search", {})["offers"]
    for o in offers:  # one orphan, one instance that is not flotilla's
        label = f"flotilla:cafe01:{socket.gethostname()}:{dead.pid}:1" if o is offers[0] else "x"
        api.call("PUT", f"/asks/{o['id']}/", "rent", {"client_id": "me", "label": label})
    listed = cli.ok("down", "--orphans", "--provider", "vast", "--dry-run").stderr
    assert "1 orphan pool(s): cafe01" in listed and "would destroy 1 instance(s)" in listed
    assert len(vast_lab.live()) == 2
    done = cli.ok("down", "--orphans", "--provider", "vast").stderr
    assert "destroyed 1 instance(s)" in done, done
    assert wait_gone_but(vast_lab, "x")


def wait_gone_but(lab: VastLab, label: str) -> bool:
    from _procs import wait_until

    return wait_until(lambda: [i.label for i in lab.live()] == [label], 10)
