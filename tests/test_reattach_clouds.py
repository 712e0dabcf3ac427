"""A cloud cluster whose daemon died (kill -9) while its instances ran is re-attached to.

The EC2 emulator with booting namespace instances (``_aws``) and the RunPod stand-in
(``_runpod``), both shared with the other tests of the session; root only. The job ticks
until a file the test writes appears (the instances share this machine's file system), so
the test waits on what it printed, never on time. What the providers' APIs say is the
judge of "no instance left": instances listed running, terminated.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from _aws import REGION, AwsLab, aws_lab_fixture, aws_shared_lab_fixture  # noqa: F401
from _procs import wait_until
from _runpod import RunPodLab, runpod_lab_fixture  # noqa: F401 - the runpod_lab fixture
from test_cli import CLI
from test_cli import cli as cli  # the fixture
from test_cli_aws import _lab_flags
from test_cli_runpod import RTX4090
from test_reattach import kill_daemon, last_tick, read, start_ticking

from flotilla.cli.state import ClusterState, JobStatus

# The tests' own waits (a launch, 180 s for the instances to end, 300 s for start and down)
# are longer than pytest-timeout's 120 s default: a CI run hit that default mid-wait.
pytestmark = pytest.mark.timeout(600)


def _pool(aws_lab: AwsLab, cli: CLI, name: str) -> str:
    """The ``flotilla:pool`` tag of the cluster's running instances."""
    rec = cli.record(name)
    assert rec is not None
    ips = {n.ip for n in rec.nodes}
    pools = {
        {t["Key"]: t["Value"] for t in i["Tags"]}["flotilla:pool"]
        for i in aws_lab.describe()
        if i["State"]["Name"] == "running" and i["PrivateIpAddress"] in ips
    }
    (pool,) = pools
    return pool


def _states(aws_lab: AwsLab, pool: str) -> set[str]:
    return {i["State"]["Name"] for i in aws_lab.pool_instances(pool)}


def _orphans(cli: CLI) -> str:
    shown = cli.ok("down", "--orphans", "--provider", "aws", "--region", REGION, "--dry-run")
    return shown.stdout + shown.stderr


def test_an_aws_clusters_instances_are_re_attached_and_down_terminates_them(
    cli: CLI, aws_lab: AwsLab, tmp_path: Path
) -> None:
    cli.env.update(aws_lab.env)
    stop = tmp_path / "stop"  # the instances see this machine's files
    flags = _lab_flags(aws_lab)
    cli.ok("launch", "echo up", "-c", "ca", "--nodes", "2", "--provider", "aws", *flags)
    before = cli.record("ca")
    assert before is not None
    pool = _pool(aws_lab, cli, "ca")
    agents = [n.agent_pid for n in before.nodes]
    log = start_ticking(cli, "ca", stop)
    kill_daemon(cli, "ca")
    # its instances are held for the grace: no orphan cleanup takes them
    assert pool not in _orphans(cli)
    assert _states(aws_lab, pool) == {"running"}
    seen = {r: last_tick(read(log), r) for r in (0, 1)}

    started = cli.ok("start", "ca", timeout=300)
    assert "re-attached to its 2 node(s)" in started.stderr, started.stderr
    after = cli.record("ca")
    assert after is not None and after.observed_state() is ClusterState.UP
    assert [n.agent_pid for n in after.nodes] == agents  # the same agents, nothing new
    assert _states(aws_lab, pool) == {"running"}  # the same instances, none launched
    assert len(after.clients) == 2  # the new daemon holds the first one's instances
    assert wait_until(lambda: all(last_tick(read(log), r) > seen[r] + 2 for r in (0, 1)), 60)
    job = after.jobs[-1]
    stop.touch()
    followed = cli.ok("logs", "ca", str(job.id))
    assert "done-0" in followed.stdout and "done-1" in followed.stdout
    done = cli.record("ca")
    assert done is not None and done.job(job.id).status == JobStatus.SUCCEEDED.value  # type: ignore[union-attr]
    assert pool not in _orphans(cli)  # held by the new daemon
    assert cli.ok("exec", "ca", "echo again").stdout.count("again") == 2
    refused = cli("stop", "ca")  # it can release them, not stop them
    assert refused.returncode == 2 and "re-attached" in refused.stderr, refused.stderr

    cli.ok("down", "ca", timeout=300)
    assert _states(aws_lab, pool) == {"terminated"}
    assert aws_lab.pool_groups(pool) == []
    assert pool not in _orphans(cli)  # nothing of it is left to find


