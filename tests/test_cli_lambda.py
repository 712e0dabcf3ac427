"""``flotilla`` with ``--provider lambda`` / ``infra: lambda/<region>`` on the Lambda Cloud
stand-in (``_lambda``): a task file on 2 instances, ``flotilla ssh``, ``show-gpus``,
``check``, ``cost-report`` and ``down --orphans``."""

from __future__ import annotations

import re
import socket
import subprocess

from _lambda import LambdaLab, lambda_lab_fixture  # noqa: F401 - the lambda_lab fixture
from _procs import wait_until
from _runpod import RunPodLab, runpod_lab_fixture  # noqa: F401 - the runpod_lab fixture
from _vast import VastLab, vast_lab_fixture  # noqa: F401 - the vast_lab fixture
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture

import flotilla as sky

TASK = """\
num_nodes: 2
resources:
  infra: lambda/us-west-1
  accelerators: A10:1
run: |
  echo "RUN $SKYPILOT_NODE_RANK $SKYPILOT_NUM_NODES $SKYPILOT_NUM_GPUS_PER_NODE"
"""


def test_task_file_with_infra_lambda_runs_and_costs_are_reported(
    cli: CLI, lambda_lab: LambdaLab
) -> None:
    lambda_lab.add_type(
        "gpu_1x_a10", "A10 (24 GB PCIe)", 1, 75, capacity={"us-east-1": 4, "us-west-1": 2}
    )
    cli.env.update(lambda_lab.env)
    done = cli.ok(
        "launch",
        cli.task("job.yaml", TASK),
        "-c",
        "gpus",
        "--lambda-ssh-user",
        "root",
        timeout=300,
    )
    assert node_lines(done.stdout, "RUN") == {0: "0 2 1", 1: "1 2 1"}, done
    live = lambda_lab.live()
    assert {i.region for i in live} == {"us-west-1"} and len(live) == 2
    rec = cli.record("gpus")
    assert rec is not None
    (node1,) = [i for i in live if i.private_ip == rec.nodes[1].ip]
    shell = cli.ok("ssh", "gpus", "--node", "1", "--", "hostname")
    assert shell.stdout.split() == [f"lambda-{node1.number}"], shell
    cli.ok("down", "gpus", "-y", timeout=120)
    assert lambda_lab.wait_gone(30) == [] and lambda_lab.keys == {}
    report = cli.ok("cost-report").stdout
    (line,) = [row for row in report.splitlines() if row.startswith("gpus ")]
    assert line.split()[1:4] == ["lambda", "2", "1.5"], report


def test_show_gpus_check_and_orphans(cli: CLI, lambda_lab: LambdaLab) -> None:
    lambda_lab.add_type("gpu_8x_a100_80gb_sxm4", "A100 (80 GB SXM4)", 8, 1432)
    cli.env.update(lambda_lab.env)
    shown = cli.ok("show-gpus", "A100:8", "--provider", "lambda").stdout
    (row,) = [line.split() for line in shown.splitlines()[1:]]
    assert row[0] == "lambda" and "14.32" in row and "us-east-1" in row, shown
    checked = cli.ok("check", "--provider", "lambda").stdout
    assert any(line.split()[:2] == ["lambda", "ok"] for line in checked.splitlines()), checked
    bad = cli.ok("check", "--provider", "lambda", env={"LAMBDA_API_KEY": "wrong-key-1234567"})
    (line,) = [r for r in bad.stdout.splitlines() if r.startswith("lambda")]
    assert "refused the API key from LAMBDA_API_KEY" in line and "1234567" not in bad.stdout
    dead = subprocess.Popen(["true"])
    dead.wait()
    api = sky.LambdaCloud().api
    for name in (f"flotilla:cafe01:{socket.gethostname()}:{dead.pid}:1", "x"):
        api.call(
            "POST",
            "/instance-operations/launch",
            "launch",
            {
                "region_name": "us-east-1",
                "instance_type_name": "gpu_8x_a100_80gb_sxm4",
                "quantity": 1,
                "name": name,
            },
        )
    listed = cli.ok("down", "--orphans", "--provider", "lambda", "--dry-run").stderr
    assert "1 orphan pool(s): cafe01" in listed and "would terminate 1 instance(s)" in listed
    cli.ok("down", "--orphans", "--provider", "lambda")
    assert wait_until(lambda: [i.name for i in lambda_lab.live()] == ["x"], 10)


def test_show_gpus_lists_every_markets_offers(
    cli: CLI, lambda_lab: LambdaLab, runpod_lab: RunPodLab, vast_lab: VastLab
) -> None:
    """``flotilla show-gpus A100`` with Vast, RunPod and Lambda configured (their keys in
    the environment): every market's A100 offers, each with its price, cheapest first."""
    lambda_lab.add_type("gpu_1x_a100_sxm4", "A100 (40 GB SXM4)", 1, 129)
    runpod_lab.add_gpu("NVIDIA A100 80GB PCIe", "A100 PCIe", 80, secure_price=1.64)
    vast_lab.add_machines(1, gpu_name="A100 SXM4", dph_total=0.95)
    vast_lab.add_machines(1, gpu_name="RTX 4090", dph_total=0.3)  # not an A100
    cli.only_markets(lambda_lab, runpod_lab, vast_lab)
    shown = cli.ok("show-gpus", "A100").stdout
    rows = [re.split(r"\s{2,}", line) for line in shown.splitlines()[1:]]
    assert [(r[0], r[3]) for r in rows] == [
        ("vast", "0.95"),
        ("lambda", "1.29"),
        ("runpod", "1.64"),
    ], shown


def test_a_task_file_falls_back_from_runpod_to_lambda(
    cli: CLI, lambda_lab: LambdaLab, runpod_lab: RunPodLab
) -> None:
    """``resources.ordered`` across the new markets: RunPod has no room for the A100s, the
    cluster starts on Lambda (what RunPod created is given back)."""
    runpod_lab.add_gpu("NVIDIA A100 80GB PCIe", "A100 PCIe", 80, stock={"EU-RO-1": 1})
    lambda_lab.add_type("gpu_1x_a100_sxm4", "A100 (40 GB SXM4)", 1, 129)
    for lab in (lambda_lab, runpod_lab):
        cli.env.update(lab.env)
    task = cli.task(
        "job.yaml",
        """\
        num_nodes: 2
        resources:
          accelerators: A100:1
          ordered:
            - infra: runpod
            - infra: lambda
        run: echo "ON $SKYPILOT_NODE_RANK $(hostname)"
        """,
    )
    done = cli.ok(
        "launch", "--down", task, "-c", "ordered", "--lambda-ssh-user", "root", timeout=300
    )
    on = node_lines(done.stdout, "ON")
    assert sorted(on) == [0, 1] and all(h.split()[-1].startswith("lambda-") for h in on.values()), (
        done
    )
    assert "candidate RunPod(" in done.stderr and "chose LambdaCloud(" in done.stderr
    assert runpod_lab.live() == [] and len(runpod_lab.destroyed) == 1
    assert lambda_lab.wait_gone(60) == []
