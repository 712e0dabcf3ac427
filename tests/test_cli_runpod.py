"""``flotilla`` with ``--provider runpod`` / ``infra: runpod`` on the RunPod stand-in
(``_runpod``): a task file on 2 pods, ``show-gpus``, ``check``, ``cost-report`` and
``down --orphans`` (root only: the stand-in's pods are namespace hosts)."""

from __future__ import annotations

import secrets
import socket
import subprocess

from _procs import wait_until
from _runpod import RunPodLab, runpod_lab_fixture  # noqa: F401 - the runpod_lab fixture
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture

import flotilla as sky

TASK = """\
num_nodes: 2
resources:
  infra: runpod/US-TX-3
  accelerators: RTX4090:1
run: |
  echo "RUN $SKYPILOT_NODE_RANK $SKYPILOT_NUM_NODES $SKYPILOT_NUM_GPUS_PER_NODE"
"""
RTX4090 = ("NVIDIA GeForce RTX 4090", "RTX 4090", 24)


def test_task_file_with_infra_runpod_runs_and_costs_are_reported(
    cli: CLI, runpod_lab: RunPodLab
) -> None:
    runpod_lab.add_gpu(*RTX4090, secure_price=0.69, stock={"EU-RO-1": 4, "US-TX-3": 2})
    cli.env.update(runpod_lab.env)
    task = cli.task("job.yaml", TASK)
    done = cli.ok("launch", task, "-c", "gpus", timeout=300)
    assert node_lines(done.stdout, "RUN") == {0: "0 2 1", 1: "1 2 1"}, done
    live = runpod_lab.live()
    assert len(live) == 2 and {p.data_center for p in live} == {"US-TX-3"}
    rec = cli.record("gpus")
    assert rec is not None
    shell = cli.ok("ssh", "gpus", "--node", "1", "--", "hostname")
    (node1,) = [p for p in live if f"{p.id}.runpod.internal" == rec.nodes[1].ip]
    assert shell.stdout.split() == [node1.id], shell
    cli.ok("down", "gpus", "-y", timeout=120)
    assert runpod_lab.wait_gone(30) == []
    report = cli.ok("cost-report").stdout
    (line,) = [row for row in report.splitlines() if row.startswith("gpus ")]
    words = line.split()
    assert words[1:4] == ["runpod", "2", "1.38"] and words[6] == "finished", report


def test_show_gpus_and_check(cli: CLI, runpod_lab: RunPodLab) -> None:
    runpod_lab.add_gpu("NVIDIA A100-SXM4-80GB", "A100 SXM", 80, secure_price=1.89)
    runpod_lab.add_gpu(*RTX4090)
    cli.env.update(runpod_lab.env)
    shown = cli.ok("show-gpus", "A100:8", "--provider", "runpod").stdout
    (row,) = [line.split() for line in shown.splitlines()[1:]]
    assert row[:6] == ["runpod", "A100", "SXM", "8", "15.12", "secure"], shown
    everywhere = cli.ok("show-gpus", "A100").stdout  # every configured market
    assert any(line.startswith("runpod ") for line in everywhere.splitlines()), everywhere
    every_type = cli.ok("show-gpus", "--provider", "runpod").stdout  # no accelerator: all
    assert [line.split()[1] for line in every_type.splitlines()[1:]] == ["RTX", "A100"], every_type
    checked = cli.ok("check", "--provider", "runpod").stdout
    assert any(line.split()[:2] == ["runpod", "ok"] for line in checked.splitlines()), checked
    bad = cli.ok("check", "--provider", "runpod", env={"RUNPOD_API_KEY": "wrong-key-1234567"})
    (line,) = [row for row in bad.stdout.splitlines() if row.startswith("runpod")]
    assert "not usable" in line and "refused the API key from RUNPOD_API_KEY" in line
    assert "wrong-key-1234567" not in bad.stdout + bad.stderr