def _self_terminating(aws_lab: AwsLab) -> str:
    """A power-off command that ends the instance as EC2 does one whose shutdown
    behaviour is "terminate": its own id from the metadata service, then
    TerminateInstances on the emulator."""
    script = (
        "import boto3, urllib.request as u\n"
        "m = 'http://169.254.169.254/latest/'\n"
        "h = {'X-aws-ec2-metadata-token-ttl-seconds': '60'}\n"
        "t = u.urlopen(u.Request(m + 'api/token', method='PUT', headers=h)).read().decode()\n"
        "h = {'X-aws-ec2-metadata-token': t}\n"
        "i = u.urlopen(u.Request(m + 'meta-data/instance-id', headers=h)).read().decode()\n"
        f"boto3.client('ec2', endpoint_url={aws_lab.endpoint!r}, region_name={REGION!r},\n"
        "    aws_access_key_id='testing', aws_secret_access_key='testing'\n"
        ").terminate_instances(InstanceIds=[i])\n"
    )
    return shlex.join([sys.executable, "-c", script])


def test_an_aws_cluster_nobody_re_attaches_to_ends_its_instances_after_the_grace(
    cli: CLI, aws_lab: AwsLab, tmp_path: Path
) -> None:
    """The daemon dies, nobody comes: as the grace ends, each instance's watchdog runs its
    power-off command (``ttl`` is 600 s: without the agents' hold it would wait that
    long) and the instances end themselves; ``down`` then removes what is left. Also the
    instance whose contact file was removed under its agent (full parallel runs saw
    contact files vanish): the hold makes it again, and its watchdog did not take "no
    file" for "a contact now" (before, that instance ran on until its ttl)."""
    cli.env.update(aws_lab.env)
    flags = [*_lab_flags(aws_lab)[:-2], "--poweroff-command", _self_terminating(aws_lab)]
    grace = {"FLOTILLA_REATTACH_GRACE": "4"}
    cli.ok("launch", "echo up", "-c", "cg", "--nodes", "2", "--provider", "aws", *flags, env=grace)
    pool = _pool(aws_lab, cli, "cg")
    start_ticking(cli, "cg", tmp_path / "stop")
    first = aws_lab.pool_instances(pool)[0]["InstanceId"]
    (aws_lab.lab.tmp / "workdir" / "watchdog" / first).unlink(missing_ok=True)
    kill_daemon(cli, "cg")
    assert wait_until(lambda: _states(aws_lab, pool) == {"terminated"}, 180), _states(aws_lab, pool)
    refused = cli("start", "cg", timeout=300)
    assert refused.returncode != 0 and "is gone" in refused.stderr, refused.stderr
    cli.ok("down", "cg", timeout=300)
    assert aws_lab.pool_groups(pool) == []


RUNPOD_TASK = """\
num_nodes: 2
resources:
  infra: runpod
  accelerators: RTX4090:1
run: echo up
"""


def test_a_runpod_clusters_pods_are_re_attached_and_down_terminates_them(
    cli: CLI, runpod_lab: RunPodLab, tmp_path: Path
) -> None:
    runpod_lab.add_gpu(*RTX4090)
    cli.env.update(runpod_lab.env)
    others = {p.id for p in runpod_lab.live()}
    cli.ok("launch", cli.task("up.yaml", RUNPOD_TASK), "-c", "cr", timeout=300)
    before = cli.record("cr")
    assert before is not None
    pods = {p.id for p in runpod_lab.live()} - others
    (pool,) = {p.name.split(":")[1] for p in runpod_lab.live() if p.id in pods}
    agents = [n.agent_pid for n in before.nodes]
    stop = Path(f"/tmp/flotilla-stop-{tmp_path.name}")  # on each pod's own file system
    log = start_ticking(cli, "cr", stop)
    kill_daemon(cli, "cr")
    dry = cli.ok("down", "--orphans", "--provider", "runpod", "--dry-run").stderr
    assert "orphan pool(s)" in dry and pool not in dry, dry  # held for the grace
    seen = {r: last_tick(read(log), r) for r in (0, 1)}
    started = cli.ok("start", "cr", timeout=300)
    assert "re-attached to its 2 node(s)" in started.stderr, started.stderr
    after = cli.record("cr")
    assert after is not None and [n.agent_pid for n in after.nodes] == agents
    assert {p.id for p in runpod_lab.live()} - others == pods  # no pod rented again
    assert wait_until(lambda: all(last_tick(read(log), r) > seen[r] + 2 for r in (0, 1)), 60)
    for rank in (0, 1):  # (the pods have file systems of their own)
        cli.ok("ssh", "cr", "--node", str(rank), "--", f"touch {stop}")
    assert wait_until(lambda: "done-0" in read(log) and "done-1" in read(log), 60), read(log)[-999:]
    job = after.jobs[-1]
    followed = cli.ok("logs", "cr", str(job.id))
    assert "done-0" in followed.stdout and "done-1" in followed.stdout
    done = cli.record("cr")
    assert done is not None and done.job(job.id).status == JobStatus.SUCCEEDED.value  # type: ignore[union-attr]
    cli.ok("down", "cr", timeout=300)
    assert wait_until(lambda: not pods & {p.id for p in runpod_lab.live()}, 60)
    assert {runpod_lab.destroyed[p] for p in pods} == {"account"}  # by down, not by a timer


