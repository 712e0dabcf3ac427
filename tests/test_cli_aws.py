"""``flotilla`` with ``--provider aws`` / ``infra: aws/<region>`` against the EC2 emulator and
booting namespace instances of ``_aws`` (root only): the CLI and its daemon run as
subprocesses pointed at the emulator through the standard AWS_* variables."""

from __future__ import annotations

import subprocess
from typing import Any

from _aws import REGION, AwsLab, aws_lab_fixture  # noqa: F401
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture
from test_cli_files import copy_check

TASK = f"""\
num_nodes: 3
resources:
  infra: aws/{REGION}
  use_spot: true
  cpus: 2
  ports: 8080
  labels:
    team: ml
setup: echo "SETUP $SKYPILOT_NODE_RANK"
run: |
  echo "RUN $SKYPILOT_NODE_RANK $SKYPILOT_NUM_NODES $(echo $SKYPILOT_NODE_IPS) $MASTER_ADDR"
  if [ "$SKYPILOT_NODE_RANK" = 0 ]; then
    for ip in $SKYPILOT_NODE_IPS; do echo "MESH $ip $(ssh "$ip" hostname -I)"; done
  fi
"""


def _lab_flags(lab: AwsLab) -> list[str]:
    """The lab's instances: root login, private addresses, a harmless power-off."""
    return [
        "--aws-user",
        "root",
        "--private-ips",
        "--aws-workdir",
        str(lab.lab.tmp / "workdir"),
        "--poweroff-command",
        f"sh -c 'date +%s.%N >> {lab.lab.tmp}/poweroff-$(hostname)'",
    ]


def _cluster_instances(lab: AwsLab, tag: str, value: str) -> list[dict[str, Any]]:
    return lab.describe(Filters=[{"Name": f"tag:{tag}", "Values": [value]}])


