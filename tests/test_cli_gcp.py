"""``flotilla`` with ``--provider gcp`` / ``infra: gcp/<region>/<zone>`` on the Compute
Engine stand-in (``_gcp``): a task on 2 nodes, ``flotilla ssh``, ``cost-report``,
``show-gpus``, ``check`` and ``down --orphans`` (root only: the instances are namespace
hosts)."""

from __future__ import annotations

import secrets
import socket
import subprocess
import time

from _gcp import PROJECT, GcpLab, gcp_lab_fixture  # noqa: F401 - the gcp_lab fixture
from _procs import wait_until
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture
from test_cli_files import copy_check

TASK = """\
num_nodes: 2
resources:
  infra: gcp/us-central1/us-central1-b
  cpus: 4
config:
  gcp:
    ssh_user: root
run: |
  echo "RUN $SKYPILOT_NODE_RANK $SKYPILOT_NUM_NODES"
  if [ "$SKYPILOT_NODE_RANK" = 0 ]; then
    for ip in $SKYPILOT_NODE_IPS; do echo "MESH $ip $(ssh "$ip" hostname)"; done
  fi
"""


def test_task_file_with_infra_gcp_runs_on_two_nodes_and_costs_are_reported(
    cli: CLI, gcp_lab: GcpLab
) -> None:
    cli.env.update(gcp_lab.env)
    task = cli.task("job.yaml", TASK)
    done = cli.ok("launch", task, "-c", "g", timeout=300)
    assert node_lines(done.stdout, "RUN") == {0: "0 2", 1: "1 2"}
    live = sorted(gcp_lab.live(), key=lambda i: i.name)
    assert len(live) == 2 and {i.zone for i in live} == {"us-central1-b"}
    assert {i.body["machineType"].rsplit("/", 1)[1] for i in live} == {"n2-standard-4"}
    # node 0 logs in to every node at its internal address (the VPC network)
    said = [
        line.split("MESH ", 1)[1].split() for line in done.stdout.splitlines() if "MESH " in line
    ]
    assert sorted(said) == sorted([i.network_ip, i.name] for i in live), done
    # flotilla ssh reaches node 1 at its external address, host key pinned
    rec = cli.record("g")
    assert rec is not None
    (node1,) = [i for i in live if i.network_ip == rec.nodes[1].ip]
    shell = cli.ok("ssh", "g", "--node", "1", "--", "hostname")
    assert shell.stdout.split() == [node1.name], shell
    copy_check(cli, "g", 1, cli.cwd / "copies")  # cp and download through ssh_login
    cli.ok("down", "g", "-y", timeout=120)
    assert gcp_lab.wait_gone(30) == []
    report = cli.ok("cost-report").stdout
    (line,) = [row for row in report.splitlines() if row.startswith("g ")]
    words = line.split()
    assert words[1:4] == ["gcp", "2", "0.388"] and words[6] == "finished", report


def test_show_gpus_and_check(cli: CLI, gcp_lab: GcpLab) -> None:
    cli.env.update(gcp_lab.env)
    shown = cli.ok("show-gpus", "A100", "--provider", "gcp").stdout
    rows = [line.split() for line in shown.splitlines()[1:]]
    assert [r[:6] for r in rows] == [
        ["gcp", "A100", "1", "3.67", z, "no"]
        for z in ("us-central1-a", "us-central1-b", "us-central1-c")
    ], shown
    checked = cli.ok("check", "--provider", "gcp").stdout
    assert any(line.split()[:2] == ["gcp", "ok"] for line in checked.splitlines()), checked
    other = gcp_lab.write_key_file(gcp_lab.lab.tmp / "other.json")
    bad = cli.ok("check", "--provider", "gcp", env={"GOOGLE_APPLICATION_CREDENTIALS": str(other)})
    (line,) = [row for row in bad.stdout.splitlines() if row.startswith("gcp")]
    assert "not usable" in line and "GOOGLE_APPLICATION_CREDENTIALS" in line, line
    assert "PRIVATE KEY" not in bad.stdout + bad.stderr