def test_a_runpod_cluster_nobody_re_attaches_to_ends_its_pods_after_the_grace(
    cli: CLI, runpod_lab: RunPodLab
) -> None:
    """Nobody re-attaches: as the grace ends each pod's watchdog runs its destroy script
    (with the pod's own key; ``ttl`` is 600 s), and the pods are gone."""
    runpod_lab.add_gpu(*RTX4090)
    cli.env.update(runpod_lab.env)
    grace = {"FLOTILLA_REATTACH_GRACE": "4"}
    others = {p.id for p in runpod_lab.live()}
    cli.ok("launch", cli.task("up.yaml", RUNPOD_TASK), "-c", "cs", timeout=300, env=grace)
    pods = {p.id for p in runpod_lab.live()} - others
    assert len(pods) == 2
    kill_daemon(cli, "cs")
    assert wait_until(lambda: not pods & {p.id for p in runpod_lab.live()}, 180)
    assert {runpod_lab.destroyed[p] for p in pods} == {"self"}
    cli.ok("down", "cs", timeout=300)


def test_a_waiting_agent_holds_its_watchdog_for_the_grace_and_ends_the_instance_after(
    tmp_path: Path,
) -> None:
    """The node side, without a lab: a cluster's agent whose client is gone moves its
    instance's watchdog deadline to the end of its wait (an hour here, with a ttl of
    0.5 s), and as the wait ends the watchdog powers off at once (with a ttl of 600 s)."""
    import os
    import subprocess
    import time

    import flotilla

    contact, fired = tmp_path / "contact", tmp_path / "fired"
    contact.touch()
    code = f"""
from flotilla._node.cloud import Config, Contact, watchdog
Contact({str(contact)!r}, 5.0, ttl=600.0).hold(0.0)  # nobody came: the instance ends now
watchdog(Config({str(contact)!r}, 600.0, ("sh", "-c", "date +%s.%N >> {fired}")))
"""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(flotilla.__file__))}
    first = f"""
from flotilla._node.cloud import Contact
Contact({str(contact)!r}, 5.0, ttl=0.5).hold(3600.0)
"""
    subprocess.run([sys.executable, "-c", first], env=env, check=True, timeout=60)
    assert contact.stat().st_mtime + 0.5 > time.time() + 3000  # the deadline: the grace's end
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert len(fired.read_text().split()) == 1  # powered off once, not ttl (600 s) later


def test_a_lease_keeps_a_dead_client_alive_until_it_runs_out_or_is_dropped() -> None:
    """What keeps orphan cleanups off a dead daemon's instances (``cloud.identity``)."""
    import socket
    import subprocess

    from flotilla._providers.cloud.identity import client_alive, drop_leases, lease

    dead = subprocess.Popen(["true"])
    dead.wait()
    client = f"{socket.gethostname()}:{dead.pid}:1"
    assert client_alive(client) is False  # an orphan's client
    lease([client], 600.0)
    assert client_alive(client) is True  # held: not an orphan
    lease([client], -1.0)
    assert client_alive(client) is False  # ran out
    lease([client], 600.0)
    drop_leases([client])
    assert client_alive(client) is False  # released by its cluster
