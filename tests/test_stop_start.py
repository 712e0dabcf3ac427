"""``flotilla stop`` / ``flotilla start`` / ``launch --autostop`` on local, SSH-lab and
AWS-lab clusters: agents stopped, node folders (and what jobs left there) kept, STOPPED in
``status``; on AWS the instances are stopped (StopInstances) and the same ones started again;
providers (and spot instances) that cannot stop are refused with ``down`` offered."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

import pytest
from _aws import AwsLab, aws_lab_fixture, aws_shared_lab_fixture  # noqa: F401
from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from _procs import processes_in, wait_until
from test_cli import CLI, node_lines, ssh_flags
from test_cli import cli as cli  # the fixture
from test_cli_aws import _lab_flags

from flotilla._providers.aws.kept import Keep, KeptPool
from flotilla.cli.state import ClusterRecord, Paths, save


def _wait_record(cli: CLI, name: str, wanted: str | None, timeout: float = 60) -> None:
    """Poll the record until its state is ``wanted`` (None: until it is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        rec = cli.record(name)
        state = None if rec is None else rec.observed_state().value
        if state == wanted:
            return
        assert time.monotonic() < deadline, f"cluster {name} is {state}, not {wanted}"
        time.sleep(0.05)


def test_stop_keeps_the_node_folders_and_start_brings_the_cluster_back(cli: CLI) -> None:
    cli.ok("launch", "-c", "st", "--nodes", "2", "echo kept-$SKYPILOT_NODE_RANK > ~/kept.txt")
    cli.ok("stop", "st")
    status = cli.ok("status").stdout
    assert "STOPPED" in next(line for line in status.splitlines() if line.startswith("st "))
    assert processes_in(cli.home) == []  # no daemon, agent or job left
    refused = cli("exec", "st", "true")
    assert refused.returncode != 0 and "flotilla start st" in refused.stderr
    cli.ok("start", "st")
    _wait_record(cli, "st", "UP", 1)
    done = cli.ok("exec", "st", 'echo "found: $(cat ~/kept.txt)"')
    assert node_lines(done.stdout, "found: ") == {0: "kept-0", 1: "kept-1"}
    again = cli.ok("start", "st")
    assert "already UP" in again.stderr


def test_autostop_stops_an_idle_cluster_and_with_down_removes_it(cli: CLI) -> None:
    cli.ok("launch", "-c", "auto", "--autostop", "0.01", "echo one")
    _wait_record(cli, "auto", "STOPPED")
    cli.ok("launch", "-c", "gone", "--autostop", "0.01", "--down", "echo two")
    _wait_record(cli, "gone", None)  # torn down: its record, then its folder, removed
    folder = cli.home / "clusters" / "gone"
    assert wait_until(lambda: not folder.exists(), 30), list(folder.rglob("*"))


def test_stop_is_refused_where_nodes_cannot_stop(cli: CLI) -> None:
    paths = Paths("batch", cli.home)
    paths.ensure()
    save(paths, ClusterRecord(name="batch", provider={"kind": "slurm"}, num_nodes=1))
    done = cli("stop", "batch")
    assert done.returncode == 2
    assert "cannot be stopped and started again" in done.stderr
    assert "flotilla down batch" in done.stderr


@pytest.mark.parametrize("kind", ["gcp", "runpod", "verda"])
def test_stop_is_refused_for_spot_instances_of_clouds_that_stop(cli: CLI, kind: str) -> None:
    """GCP, RunPod and Verda clusters can be stopped (``cloud.stopstart``), but not their spot
    instances, which those clouds delete or outbid: refused before anything happens, with
    ``down`` offered; ``--autostop`` without ``--down`` is refused for them too."""
    paths = Paths("spotty", cli.home)
    paths.ensure()
    provider = {"kind": kind, "settings": [["allocation", "spot"]]}
    save(paths, ClusterRecord(name="spotty", provider=provider, num_nodes=1))
    done = cli("stop", "spotty")
    assert done.returncode == 2, done.stderr
    assert f"{kind} spot instances, which are never stopped" in done.stderr
    assert "flotilla down spotty" in done.stderr
    flags = ["--provider", kind, "--use-spot", "--autostop", "5", "--dryrun"]
    refused = cli("launch", "echo x", *flags)
    assert refused.returncode != 0 and "spot instances are never stopped" in refused.stderr


def test_stop_and_start_on_ssh_hosts(cli: CLI, ssh_lab: Lab) -> None:
    hosts = ssh_lab.hosts[:2]
    mark = f"kept-{secrets.token_hex(4)}"
    flags = ssh_flags(ssh_lab, hosts, cli.cwd / "ssh-work")
    run = f"echo {mark}-$SKYPILOT_NODE_RANK > m-$SKYPILOT_NODE_RANK"  # in the node's own folder
    cli.ok("launch", "-c", "sst", "--nodes", "2", *flags, run)
    cli.ok("stop", "sst")
    _wait_record(cli, "sst", "STOPPED", 1)
    assert ssh_lab.wait_no_agents(hosts) == {}
    assert "STOPPED" in cli.ok("status", "sst").stdout
    cli.ok("start", "sst")
    assert len(ssh_lab.agent_pids(hosts)) == 2  # an agent on each host again
    done = cli.ok("exec", "sst", 'echo "found: $(cat m-$SKYPILOT_NODE_RANK)"')
    assert node_lines(done.stdout, "found: ") == {0: f"{mark}-0", 1: f"{mark}-1"}


# -- AWS (the EC2 emulator and namespace instances of _aws) ------------------------------
def _aws_flags(lab: AwsLab, *more: str) -> list[str]:
    return ["--provider", "aws", *_lab_flags(lab), *more]


def _pool_of(cli: CLI, name: str) -> KeptPool:
    kept = Keep(cli.home / "clusters" / name / "aws").load()
    assert kept is not None, f"cluster {name} recorded no instances"
    return kept


def _states(lab: AwsLab, ids: list[str]) -> list[str]:
    found = {i["InstanceId"]: i["State"]["Name"] for i in lab.describe(InstanceIds=ids)}
    return [found[i] for i in ids]


def _powered_off(lab: AwsLab, ids: list[str]) -> bool:
    """The lab saw the instances stopped: nothing runs in their hosts (no sshd, agent,
    watchdog), their hosts (folders, host keys) are still there."""
    hosts = [lab.host_of(i) for i in ids]
    return all(lab.power[(i, "stop")] for i in ids) and all(
        h is not None and lab.lab.pids(h) == [] for h in hosts
    )


def test_aws_stop_keeps_the_instances_and_start_brings_them_back(cli: CLI, aws_lab: AwsLab) -> None:
    cli.env.update(aws_lab.env)
    mark = f"kept-{secrets.token_hex(4)}"
    write = f"echo {mark}-$SKYPILOT_NODE_RANK > kept.txt; echo AT $(hostname -I)"
    up = cli.ok("launch", "-c", "ast", "--nodes", "2", *_aws_flags(aws_lab), write, timeout=300)
    kept = _pool_of(cli, "ast")
    ids = [i.id for i in kept.instances]
    assert len(ids) == 2 and not kept.stopped and kept.market == "on-demand"
    before = cli.record("ast")
    assert before is not None
    addrs = [n.ip for n in before.nodes]
    assert {r: v.split()[0] for r, v in node_lines(up.stdout, "AT").items()} == dict(
        enumerate(addrs)
    )
    hosts = [aws_lab.host_of(i) for i in ids]

    cli.ok("stop", "ast", timeout=120)
    assert _states(aws_lab, ids) == ["stopped", "stopped"]  # StopInstances, not terminated
    assert _pool_of(cli, "ast").stopped
    assert wait_until(lambda: _powered_off(aws_lab, ids), 30), [
        aws_lab.lab.pids(h) for h in hosts if h is not None
    ]
    assert "STOPPED" in cli.ok("status", "ast").stdout
    refused = cli("exec", "ast", "true")
    assert refused.returncode != 0 and "flotilla start ast" in refused.stderr
    # the stopped pool is no orphan: another AWS pool's start (its sweep) leaves it alone
    assert "kept (stopped clusters" in cli.ok("down", "--orphans", "--provider", "aws").stderr
    assert _states(aws_lab, ids) == ["stopped", "stopped"]

    cli.ok("start", "ast", timeout=300)
    assert _states(aws_lab, ids) == ["running", "running"]  # the same instances
    assert [aws_lab.power[(i, "start")] for i in ids] == [1, 1]
    after = cli.record("ast")
    assert after is not None and [n.ip for n in after.nodes] == addrs
    done = cli.ok("exec", "ast", 'echo "found: $(cat kept.txt) on $(hostname -I)"')
    found = node_lines(done.stdout, "found: ")
    assert {r: v.split()[:3] for r, v in found.items()} == {
        r: [f"{mark}-{r}", "on", addrs[r]] for r in range(2)
    }
    # flotilla ssh: the pool's login key, the host key recorded at launch pinned again
    shell = cli.ok("ssh", "ast", "--node", "1", "--", "cat kept.txt")
    assert shell.stdout.strip() == f"{mark}-1"
    assert not _pool_of(cli, "ast").stopped

    cli.ok("down", "ast", timeout=120)
    assert _states(aws_lab, ids) == ["terminated", "terminated"]
    assert aws_lab.pool_groups(kept.pool) == []
    assert not (cli.home / "clusters" / "ast").exists()


def test_aws_spot_cluster_stop_is_refused_before_anything_changes(
    cli: CLI, aws_lab: AwsLab
) -> None:
    cli.env.update(aws_lab.env)
    refused = cli(
        "launch",
        "-c",
        "spa",
        "--autostop",
        "5",
        *_aws_flags(aws_lab, "--allocation", "spot"),
        "true",
    )
    assert refused.returncode == 2
    assert "spot instances, which EC2 cannot stop" in refused.stderr
    assert "--down" in refused.stderr
    assert cli.record("spa") is None  # nothing launched
    cli.ok("launch", "-c", "sp", *_aws_flags(aws_lab, "--allocation", "spot"), "true", timeout=300)
    ids = [i.id for i in _pool_of(cli, "sp").instances]
    rec = cli.record("sp")
    assert rec is not None
    done = cli("stop", "sp")
    assert done.returncode == 2
    assert "spot instances, which EC2 cannot stop" in done.stderr
    assert "flotilla down sp" in done.stderr
    assert _states(aws_lab, ids) == ["running"]
    assert aws_lab.power[(ids[0], "stop")] == 0
    now = cli.record("sp")
    assert now is not None and now.observed_state().value == "UP" and now.pid == rec.pid
    cli.ok("exec", "sp", "true")  # its agents still serve
    cli.ok("down", "sp", timeout=120)
    assert _states(aws_lab, ids) == ["terminated"]


def test_aws_autostop_stops_an_idle_cluster_and_down_terminates_it(
    cli: CLI, aws_lab: AwsLab
) -> None:
    cli.env.update(aws_lab.env)
    cli.ok("launch", "-c", "aidle", "--autostop", "0.01", *_aws_flags(aws_lab), "true", timeout=300)
    _wait_record(cli, "aidle", "STOPPED", 120)
    kept = _pool_of(cli, "aidle")
    ids = [i.id for i in kept.instances]
    assert kept.stopped and _states(aws_lab, ids) == ["stopped"]
    assert wait_until(lambda: _powered_off(aws_lab, ids), 30)
    cli.ok("down", "aidle", timeout=120)  # no daemon: the CLI terminates what was kept
    assert _states(aws_lab, ids) == ["terminated"]
    assert aws_lab.pool_groups(kept.pool) == []


def test_aws_started_instance_is_pinned_at_its_new_public_address(
    aws_lab: AwsLab, tmp_path: Path
) -> None:
    """EC2 gives a stopped instance a new public address when it starts: the pool's
    known_hosts pins the host key recorded at launch at the new address (and only there)."""
    from _aws import ZONES

    from flotilla._providers.aws.kept import KeptInstance
    from flotilla._providers.aws.keys import user_data
    from flotilla._providers.aws.pool import AWSAllocation
    from flotilla._providers.base import Options, PoolSpec
    from flotilla._providers.cloud.keys import keygen

    host_key = keygen(str(tmp_path), "host", "t")
    login = keygen(str(tmp_path), "login", "t")
    ec2 = aws_lab.client()
    (inst,) = ec2.run_instances(
        ImageId=aws_lab.ami,
        InstanceType="t3.micro",
        MinCount=1,
        MaxCount=1,
        UserData=user_data(host_key, login),
        NetworkInterfaces=[
            {
                "DeviceIndex": 0,
                "SubnetId": aws_lab.subnets[ZONES[0]],
                "AssociatePublicIpAddress": True,
            }
        ],
    )["Instances"]
    ident = inst["InstanceId"]
    alloc: AWSAllocation | None = None
    try:
        (first,) = aws_lab.describe(InstanceIds=[ident])
        ec2.stop_instances(InstanceIds=[ident])
        provider = aws_lab.provider(private_ips=False)
        keep = Keep(tmp_path / "keep")
        kept = KeptPool(
            pool="p" + secrets.token_hex(3),
            region=provider.api.region,
            stopped=True,
            market="on-demand",
            zone=ZONES[0],
            instance_type="t3.micro",
            image=aws_lab.ami,
            security_group="",
            instances=[KeptInstance(ident, host_key.public)],
        )
        spec = PoolSpec("t" + secrets.token_hex(3), 1, None, None, (), Options())
        alloc = AWSAllocation(provider.settings, provider.api, spec, keep, kept)
        alloc.host_keys = {ident: host_key.public}
        (started,) = alloc.stopping.start_kept([ident])
        assert started["State"]["Name"] == "running"
        new = started["PublicIpAddress"]
        assert new and new != first["PublicIpAddress"]
        with open(alloc.known_hosts) as f:
            pinned = f.read().split()
        assert pinned == [new, *host_key.public.split()[:2]]
    finally:
        if alloc is not None:  # its start put it on the ledger: an orphan until released
            asyncio.run(alloc.release())
        ec2.terminate_instances(InstanceIds=[ident])


def test_aws_start_without_capacity_keeps_the_instances_stopped(cli: CLI, aws_lab: AwsLab) -> None:
    """StartInstances refused (no capacity): `start` fails saying so, root cause first;
    the instances stay stopped and recorded, and the next `start` brings them back."""
    cli.env.update(aws_lab.env)
    cli.ok("launch", "-c", "acap", *_aws_flags(aws_lab), "echo here > kept.txt", timeout=300)
    ids = [i.id for i in _pool_of(cli, "acap").instances]
    cli.ok("stop", "acap", timeout=120)
    aws_lab.fail_starts("InsufficientInstanceCapacity", times=1)
    try:
        failed = cli("start", "acap", timeout=300)
    finally:
        aws_lab.clear_faults()
    assert failed.returncode != 0
    assert "no capacity to start 1 x" in failed.stderr
    assert "InsufficientInstanceCapacity" in failed.stderr
    assert _states(aws_lab, ids) == ["stopped"]
    assert _pool_of(cli, "acap").stopped
    cli.ok("start", "acap", timeout=300)
    assert _states(aws_lab, ids) == ["running"]
    done = cli.ok("exec", "acap", 'echo "found: $(cat kept.txt)"')
    assert node_lines(done.stdout, "found: ") == {0: "here"}