def test_down_orphans_deletes_what_a_killed_client_left(cli: CLI, gcp_lab: GcpLab) -> None:
    from google.cloud import compute_v1 as c

    import flotilla as sky

    cli.env.update(gcp_lab.env)
    dead = subprocess.Popen(["true"])
    dead.wait()
    api = sky.GCP().api
    for name, labels, client in [
        (
            "flotilla-cafe0001-0",
            {"flotilla-pool": "cafe0001"},
            f"{socket.gethostname()}:{dead.pid}:1",
        ),
        ("x", {}, ""),
    ]:
        body = c.Instance(
            name=name,
            machine_type="zones/us-central1-a/machineTypes/n2-standard-2",
            labels=labels,
            metadata=c.Metadata(items=[c.Items(key="flotilla-client", value=client)]),
        )
        op = api.client("InstancesClient").insert_unary(
            project=PROJECT, zone="us-central1-a", instance_resource=body
        )
        api.wait("us-central1-a", op, "insert", time.monotonic() + 30)
    listed = cli.ok("down", "--orphans", "--provider", "gcp", "--dry-run").stderr
    assert "1 orphan pool(s): cafe0001" in listed and "would delete 1 instance(s)" in listed
    assert len(gcp_lab.live()) == 2
    done = cli.ok("down", "--orphans", "--provider", "gcp").stderr
    assert "deleted 1 instance(s): us-central1-a/flotilla-cafe0001-0" in done, done
    assert wait_until(lambda: [i.name for i in gcp_lab.live()] == ["x"], 10), gcp_lab.live()


def test_stop_keeps_the_instances_disks_and_start_runs_them_again(
    cli: CLI, gcp_lab: GcpLab
) -> None:
    """``flotilla stop`` stops (``instances.stop``) a 2-node GCP cluster's instances: their
    sshd ends, their boot disks stay, and they are no orphans; ``flotilla start`` starts the
    same instances (no insert), which run the cluster's jobs again with the files left on
    their disks; ``down`` of the stopped cluster deletes them."""
    cli.env.update(gcp_lab.env)
    task = cli.task("job.yaml", TASK)
    cli.ok("launch", task, "-c", "gst", timeout=300)
    mark = f"kept-{secrets.token_hex(4)}"
    cli.ok("exec", "gst", f"echo {mark}-$SKYPILOT_NODE_RANK > kept.txt", timeout=120)
    live = sorted(gcp_lab.live(), key=lambda i: i.name)
    names = [i.name for i in live]
    assert len(names) == 2 and gcp_lab.inserts() == 2
    old_client = live[0].metadata("flotilla-client")

    cli.ok("stop", "gst", timeout=180)
    assert sorted(gcp_lab.powered) == [(n, "stop") for n in names]
    assert [i.status for i in live] == ["TERMINATED", "TERMINATED"]
    assert all(i.host is not None and gcp_lab.lab.pids(i.host) == [] for i in live)
    assert "STOPPED" in cli.ok("status", "gst").stdout
    cli.ok("down", "--orphans", "--provider", "gcp")  # a stopped cluster is no orphan
    assert sorted(i.name for i in gcp_lab.live()) == names

    cli.ok("start", "gst", timeout=300)
    assert gcp_lab.inserts() == 2 and [i.status for i in live] == ["RUNNING", "RUNNING"]
    assert sorted(gcp_lab.powered) == sorted([(n, v) for n in names for v in ("stop", "start")])
    assert live[0].metadata("flotilla-client") not in ("", None, old_client)  # the new daemon
    done = cli.ok("exec", "gst", 'echo "found: $(cat kept.txt)"', timeout=120)
    assert node_lines(done.stdout, "found: ") == {0: f"{mark}-0", 1: f"{mark}-1"}

    cli.ok("stop", "gst", timeout=180)
    cli.ok("down", "gst", "-y", timeout=120)
    assert gcp_lab.wait_gone(30) == []
    assert not (cli.home / "clusters" / "gst").exists()
    # cost-report: each run at the pool's list price; the stopped time costs no compute
    # (Compute Engine bills a TERMINATED instance's disk only, which it does not count)
    report = cli.ok("cost-report").stdout
    rows = [row.split() for row in report.splitlines() if row.startswith("gst ")]
    assert [r[1:4] for r in rows] == [["gcp", "2", "0.388"]] * 2, report
