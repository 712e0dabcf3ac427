"""``flotilla`` on the Kubernetes lab (``--provider k8s``, ``infra: k8s``): the CLI runs as
a subprocess against the real API server of ``_k8s`` (root only); the lab's kubectl is first
on PATH and ``KUBECONFIG`` names the lab's kubeconfig, as a user's shell would."""

from __future__ import annotations

import sys

from _k8s import K8sLab, k8s_lab_fixture  # noqa: F401
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture

TASK = """\
num_nodes: 3
resources:
  infra: k8s
setup: echo "SETUP $HOSTNAME $SKYPILOT_NODE_RANK"
run: |
  IPS=$(echo $SKYPILOT_NODE_IPS)
  echo "RUN $SKYPILOT_NODE_RANK $HOSTNAME $SKYPILOT_NUM_NODES $IPS $MASTER_ADDR"
"""


def _live(lab: K8sLab) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in lab.pods(selector="app.kubernetes.io/managed-by=flotilla")
        if p["status"].get("phase") in ("Pending", "Running")
    ]


def test_task_file_with_infra_k8s_runs_on_num_nodes_pods(cli: CLI, k8s_lab: K8sLab) -> None:
    cli.env.update({k: v for k, v in k8s_lab.env().items() if k in ("PATH", "KUBECONFIG")})
    task = cli.task("job.yaml", TASK)
    done = cli.ok("launch", task, "-c", "kube", "--k8s-python", sys.executable, timeout=300)
    pods = {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in k8s_lab.pods(selector="app.kubernetes.io/managed-by=flotilla")
        if p["status"].get("phase") == "Running"
    }
    assert len(pods) == 3, pods
    by_rank = sorted(pods, key=lambda name: int(name.rsplit("-", 1)[1]))
    ips = " ".join(pods[n] for n in by_rank)
    assert node_lines(done.stdout, "SETUP") == {r: f"{by_rank[r]} {r}" for r in range(3)}
    assert node_lines(done.stdout, "RUN") == {
        r: f"{r} {by_rank[r]} 3 {ips} {pods[by_rank[0]]}" for r in range(3)
    }
    again = cli.ok("exec", "kube", "echo AGAIN $SKYPILOT_NODE_RANK $HOSTNAME")
    assert node_lines(again.stdout, "AGAIN") == {r: f"{r} {by_rank[r]}" for r in range(3)}
    shell = cli.ok("ssh", "kube", "--node", "2", "--", "echo $HOSTNAME")
    assert shell.stdout.split() == [by_rank[2]]
    cli.ok("down", "kube")
    assert _live(k8s_lab) == []


def test_provider_k8s_flags_and_a_bad_namespace(cli: CLI) -> None:
    done = cli("launch", "echo hi", "-c", "bad", "--provider", "k8s", "--namespace", "Bad_NS")
    assert done.returncode != 0
    assert "namespace" in done.stderr