def test_down_orphans_terminates_what_a_killed_client_left(cli: CLI, runpod_lab: RunPodLab) -> None:
    runpod_lab.add_gpu(*RTX4090)
    cli.env.update(runpod_lab.env)
    dead = subprocess.Popen(["true"])
    dead.wait()
    api = sky.RunPod().api
    for name in (f"flotilla:cafe01:{socket.gethostname()}:{dead.pid}:1", "x"):
        body = {"name": name, "imageName": "x", "gpuTypeIds": [RTX4090[0]], "gpuCount": 1}
        api.call("POST", "/pods", "create", body)
    listed = cli.ok("down", "--orphans", "--provider", "runpod", "--dry-run").stderr
    assert "1 orphan pool(s): cafe01" in listed and "would terminate 1 pod(s)" in listed
    assert len(runpod_lab.live()) == 2
    done = cli.ok("down", "--orphans", "--provider", "runpod").stderr
    assert "terminated 1 pod(s)" in done, done
    assert wait_until(lambda: [p.name for p in runpod_lab.live()] == ["x"], 10)


def test_stop_keeps_the_volume_disk_and_start_resumes_the_same_pods(
    cli: CLI, runpod_lab: RunPodLab
) -> None:
    """``flotilla stop`` stops (``podStop``) a 2-pod cluster: sshd ends, the GPUs go back to
    the data center, the container disk is wiped and the volume disk kept, and the pods are
    no orphans; a start without free GPUs fails and leaves them stopped; ``flotilla start``
    then resumes the same pods (no create), renamed for the new client, and their jobs find
    the files of the volume."""
    gpu = runpod_lab.add_gpu(*RTX4090, secure_price=0.69, stock={"US-TX-3": 2})
    cli.env.update(runpod_lab.env)
    volume = "config:\n  runpod:\n    volume_gb: 10\n    volume_mount_path: /root/workspace\n"
    cli.ok("launch", cli.task("job.yaml", TASK + volume), "-c", "rst", timeout=300)
    mark = f"kept-{secrets.token_hex(4)}"
    kept = f"echo {mark}-$SKYPILOT_NODE_RANK > /root/workspace/kept.txt; echo x > /root/lost.txt"
    cli.ok("exec", "rst", kept, timeout=120)
    pods = sorted(runpod_lab.live(), key=lambda p: p.id)
    names = [p.name for p in pods]
    assert len(pods) == 2 and len(runpod_lab.creates) == 2 and gpu.stock["US-TX-3"] == 0

    cli.ok("stop", "rst", timeout=180)
    assert [p.status for p in pods] == ["EXITED", "EXITED"] and gpu.stock["US-TX-3"] == 2
    assert all(p.host is not None and runpod_lab.lab.pids(p.host) == [] for p in pods)
    assert "STOPPED" in cli.ok("status", "rst").stdout
    cli.ok("down", "--orphans", "--provider", "runpod")  # a stopped cluster is no orphan
    assert sorted(p.id for p in runpod_lab.live()) == [p.id for p in pods]

    gpu.stock["US-TX-3"] = 1  # someone took one of the host's GPUs meanwhile
    failed = cli("start", "rst", timeout=300)
    assert failed.returncode != 0, failed.stdout + failed.stderr
    assert [p.status for p in pods] == ["EXITED", "EXITED"] and gpu.stock["US-TX-3"] == 1

    gpu.stock["US-TX-3"] = 2
    cli.ok("start", "rst", timeout=300)
    assert [p.status for p in pods] == ["RUNNING", "RUNNING"] and len(runpod_lab.creates) == 2
    assert all(
        p.name != n and p.name.startswith("flotilla:") for p, n in zip(pods, names, strict=True)
    )
    found = 'echo "found: $(cat /root/workspace/kept.txt) $(cat /root/lost.txt || echo wiped)"'
    done = cli.ok("exec", "rst", found, timeout=120)
    assert node_lines(done.stdout, "found: ") == {0: f"{mark}-0 wiped", 1: f"{mark}-1 wiped"}
    cli.ok("stop", "rst", timeout=180)
    cli.ok("down", "rst", "-y", timeout=120)
    assert runpod_lab.wait_gone(30) == []
