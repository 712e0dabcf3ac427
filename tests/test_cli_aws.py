"""``flotilla`` with ``--provider aws`` / ``infra: aws/<region>`` against the EC2 emulator and
booting namespace instances of ``_aws`` (root only): the CLI and its daemon run as
subprocesses pointed at the emulator through the standard AWS_* variables."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _aws import REGION, AwsLab, aws_lab_fixture, aws_shared_lab_fixture  # noqa: F401
from _hosts import Lab, ssh_lab_fixture  # noqa: F401
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


def _pool_folder(lab: Lab, public: str, known_hosts: str) -> str:
    """An AWS pool's private folder as a public-IP pool leaves it: its login key, the host
    key pinned at the PUBLIC address the client reaches the instance at (``pin``), no
    ``client`` file (no orphan cleanup takes it)."""
    import shutil
    import tempfile

    from flotilla._providers.aws.keys import FOLDER_PREFIX

    folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}h46pub{os.getpid()}-")
    shutil.copyfile(lab.client_key, os.path.join(folder, "login_key"))
    os.chmod(os.path.join(folder, "login_key"), 0o600)
    pinned = [line for line in known_hosts.splitlines() if line.split(" ", 1)[0] == public]
    assert pinned, known_hosts
    with open(os.path.join(folder, "known_hosts"), "w") as f:
        f.write("".join(line + "\n" for line in pinned))
    return folder


def _ssh(argv: list[str], command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ssh", "-T", "-o", "BatchMode=yes", *argv, command],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_a_public_ip_aws_node_is_found_by_its_private_address_for_ssh_and_re_attach(
    ssh_lab: Lab, tmp_path: Path
) -> None:
    """A public-IP AWS pool (no ``--private-ips``) pins each instance's host key at its
    public address, while the cluster records the private address (what peers know it
    by). ``flotilla ssh`` and a re-attach find the node's login by that private address
    and reach it at the public one, host key pinned. The AWS lab cannot stand in public
    addresses (moto draws them at random and the provider asks AWS's checkip service on
    the internet), so an SSH lab host plays the instance at its public address, its
    private address reaches nothing, and the pool's folder is what the AWS pool writes."""
    from flotilla._providers.aws.keys import remove_folder
    from flotilla._providers.cloud import login
    from flotilla._providers.ssh_shell import Target
    from flotilla.cli.adopt import keep_login, login_for
    from flotilla.cli.backends.aws import BACKEND, AWSSpec
    from flotilla.cli.state import NodeRecord, Paths

    host = ssh_lab.hosts[0]
    public, private = host.addr, f"{ssh_lab.subnet}.251"  # no host has .251
    folder = _pool_folder(ssh_lab, public, ssh_lab.known_hosts.read_text())
    try:
        # what AWSAllocation.start_agent records once the node's agent runs
        login.remember(folder, private, Target(public, "root", 22))
        nodes = [NodeRecord(0, private, "ip-x", "/root", 0)]
        paths = Paths("pub", home=tmp_path)
        paths.ensure()
        argv = BACKEND.ssh_login(paths, AWSSpec(), nodes, 0)  # what `flotilla ssh` runs
        assert "StrictHostKeyChecking=yes" in argv and f"root@{public}" in argv
        done = _ssh(argv, "hostname -I")
        assert done.returncode == 0 and public in done.stdout.split(), done.stderr
        keep_login(BACKEND, AWSSpec(), paths, nodes)  # the first daemon keeps it
    finally:
        remove_folder(folder)  # as an orphan cleanup removes the dead client's folder
    kept = login_for(paths)(0)  # what a daemon re-attaching after a kill -9 logs in with
    done = _ssh(kept, "hostname -I")
    assert done.returncode == 0 and public in done.stdout.split(), done.stderr
    # the host key stays pinned: another key at that address is refused
    other = next(h for h in ssh_lab.hosts if h.addr != public)
    kept_hosts = next(w.split("=", 1)[1] for w in kept if w.startswith("UserKnownHostsFile="))
    Path(kept_hosts).write_text(f"{public} {' '.join(other.pubkey.split()[:2])}\n")
    refused = _ssh(kept, "true")
    assert refused.returncode != 0 and "host key" in refused.stderr.lower(), refused.stderr


def test_the_latest_login_recorded_for_an_address_wins() -> None:
    """A replacement instance may get the private address of one before it (in the same
    pool): its line, the latest, is the login; a pool of another user's folder or with no
    line for the address is not."""
    import tempfile

    from flotilla._errors import ConfigurationError
    from flotilla._providers.aws.keys import FOLDER_PREFIX, remove_folder, ssh_login
    from flotilla._providers.cloud import login
    from flotilla._providers.ssh_shell import Target

    folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}h46last{os.getpid()}-")
    try:
        login.remember(folder, "10.9.0.5", Target("203.0.113.7", "ubuntu", 22))
        login.remember(folder, "10.9.0.5", Target("203.0.113.9", "ubuntu", 22))
        argv = ssh_login("10.9.0.5")
        assert argv[-1] == "ubuntu@203.0.113.9"
        assert f"UserKnownHostsFile={os.path.join(folder, 'known_hosts')}" in argv
        with pytest.raises(ConfigurationError, match="no running AWS pool"):
            ssh_login("10.9.0.6")
    finally:
        remove_folder(folder)
