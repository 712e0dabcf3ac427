"""``flotilla`` on the Kubernetes lab (``--provider k8s``, ``infra: k8s``): the CLI runs as
a subprocess against the real API server of ``_k8s`` (root only); the lab's kubectl is first
on PATH and ``KUBECONFIG`` names the lab's kubeconfig, as a user's shell would."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from _k8s import K8sLab, k8s_lab_fixture  # noqa: F401
from _procs import wait_until
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture
from test_cli_files import copy_check
from test_managed import RESUMABLE, Jobs
from test_managed import jobs as jobs  # the fixture
from test_reattach import check_ends_after_the_grace, check_survives_its_daemon

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
    rec = cli.record("kube")
    assert rec is not None
    made = _made_by(k8s_lab, rec.pid)
    pods = {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in k8s_lab.pods(selector="app.kubernetes.io/managed-by=flotilla")
        if p["metadata"]["name"] in made
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
    logs = cli.ok("logs", "kube", "1")
    assert node_lines(logs.stdout, "RUN") == node_lines(done.stdout, "RUN")
    shell = cli.ok("ssh", "kube", "--node", "2", "--", "echo $HOSTNAME")
    assert shell.stdout.split() == [by_rank[2]]
    copy_check(cli, "kube", 2, cli.cwd / "copies")  # cp through kubectl exec -i
    cli.ok("down", "kube")
    assert _made_by(k8s_lab, rec.pid) == []


def test_provider_k8s_flags_and_a_bad_namespace(cli: CLI) -> None:
    done = cli("launch", "echo hi", "-c", "bad", "--provider", "k8s", "--namespace", "Bad_NS")
    assert done.returncode != 0
    assert "namespace" in done.stderr


@pytest.mark.timeout(180)
def test_a_managed_job_on_k8s_recovers_when_a_pod_is_deleted(jobs: Jobs, k8s_lab: K8sLab) -> None:
    """The lab's pods see this machine's files, so the job's checkpoints ($CKPT) outlive
    its pods, as on a shared file system."""
    jobs.env.update({k: v for k, v in k8s_lab.env().items() if k in ("PATH", "KUBECONFIG")})
    task = jobs.task("resumable.yaml", RESUMABLE)
    launch = jobs.popen(
        "launch",
        task,
        "--env",
        f"CKPT={jobs.ckpt}",
        "--provider",
        "k8s",
        "--k8s-python",
        sys.executable,
    )
    try:
        pid_files = [jobs.ckpt / "pid-0", jobs.ckpt / "pid-1"]
        assert wait_until(lambda: all(p.exists() and p.read_text().strip() for p in pid_files), 90)
        k8s_lab.kubectl("delete", "pods", "-l", "flotilla/rank=1", "--wait=false")
        out, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    rec = jobs.record()
    assert (rec.state, rec.recoveries) == ("SUCCEEDED", 1)
    for rank in (0, 1):
        assert (jobs.ckpt / f"ids-{rank}").read_text().splitlines() == [rec.task_id] * 2
        assert f"rank {rank} resumed from step 1" in out
    assert wait_until(lambda: not _live(k8s_lab), 30), _live(k8s_lab)


def test_down_after_the_daemon_was_killed_deletes_its_pods(cli: CLI, k8s_lab: K8sLab) -> None:
    cli.env.update({k: v for k, v in k8s_lab.env().items() if k in ("PATH", "KUBECONFIG")})
    cli.ok("launch", "echo hi", "-c", "gone", "--nodes", "2", "--provider", "k8s",
           "--k8s-python", sys.executable, timeout=300)  # fmt: skip
    rec = cli.record("gone")
    assert rec is not None
    assert len(_made_by(k8s_lab, rec.pid)) == 2
    os.kill(rec.pid, signal.SIGKILL)
    pods = _made_by(k8s_lab, rec.pid)
    listed = cli.ok("down", "--orphans", "--provider", "k8s", "--dry-run")
    said = listed.stdout + listed.stderr
    assert "would delete" in said and all(p in said for p in pods), said
    assert _made_by(k8s_lab, rec.pid) == pods  # a dry run
    cli.ok("down", "gone")
    assert _made_by(k8s_lab, rec.pid) == []


_LIST_ROLE = """\
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: orphans-dev, namespace: default}
rules:
- apiGroups: [""]
  resources: [pods, services, secrets]
  verbs: [list, delete]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: orphans-dev, namespace: default}