def test_task_file_with_infra_aws_runs_setup_and_run_on_3_instances(
    cli: CLI, aws_lab: AwsLab
) -> None:
    cli.env.update(aws_lab.env)
    task = cli.task("job.yaml", TASK)
    done = cli.ok("launch", task, "-c", "cloud", *_lab_flags(aws_lab), timeout=300)
    instances = _cluster_instances(aws_lab, "team", "ml")
    live = [i for i in instances if i["State"]["Name"] == "running"]
    assert len(live) == 3, instances
    live.sort(key=lambda i: i["AmiLaunchIndex"])
    addrs = [i["PrivateIpAddress"] for i in live]
    ips = " ".join(addrs)
    assert node_lines(done.stdout, "SETUP") == {r: str(r) for r in range(3)}
    assert node_lines(done.stdout, "RUN") == {r: f"{r} 3 {ips} {addrs[0]}" for r in range(3)}
    # node 0 reaches every node over ssh: pinned host keys, the cluster's key
    said = [
        line.split("MESH ", 1)[1].split() for line in done.stdout.splitlines() if "MESH " in line
    ]
    assert [tuple(words[:2]) for words in said] == [(a, a) for a in addrs]
    for inst in live:
        assert inst["InstanceLifecycle"] == "spot"  # use_spot
    (kind,) = {i["InstanceType"] for i in live}
    info = aws_lab.client().describe_instance_types(InstanceTypes=[kind])["InstanceTypes"][0]
    assert info["VCpuInfo"]["DefaultVCpus"] >= 2  # cpus: 2 chose the type
    pool_id = {t["Key"]: t["Value"] for t in live[0]["Tags"]}["flotilla:pool"]
    (group,) = aws_lab.pool_groups(pool_id)
    opened = {r.get("FromPort") for r in group["IpPermissions"] if r["IpProtocol"] == "tcp"}
    assert opened == {22, 8080}  # ports: opened in the pool's group
    # flotilla ssh reaches node 2 with the pool's pinned key, in its working directory
    rec = cli.record("cloud")
    assert rec is not None
    shell = cli.ok("ssh", "cloud", "--node", "2", "--", "hostname -I; pwd")
    assert addrs[2] in shell.stdout.split() and rec.nodes[2].workdir in shell.stdout.split()
    copy_check(cli, "cloud", 2, cli.cwd / "copies")  # cp over the same pinned ssh
    # the cluster's ssh_config entries (what ~/.ssh/config includes): plain ssh reaches it
    config = cli.home / "ssh" / "cloud.config"
    plain = subprocess.run(
        ["ssh", "-F", str(config), "-o", "BatchMode=yes", "cloud-worker2", "hostname -I"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert addrs[2] in plain.stdout.split(), plain.stderr
    cli.ok("down", "cloud", timeout=120)
    states = {i["State"]["Name"] for i in aws_lab.pool_instances(pool_id)}
    assert states == {"terminated"}
    assert aws_lab.pool_groups(pool_id) == []


def test_down_orphans_removes_what_a_killed_cluster_left(cli: CLI, aws_lab: AwsLab) -> None:
    """The cluster's daemon (the pool's client) is killed -9: its instances are held for
    the re-attach grace (here 2 s), then nothing holds them. ``flotilla down --orphans
    --provider aws`` removes them, its group and keys; a live cluster's pool is left
    alone."""
    import os
    import signal

    from _procs import wait_until

    from flotilla._system import procs

    cli.env.update(aws_lab.env)

    def running_pools() -> set[str]:
        return {
            {t["Key"]: t["Value"] for t in i["Tags"]}["flotilla:pool"]
            for i in aws_lab.describe()
            if i["State"]["Name"] == "running"
        }

    before = running_pools()
    grace = {"FLOTILLA_REATTACH_GRACE": "2"}
    cli.ok(
        "launch", "echo up", "-c", "doomed", "--provider", "aws", *_lab_flags(aws_lab), env=grace
    )
    (doomed_pool,) = running_pools() - before
    cli.ok("launch", "echo up", "-c", "alive", "--provider", "aws", *_lab_flags(aws_lab))
    (alive_pool,) = running_pools() - before - {doomed_pool}
    pools = {"doomed": doomed_pool, "alive": alive_pool}
    doomed = cli.record("doomed")
    assert doomed is not None
    os.kill(doomed.pid, signal.SIGKILL)
    wait_until(lambda: not procs.alive(doomed.pid, doomed.pid_start), 30.0)

    def listed() -> bool:  # once the grace (and the daemon's lease on its pool) ended
        dry = cli.ok("down", "--orphans", "--provider", "aws", "--region", REGION, "--dry-run")
        return doomed_pool in dry.stdout + dry.stderr

    assert wait_until(listed, 60.0)
    done = cli.ok("down", "--orphans", "--provider", "aws", "--region", REGION, timeout=120)
    assert pools["doomed"] in done.stderr + done.stdout
    assert {i["State"]["Name"] for i in aws_lab.pool_instances(pools["doomed"])} == {"terminated"}
    assert aws_lab.pool_groups(pools["doomed"]) == []
    running = {i["State"]["Name"] for i in aws_lab.pool_instances(pools["alive"])}
    assert running == {"running"}
    cli.ok("down", "doomed", "alive", timeout=120)
    assert {i["State"]["Name"] for i in aws_lab.pool_instances(pools["alive"])} == {"terminated"}


def test_node_records_follow_a_replaced_instance(cli: CLI, aws_lab: AwsLab) -> None:
    """An instance of a cluster terminated without notice is replaced by the pool; the
    cluster's node records (agent pid, address, host) follow the new machine, so ``flotilla
    ssh --node K`` and the next job reach it."""
    from _procs import cmdline, wait_until

    from flotilla._system import procs

    cli.env.update(aws_lab.env)
    cli.ok(
        "launch",
        "echo up",
        "-c",
        "renew",
        "--nodes",
        "3",
        "--provider",
        "aws",
        *_lab_flags(aws_lab),
        timeout=300,
    )
    before = cli.record("renew")
    assert before is not None
    (old,) = [
        i
        for i in aws_lab.describe()
        if i["PrivateIpAddress"] == before.nodes[2].ip and i["State"]["Name"] == "running"
    ]
    aws_lab.client().terminate_instances(InstanceIds=[old["InstanceId"]])

    def moved() -> bool:
        rec = cli.record("renew")
        return rec is not None and rec.nodes[2].agent_pid != before.nodes[2].agent_pid

    assert wait_until(moved, 120.0), "the node records did not follow the replacement"
    after = cli.record("renew")
    assert after is not None
    assert [n.node for n in after.nodes] == [0, 1, 2]
    assert after.nodes[:2] == before.nodes[:2]
    assert not procs.alive(before.nodes[2].agent_pid)  # the old host and agent are gone
    new_pid = after.nodes[2].agent_pid
    assert procs.alive(new_pid) and "flotilla.agent" in cmdline(new_pid)
    (new,) = [
        i
        for i in aws_lab.describe()
        if i["PrivateIpAddress"] == after.nodes[2].ip and i["State"]["Name"] == "running"
    ]
    assert new["InstanceId"] != old["InstanceId"]
    shell = cli.ok("ssh", "renew", "--node", "2", "--", "hostname -I; pwd")
    assert after.nodes[2].ip in shell.stdout.split()
    assert after.nodes[2].workdir in shell.stdout.split()
    job = cli.ok("exec", "renew", "echo AT $SKYPILOT_NODE_RANK $(hostname -I)")
    assert after.nodes[2].ip in node_lines(job.stdout, "AT")[2].split()
    cli.ok("down", "renew", timeout=120)