subjects: [{kind: User, name: dev, apiGroup: rbac.authorization.k8s.io}]
roleRef: {kind: Role, name: orphans-dev, apiGroup: rbac.authorization.k8s.io}
"""


@pytest.mark.timeout(300)
def test_down_orphans_looks_in_every_namespace_and_namespace_narrows_it(
    cli: CLI, k8s_lab: K8sLab
) -> None:
    """A pool launched with --namespace whose daemon was killed is found by ``down
    --orphans --provider k8s`` without naming the namespace (the same --namespace as
    launch's narrows the search); a user who may not list every namespace is told the
    search covered the current context's one."""
    cli.env.update({k: v for k, v in k8s_lab.env().items() if k in ("PATH", "KUBECONFIG")})
    ns = f"ho-{os.getpid()}"
    k8s_lab.kubectl("create", "namespace", ns)
    try:
        cli.ok("launch", "echo hi", "-c", "away", "--nodes", "2", "--provider", "k8s",
               "--namespace", ns, "--k8s-python", sys.executable, timeout=300)  # fmt: skip
        rec = cli.record("away")
        assert rec is not None
        pods = _made_by(k8s_lab, rec.pid, ns)
        assert len(pods) == 2
        os.kill(rec.pid, signal.SIGKILL)
        narrowed = cli.ok("down", "--orphans", "--provider", "k8s", "--namespace", "default",
                          "--dry-run")  # fmt: skip
        said = narrowed.stdout + narrowed.stderr
        assert not any(p in said for p in pods), said
        listed = cli.ok("down", "--orphans", "--provider", "k8s", "--dry-run")
        said = listed.stdout + listed.stderr
        assert all(f"{ns}/{p}" in said for p in pods), said
        assert _made_by(k8s_lab, rec.pid, ns) == pods  # a dry run
        cli.ok("down", "--orphans", "--provider", "k8s")
        assert wait_until(lambda: _made_by(k8s_lab, rec.pid, ns) == [], 90)
        managed = "app.kubernetes.io/managed-by=flotilla"
        assert (
            k8s_lab.kubectl("get", "services,secrets", "-n", ns, "-l", managed, "-o", "name") == ""
        )

        k8s_lab.kubectl("apply", "-f", "-", input=_LIST_ROLE)
        dev = {"KUBECONFIG": str(k8s_lab.user_kubeconfig())}
        limited = cli.ok("down", "--orphans", "--provider", "k8s", "--dry-run", env=dev)
        said = limited.stdout + limited.stderr
        assert "looked in namespace default only" in said and "forbidden" in said, said
    finally:
        k8s_lab.kubectl("delete", "role,rolebinding", "orphans-dev", "--ignore-not-found")
        cli("down", "away")
        k8s_lab.kubectl("delete", "namespace", ns, "--wait=false")


def _made_by(lab: K8sLab, pid: int, namespace: str = "default") -> list[str]:
    """The pods whose client (``host:pid:start``) is the process ``pid``."""
    return [
        p["metadata"]["name"]
        for p in lab.pods(namespace, selector="app.kubernetes.io/managed-by=flotilla")
        if f":{pid}:" in p["metadata"].get("annotations", {}).get("flotilla/client", "")
    ]


def _pods(lab: K8sLab, live: bool = False) -> set[str]:
    """The pods flotilla made (only those pending or running: ``live``)."""
    return {
        p["metadata"]["name"]
        for p in lab.pods(selector="app.kubernetes.io/managed-by=flotilla")
        if not live or p["status"].get("phase") in ("Pending", "Running")
    }


@pytest.mark.timeout(420)
def test_a_k8s_cluster_outlives_its_killed_daemon_and_is_re_attached(
    cli: CLI, k8s_lab: K8sLab, tmp_path: Path
) -> None:
    """The pods stay while the agents wait (each holds its pod's lock); `start`
    re-attaches through kubectl exec into the same pods; `down` deletes them."""
    cli.env.update({k: v for k, v in k8s_lab.env().items() if k in ("PATH", "KUBECONFIG")})
    before = _pods(k8s_lab)
    flags = ["--provider", "k8s", "--k8s-python", sys.executable]
    check_survives_its_daemon(
        cli, "kra", flags, tmp_path / "stop", lambda: sorted(_pods(k8s_lab) - before)
    )


@pytest.mark.timeout(420)
def test_a_k8s_cluster_nobody_re_attaches_to_ends_its_pods_after_the_grace(
    cli: CLI, k8s_lab: K8sLab, tmp_path: Path
) -> None:
    """Past the grace the agents end and the holders end the pods (Succeeded, holding
    nothing); `down` deletes them."""
    cli.env.update({k: v for k, v in k8s_lab.env().items() if k in ("PATH", "KUBECONFIG")})
    before = _pods(k8s_lab)
    flags = ["--provider", "k8s", "--k8s-python", sys.executable]
    check_ends_after_the_grace(
        cli, "krg", flags, tmp_path / "stop", lambda: sorted(_pods(k8s_lab, live=True) - before)
    )
    assert _pods(k8s_lab) - before == set()
