"""The AWS provider against a real EC2 API (moto in server mode) and booting instances
(namespace hosts configured from the instances' user-data): see ``_aws.py``."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import http.server
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from _aws import REGION, ZONES, AwsLab, aws_lab_fixture, aws_shared_lab_fixture  # noqa: F401
from _hosts import _in_netns, keygen
from _procs import interruptible, kill_quietly, wait_until
from _standin import start_client

import flotilla as sky
from flotilla._providers.aws.pool import AWSAllocation
from flotilla._providers.base import AgentProcess, Machine, Options, PoolSpec


@sky.function
def where() -> dict[str, Any]:
    info = sky.instance_info()
    return {
        "node": info.node,
        "addr": info.addr,
        "head_addr": info.head_addr,
        "peers": [p.addr for p in info.peers],
    }


@sky.function
def fail() -> None:
    raise ValueError("boom")


def _gone(lab: AwsLab, pool_id: str) -> None:
    """Nothing of the pool is left: instances terminated, group and key folder gone."""
    states = {i["InstanceId"]: i["State"]["Name"] for i in lab.pool_instances(pool_id)}
    assert states and set(states.values()) == {"terminated"}, states
    assert lab.pool_groups(pool_id) == []
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-aws-{pool_id}-*")) == []
    for ident in states:
        assert lab.wait_ended(ident), f"the lab did not see {ident} terminated"
        assert lab.host_of(ident) is None, f"{ident}'s host still runs"
    assert lab.leftovers(states) == {}  # e.g. a boot guard's sleep: an orphan here


def _spec(nodes: int, **kwargs: Any) -> PoolSpec:
    return PoolSpec("t" + os.urandom(3).hex(), nodes, None, None, (), Options(), **kwargs)


def test_three_node_spot_pool(aws_lab: AwsLab) -> None:
    provider = aws_lab.provider(allocation="spot", tags={"team": "ml"}, ports=[8080, "9000-9001"])
    with sky.Compute(provider=provider, nodes=3) as pool:
        got = where() @ pool
        pool_id = pool.pool_id
        instances = sorted(aws_lab.pool_instances(pool_id), key=lambda i: i["AmiLaunchIndex"])
        addrs = [i["PrivateIpAddress"] for i in instances]
        assert [g["node"] for g in got] == [0, 1, 2]
        assert [g["addr"] for g in got] == addrs
        assert all(g["peers"] == addrs and g["head_addr"] == addrs[0] for g in got)
        for inst in instances:
            assert inst["InstanceLifecycle"] == "spot"
            tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
            assert tags["flotilla:pool"] == pool_id and tags["team"] == "ml"
            assert tags["flotilla:client"].split(":")[1] == str(os.getpid())
            assert "flotilla:created" in tags and "flotilla:owner" in tags
        (group,) = aws_lab.pool_groups(pool_id)
        rules = group["IpPermissions"]
        ssh = [r for r in rules if r.get("FromPort") == 22]
        # private_ips=True: SSH from the VPC's address ranges (the client is inside)
        vpc_ranges = {"172.31.0.0/16", f"{aws_lab.lab.subnet}.0/24"}
        assert {r["CidrIp"] for r in ssh[0]["IpRanges"]} == vpc_ranges
        members = [r for r in rules if r["IpProtocol"] == "-1"]
        assert members[0]["UserIdGroupPairs"][0]["GroupId"] == group["GroupId"]
        tcp = [r for r in rules if r["IpProtocol"] == "tcp" and r["FromPort"] != 22]
        opened = {(r["FromPort"], r["ToPort"]) for r in tcp}
        assert opened == {(8080, 8080), (9000, 9001)}  # and nothing else
        assert len(rules) == 4
    _gone(aws_lab, pool_id)


def _acquire(provider: Any, spec: PoolSpec) -> AWSAllocation:
    """Acquire without starting agents (the API side alone)."""
    return asyncio.run(provider.acquire(spec))


def _release(allocation: AWSAllocation) -> None:
    asyncio.run(allocation.release())


def test_choice_fits_vcpus_and_memory(aws_lab: AwsLab) -> None:
    provider = aws_lab.provider(allocation="on-demand")
    spec = _spec(2, vcpus=6, memory_gb=10)
    allocation = _acquire(provider, spec)
    try:
        choice = allocation.choice
        assert choice is not None and choice.vcpus >= 6 and choice.memory_gb >= 10
        launched = aws_lab.pool_instances(spec.pool_id)
        assert {i["InstanceType"] for i in launched} == {choice.instance_type}
        assert len(launched) == 2 and "InstanceLifecycle" not in launched[0]
        # the smallest: every type of the next size down lacks vCPUs or memory
        assert choice.vcpus == 8
    finally:
        _release(allocation)
    _gone(aws_lab, spec.pool_id)


def test_gpu_choice(aws_lab: AwsLab) -> None:
    from flotilla._accelerators import Accelerator

    provider = aws_lab.provider(allocation="on-demand")
    spec = PoolSpec("t" + os.urandom(3).hex(), 1, Accelerator("A100", 8), None, (), Options())
    allocation = _acquire(provider, spec)
    try:
        assert allocation.choice is not None
        assert allocation.choice.instance_type.startswith("p4d")
        assert allocation.choice.gpus == 8
    finally:
        _release(allocation)
    _gone(aws_lab, spec.pool_id)


def test_one_gpu_asked_where_only_eight_gpu_types_exist_is_said(
    aws_lab: AwsLab, capfd: pytest.CaptureFixture[str]
) -> None:
    from flotilla._accelerators import Accelerator

    provider = aws_lab.provider(allocation="on-demand")
    spec = PoolSpec("t" + os.urandom(3).hex(), 1, Accelerator("A100", 1), None, (), Options())
    allocation = _acquire(provider, spec)
    try:
        assert allocation.choice is not None and allocation.choice.gpus == 8  # p4d: 8 A100
    finally:
        _release(allocation)
    err = capfd.readouterr().err
    assert "it has 8 x A100, more than the 1 asked: no type of us-east-1 has 1" in err
    _gone(aws_lab, spec.pool_id)


@sky.function
def efa_env() -> tuple[str, str]:
    return os.environ.get("FI_PROVIDER", ""), os.environ.get("FI_EFA_USE_DEVICE_RDMA", "")


def test_network_tier_best_uses_efa_in_a_cluster_placement_group(aws_lab: AwsLab) -> None:
    provider = aws_lab.provider(allocation="on-demand", network_tier="best")
    with sky.Compute(provider=provider, nodes=2) as pool:
        assert efa_env() @ pool == [("efa", "1")] * 2  # NCCL/libfabric told to use EFA
        pool_id = pool.pool_id
        (kind,) = {i["InstanceType"] for i in aws_lab.pool_instances(pool_id)}
        ec2 = aws_lab.client()
        info = ec2.describe_instance_types(InstanceTypes=[kind])["InstanceTypes"][0]
        assert info["NetworkInfo"]["EfaSupported"]  # an EFA-capable type was chosen
        (group,) = ec2.describe_placement_groups(
            Filters=[{"Name": "tag:flotilla:pool", "Values": [pool_id]}]
        )["PlacementGroups"]
        assert group["Strategy"] == "cluster" and group["GroupName"] == f"flotilla-{pool_id}"
        launched = aws_lab.faults.placement.members[group["GroupName"]]
        assert len(launched) == 2  # both instances went into the group
    assert ec2.describe_placement_groups()["PlacementGroups"] == []  # gone with the pool
    _gone(aws_lab, pool_id)


def test_network_tier_is_checked() -> None:
    from flotilla._providers.aws import AWS

    with pytest.raises(sky.ConfigurationError, match="network_tier='fastest'"):
        AWS(network_tier="fastest")


def test_nothing_left_after_an_exception(aws_lab: AwsLab) -> None:
    with (
        pytest.raises(ValueError, match="boom"),
        sky.Compute(provider=aws_lab.provider(), nodes=2) as pool,
    ):
        pool_id = pool.pool_id
        fail() >> pool
    _gone(aws_lab, pool_id)


_CLIENT = """
import sys, time
sys.path.insert(0, {tests!r})
import flotilla as sky
from _aws import AwsLab
lab = AwsLab.__new__(AwsLab)
provider = {provider}
options = sky.Options(heartbeat_timeout=2, start_timeout={start_timeout!r})
with sky.Compute(provider=provider, nodes=2, options=options) as pool:
    print(pool.pool_id, time.time(), flush=True)
    time.sleep(600)
"""


def _client(aws_lab: AwsLab, start_timeout: float = 120.0, **kwargs: Any) -> subprocess.Popen[str]:
    options = {
        "region": REGION,
        "ssh_user": "root",
        "private_ips": True,
        "workdir": str(aws_lab.lab.tmp / "workdir"),
        "poweroff_command": aws_lab.provider().settings.poweroff_command,
        **kwargs,
    }
    provider = f"sky.AWS(**{options!r})"
    code = _CLIENT.format(
        tests=os.path.dirname(__file__), provider=provider, start_timeout=start_timeout
    )
    return start_client(code, preexec_fn=interruptible)  # a test sends it Ctrl-C (SIGINT)


def _pool_id(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, f"the client did not start its pool: {proc.stderr.read() if proc.stderr else ''}"
    return line.split()[0]


def test_nothing_left_after_ctrl_c(aws_lab: AwsLab) -> None:
    proc = _client(aws_lab)
    pool_id = _pool_id(proc)
    assert {i["State"]["Name"] for i in aws_lab.pool_instances(pool_id)} <= {"pending", "running"}
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "interrupted (Ctrl-C); the pool was closed" in err and "Traceback" not in err
    _gone(aws_lab, pool_id)


def test_kill9_watchdog_and_orphan_cleanup(aws_lab: AwsLab) -> None:
    """A killed client leaves its pool; each instance's watchdog powers off ttl s after
    the last contact from the client (not before), and remove_orphans() removes the rest."""
    ttl = 3.0
    proc = _client(aws_lab, ttl=ttl)
    pool_id = _pool_id(proc)
    instances = aws_lab.pool_instances(pool_id)
    addrs = [i["PrivateIpAddress"] for i in instances]
    # the client is alive and in contact for longer than ttl: no instance powers off
    time.sleep(ttl + 1)
    assert [a for a in addrs if aws_lab.poweroffs(a)] == []
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    workdir = aws_lab.lab.tmp / "workdir" / "watchdog"
    deadline = time.monotonic() + 60
    while not all(aws_lab.poweroffs(a) for a in addrs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for inst, addr in zip(instances, addrs, strict=True):
        fired = aws_lab.poweroffs(addr)
        assert len(fired) == 1, f"{addr}: the watchdog fired {fired}"
        last_contact = (workdir / inst["InstanceId"]).stat().st_mtime
        assert fired[0] >= last_contact + ttl
    # the client is gone: its pool is an orphan, swept by the next pool's start (its
    # instances told to terminate, its key folder removed); a live pool is left alone
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-aws-{pool_id}-*"))
    with sky.Compute(provider=aws_lab.provider(), nodes=1) as live:
        assert glob.glob(os.path.join(tempfile.gettempdir(), f"flotilla-aws-{pool_id}-*")) == []
        states = {i["State"]["Name"] for i in aws_lab.pool_instances(pool_id)}
        assert states <= {"shutting-down", "terminated"}, states
        orphans = aws_lab.provider().remove_orphans()  # the rest (a group still held)
        assert live.pool_id not in orphans.pools
        assert {i["State"]["Name"] for i in aws_lab.pool_instances(live.pool_id)} == {"running"}
    _gone(aws_lab, pool_id)


def test_the_orphan_sweep_removes_only_the_key_folders_of_its_own_place(aws_lab: AwsLab) -> None:
    """A dead client's key folder is removed by the sweep of the API its pool used, never by
    that of another region, account or endpoint (a user's second region; in CI, another
    lab): each key folder records its pool's place."""
    provider = aws_lab.provider()
    ended = subprocess.Popen(["true"])
    ended.wait()
    dead = f"{socket.gethostname()}:{ended.pid}:0"  # a client gone (no such start)
    folders = {}
    for name, place in (("here", provider.api.place), ("there", "eu-west-3 http://127.0.0.1:9")):
        folder = tempfile.mkdtemp(prefix=f"flotilla-aws-o{os.urandom(3).hex()}-")
        for file, text in (("client", dead), ("place", place)):
            Path(folder, file).write_text(text)
        folders[name] = folder
    try:
        orphans = provider.remove_orphans()
        assert folders["here"] in orphans.folders
        assert not os.path.exists(folders["here"])
        assert folders["there"] not in orphans.folders
        assert os.path.isdir(folders["there"])
    finally:
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)


def _wait_for(what: str, check: Any, timeout: float = 60.0) -> None:
    """Poll ``check()`` until it is true; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.1)


def test_boot_guard_powers_off_instances_no_agent_reaches(aws_lab: AwsLab) -> None:
    """Instances launched whose agent never starts (the client launched them and went no
    further, as a client killed right after RunInstances): each one's boot guard runs the
    power-off command once, ttl s after the boot, and the watchdog never ran."""
    ttl = 3.0
    spec = PoolSpec("t" + os.urandom(3).hex(), 2, None, None, (), Options(start_timeout=1))
    allocation = _acquire(aws_lab.provider(ttl=ttl), spec)
    try:
        idents = [m.ident for m in allocation.machines]
        addrs = [m.address for m in allocation.machines]
        _wait_for(
            "every guard powered off", lambda: all(aws_lab.poweroffs(a, "guard") for a in addrs)
        )
        for ident, addr in zip(idents, addrs, strict=True):
            inst = aws_lab.instances[ident]
            assert inst.bootcmd_at > 0, f"{ident}: cloud-init's bootcmd did not run"
            (fired,) = aws_lab.poweroffs(addr)  # once, and by the guard
            assert aws_lab.poweroffs(addr, "guard") == [fired]
            assert fired >= inst.bootcmd_at + ttl  # it waited ttl after the boot
            console = aws_lab.console(ident)
            assert "no agent started within 3 s of the boot" in console, console
            assert ident in console  # the contact file it looked for is the instance's
    finally:
        _release(allocation)
    _gone(aws_lab, spec.pool_id)


def test_boot_guard_ends_the_instances_of_a_client_killed_after_launch(aws_lab: AwsLab) -> None:
    """kill -9 of the client right after RunInstances, before its agents start (the
    instances' sshd is not up yet): nothing releases the instances and no agent, so no
    watchdog, ever starts there; each instance's boot guard powers it off, and
    remove_orphans() removes the rest."""
    boot_delay, aws_lab.boot_delay = aws_lab.boot_delay, 3600.0  # sshd stays down: no agent
    try:
        proc = _client(aws_lab, start_timeout=5.0, ttl=3.0)
        mine: list[dict[str, Any]] = []

        def launched() -> bool:
            mine[:] = [
                i
                for i in aws_lab.describe()
                for t in i.get("Tags", [])
                if t["Key"] == "flotilla:client" and t["Value"].split(":")[1] == str(proc.pid)
            ]
            return len(mine) == 2 or proc.poll() is not None

        _wait_for("the client launched its instances", launched)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert len(mine) == 2, proc.stderr.read() if proc.stderr else ""
        addrs = [i["PrivateIpAddress"] for i in mine]
        _wait_for(
            "every guard powered off", lambda: all(aws_lab.poweroffs(a, "guard") for a in addrs)
        )
        assert [aws_lab.poweroffs(a, "watchdog") for a in addrs] == [[], []]
        (pool_id,) = {t["Value"] for t in mine[0]["Tags"] if t["Key"] == "flotilla:pool"}
        orphans = aws_lab.provider().remove_orphans()
        assert pool_id in orphans.pools
    finally:
        aws_lab.boot_delay = boot_delay
    _gone(aws_lab, pool_id)


_FORKER = "while :; do sleep 600 & k=$!; kill $o 2>/dev/null; o=$k; done"
"""Forks all the time (a ``sleep 600`` at a time alive): a boot guard's shell forking its
``sleep`` at the moment its host is stopped, made likely at every stop."""


def test_a_stopped_host_leaves_no_process_forked_while_it_was_stopped(
    aws_lab: AwsLab, tmp_path: Path
) -> None:
    """What runs in an instance (its boot guard: a ``setsid`` shell that forks its ``sleep``)
    ends with its host, also a child forked while the lab was killing the host's processes
    (which a single pass of kills missed: the guard's ``sleep 600`` outlived the tests).
    A process forking all the time stands in for the guard's shell; the kill that stops
    and terminates the lab's instances is tried a few times (each time a fork may or may
    not fall in the moment it lists the host's processes), then the instance terminated."""
    public = keygen(tmp_path / "host_key", "test")  # the instance's (the lab wants one)
    private = (tmp_path / "host_key").read_text()
    config = {"ssh_keys": {"ed25519_private": private, "ed25519_public": public}}
    (desc,) = aws_lab.client().run_instances(
        ImageId=aws_lab.ami,
        MinCount=1,
        MaxCount=1,
        InstanceType="t3.micro",
        SubnetId=aws_lab.subnets[ZONES[0]],
        UserData="#cloud-config\n" + yaml.safe_dump(config),
        # tagged, as every instance of the lab (tests look at all instances' tags)
        TagSpecifications=[
            {"ResourceType": "instance", "Tags": [{"Key": "test", "Value": "forker"}]}
        ],
    )["Instances"]
    ident = desc["InstanceId"]
    try:
        host = aws_lab.wait_booted(ident).host
        assert host is not None
        for _ in range(15):
            forker = subprocess.Popen(
                [*_in_netns(host.netns), "setsid", "sh", "-c", _FORKER],
                env={"PATH": os.environ["PATH"], "INSTANCE_ID": ident},
                stdin=subprocess.DEVNULL,
            )
            _wait_for("the forker forks", lambda: len(aws_lab.leftovers([ident])) > 1)
            aws_lab.lab.kill_all(host)
            forker.wait()
            assert aws_lab.leftovers([ident]) == {}
    finally:
        aws_lab.client().terminate_instances(InstanceIds=[ident])
    assert aws_lab.wait_ended(ident)
    assert aws_lab.leftovers([ident]) == {}


def test_a_start_that_pauses_past_the_ttl_keeps_its_instances(
    aws_lab: AwsLab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client keeps its instances alive during the whole start, not only once the pool
    is up: node 0's agent (and its watchdog) runs while node 1's start pauses longer than
    the ttl (a busy machine, a slow instance), and node 0's watchdog never powers it off;
    the pool starts whole."""
    ttl = 3.0
    started: set[int] = set()
    original = AWSAllocation.start_agent

    async def start_agent(self: AWSAllocation, machine: Machine) -> AgentProcess:
        if machine.rank == 1:  # node 0's agent runs and waits for this one, a long time
            while 0 not in started:
                await asyncio.sleep(0.05)
            await asyncio.sleep(ttl + 3)  # the pause the test is about, not a wait
        agent = await original(self, machine)
        started.add(machine.rank)
        return agent

    monkeypatch.setattr(AWSAllocation, "start_agent", start_agent)
    options = sky.Options(heartbeat_timeout=2, start_timeout=60)
    with sky.Compute(provider=aws_lab.provider(ttl=ttl), nodes=2, options=options) as pool:
        addrs = [m.address for m in pool._allocation.machines]
        assert [a["addr"] for a in where() @ pool] == addrs
        assert [aws_lab.poweroffs(a) for a in addrs] == [[], []]  # no watchdog fired
        pool_id = pool.pool_id
    _gone(aws_lab, pool_id)


def test_boot_guard_leaves_a_live_pool_to_its_watchdog(aws_lab: AwsLab) -> None:
    """A pool whose agent started: its boot guard, max(ttl, start_timeout) s after the
    boot, sees the watchdog's contact file and exits; nothing powered off while the client
    is alive and the pool still answers."""
    provider = aws_lab.provider(ttl=3)
    options = sky.Options(heartbeat_timeout=2, start_timeout=8)
    with sky.Compute(provider=provider, nodes=1, options=options) as pool:
        allocation = pool._allocation
        assert isinstance(allocation, AWSAllocation)
        (machine,) = allocation.machines

        def console() -> str:
            return aws_lab.console(machine.ident)

        _wait_for("the guard decided", lambda: "agent started" in console())
        assert "flotilla boot guard: an agent started" in console(), console()
        assert "watchdog is in charge" in console()
        assert aws_lab.poweroffs(machine.address) == []  # neither the guard nor the watchdog
        assert [a["addr"] for a in where() @ pool] == [machine.address]
        pool_id = pool.pool_id
    _gone(aws_lab, pool_id)


def test_another_host_key_is_refused(aws_lab: AwsLab) -> None:
    aws_lab.impostor = True
    try:
        with (
            pytest.raises(sky.ProvisionError, match="REFUSED") as err,
            sky.Compute(provider=aws_lab.provider(), nodes=1),
        ):
            pass
    finally:
        aws_lab.impostor = False
    assert "host key" in str(err.value)
    assert err.value.cause is sky.ProvisionCause.IDENTITY
    (pool_id,) = {
        t["Value"]
        for i in aws_lab.describe()
        for t in i["Tags"]
        if t["Key"] == "flotilla:pool" and i["InstanceId"] in str(err.value)
    }
    _gone(aws_lab, pool_id)


def test_spot_capacity_falls_back_to_the_next_zone(aws_lab: AwsLab) -> None:
    aws_lab.fail_launches("InsufficientInstanceCapacity", market="spot", zone=ZONES[0])
    spec = _spec(3)
    try:
        allocation = _acquire(aws_lab.provider(allocation="spot"), spec)
    finally:
        aws_lab.clear_faults()
    try:
        assert (allocation.market, allocation.zone) == ("spot", ZONES[1])
        launched = aws_lab.pool_instances(spec.pool_id)
        assert len(launched) == 3
        assert {i["Placement"]["AvailabilityZone"] for i in launched} == {ZONES[1]}
    finally:
        _release(allocation)
    _gone(aws_lab, spec.pool_id)


def test_spot_if_available_falls_back_to_on_demand(aws_lab: AwsLab) -> None:
    aws_lab.fail_launches("InsufficientInstanceCapacity", market="spot")
    spec = _spec(2)
    try:
        allocation = _acquire(aws_lab.provider(allocation="spot-if-available"), spec)
    finally:
        aws_lab.clear_faults()
    try:
        assert allocation.market == "on-demand"
        launched = aws_lab.pool_instances(spec.pool_id)
        assert len(launched) == 2 and all("InstanceLifecycle" not in i for i in launched)
    finally:
        _release(allocation)
    _gone(aws_lab, spec.pool_id)


def test_spot_without_capacity_fails_and_leaves_nothing(aws_lab: AwsLab) -> None:
    aws_lab.fail_launches("InsufficientInstanceCapacity", market="spot")
    spec = _spec(2)
    try:
        with pytest.raises(sky.ProvisionError, match="no capacity") as err:
            _acquire(aws_lab.provider(allocation="spot"), spec)
    finally:
        aws_lab.clear_faults()
    assert "spot-if-available" in str(err.value) and ZONES[1] in str(err.value)
    assert aws_lab.pool_instances(spec.pool_id) == []
    assert aws_lab.pool_groups(spec.pool_id) == []


def test_quota_error(aws_lab: AwsLab) -> None:
    aws_lab.fail_launches("VcpuLimitExceeded", market="on-demand")
    spec = _spec(2)
    try:
        with pytest.raises(sky.ProvisionError, match="quota") as err:
            _acquire(aws_lab.provider(allocation="on-demand"), spec)
    finally:
        aws_lab.clear_faults()
    assert "VcpuLimitExceeded" in str(err.value) and "Service Quotas" in str(err.value)
    assert aws_lab.pool_groups(spec.pool_id) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"region": "us-east-9"}, "region 'us-east-9' does not exist"),
        ({"ami": "ami-00000000"}, "AMI"),
        ({"instance_type": "z9.huge"}, "no such instance type"),
        ({"ttl": 10}, "must exceed Options"),
    ],
)
def test_bad_input_before_launch(aws_lab: AwsLab, kwargs: dict[str, Any], message: str) -> None:
    before = {i["InstanceId"] for i in aws_lab.describe()}
    with (
        pytest.raises(sky.ConfigurationError, match=message),
        sky.Compute(provider=aws_lab.provider(**kwargs), nodes=1),
    ):
        pass
    assert {i["InstanceId"] for i in aws_lab.describe()} == before


def test_accelerator_no_type_offers(aws_lab: AwsLab) -> None:
    before = {i["InstanceId"] for i in aws_lab.describe()}
    with (
        pytest.raises(sky.ConfigurationError, match="accelerator H100:16") as err,
        sky.Compute(provider=aws_lab.provider(), nodes=1, accelerator="H100:16"),
    ):
        pass
    assert "instance_type" in str(err.value)
    assert {i["InstanceId"] for i in aws_lab.describe()} == before


def test_no_credentials(aws_lab: AwsLab, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    with (
        pytest.raises(sky.ConfigurationError, match="no AWS credentials") as err,
        sky.Compute(provider=aws_lab.provider(), nodes=1),
    ):
        pass
    assert "aws configure" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allocation": "cheap"}, "allocation"),
        ({"ttl": 0}, "ttl"),
        ({"tags": {"aws:x": "y"}}, "tag key"),
        ({"subnet": "sn-1"}, "subnet"),
        ({"disk_gb": 2}, "disk_gb"),
        ({"instance_type": "large"}, "instance_type"),
        ({"ports": ["80-70"]}, "ports"),
        ({"ports": [0]}, "ports"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(sky.ConfigurationError, match=message):
        sky.AWS(**kwargs)


def test_interruption_notice_leads_to_a_replacement(aws_lab: AwsLab) -> None:
    """An interruption notice in one instance's metadata: the pool replaces that node with a
    new instance (same group and tags, its own address), the old one is terminated, and the
    next broadcast answers on 3 nodes with the same ranks."""
    with sky.Compute(provider=aws_lab.provider(allocation="spot"), nodes=3) as pool:
        allocation = pool._allocation
        assert isinstance(allocation, AWSAllocation)
        old = allocation.machines[1]
        aws_lab.interrupt(old.ident)
        deadline = time.monotonic() + 90
        while allocation.machines[1].ident == old.ident and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the provider's record: the replacement is under way
        new = allocation.machines[1]
        assert new.ident != old.ident and new.address != old.address
        answers = where() @ pool
        assert [a["node"] for a in answers] == [0, 1, 2]
        assert answers[1]["addr"] == new.address
        states = {i["InstanceId"]: i for i in aws_lab.pool_instances(pool.pool_id)}
        assert states[old.ident]["State"]["Name"] in ("shutting-down", "terminated")
        fresh = states[new.ident]
        assert fresh["InstanceLifecycle"] == "spot"
        assert fresh["NetworkInterfaces"][0]["Groups"][0]["GroupId"] == allocation.security_group
        pool_id = pool.pool_id
    _gone(aws_lab, pool_id)


def test_an_instance_terminated_without_notice_is_replaced(aws_lab: AwsLab) -> None:
    """EC2 reclaims an instance with no notice (terminated in the API: the lab stops its
    host, the SSH connection drops): the pool notices the lost node, launches a new
    instance for that rank, and the next broadcast answers on 3 nodes."""
    with sky.Compute(provider=aws_lab.provider(allocation="spot"), nodes=3) as pool:
        allocation = pool._allocation
        assert isinstance(allocation, AWSAllocation)
        old = allocation.machines[2]
        aws_lab.client().terminate_instances(InstanceIds=[old.ident])
        deadline = time.monotonic() + 90
        while allocation.machines[2].ident == old.ident and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the provider's record: the replacement is under way
        new = allocation.machines[2]
        assert new.ident != old.ident  # (EC2 may hand the freed private address out again)
        answers = where() @ pool
        assert [a["node"] for a in answers] == [0, 1, 2]
        assert answers[2]["addr"] == new.address
        assert answers[2]["peers"][2] == new.address
        states = {i["InstanceId"]: i["State"]["Name"] for i in aws_lab.pool_instances(pool.pool_id)}
        assert states[old.ident] == "terminated" and states[new.ident] == "running"
        pool_id = pool.pool_id
    _gone(aws_lab, pool_id)


def test_import_flotilla_does_not_import_boto3() -> None:
    code = "import sys, flotilla; flotilla.AWS; print('boto3' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_waiting_for_a_booting_instance_holds_a_few_sockets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the instance's network is not up, connection attempts hang until their own
    timeout: at most CONNECTS_AT_ONCE of them (sockets) are in flight per instance, a new
    one starts as an old one ends, and port 22 opening is noticed. The attempts here hang
    until the test ends them (or wait_port's deadline cancels them): no clock decides."""
    from flotilla._providers.cloud import boot

    cap = boot.CONNECTS_AT_ONCE
    hanging: list[asyncio.Future[bool]] = []
    started, most, port_open = 0, 0, False
    changed = asyncio.Event()

    def in_flight() -> int:
        return sum(not f.done() for f in hanging)

    async def attempt(addr: str, port: int, timeout: float) -> bool:
        nonlocal started, most
        started += 1
        changed.set()
        if port_open:
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        hanging.append(fut)
        most = max(most, in_flight())
        try:
            return await fut  # no answer (no ARP) until the test says it timed out
        finally:
            changed.set()

    async def until(what: str, condition: Callable[[], bool]) -> None:
        try:
            async with asyncio.timeout(30):  # a deadline: a regression fails, not hangs
                while not condition():
                    changed.clear()
                    await changed.wait()
        except TimeoutError:
            pytest.fail(f"wait_port did not start {what}: {started} started, {in_flight()} hang")

    async def booting() -> None:
        nonlocal port_open
        waiting = asyncio.create_task(
            boot.wait_port("10.0.0.9", 22, time.monotonic() + 60, "i-1", 60)
        )
        await until("the first attempts", lambda: in_flight() == cap)
        await asyncio.sleep(0.3)  # six of its 50 ms paces: none may start beyond the cap
        assert (started, in_flight()) == (cap, cap)
        hanging[0].set_result(False)  # one times out: another takes its place
        await until("a new attempt", lambda: started == cap + 1)
        assert in_flight() == cap
        port_open = True  # sshd listens: the next attempt connects
        hanging[1].set_result(False)
        async with asyncio.timeout(30):
            await waiting
        assert started == cap + 2
        assert all(f.cancelled() for f in hanging[2:])  # the ones left were given up

    monkeypatch.setattr(boot, "_connects", attempt)
    asyncio.run(booting())
    assert most == cap, most
    hanging.clear()
    port_open = False  # never opens: the deadline ends the wait
    with pytest.raises(sky.ProvisionError, match="did not answer"):
        asyncio.run(boot.wait_port("10.0.0.9", 22, time.monotonic() + 0.5, "i-1", 0.5))
    assert most == cap, most
    assert hanging and all(f.cancelled() for f in hanging)  # none left behind


# -- the node side, without the lab (no root needed) ----------------------------------------
def _node_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(sky.__file__))}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )


def test_watchdog_fires_ttl_after_the_last_contact(tmp_path: Any) -> None:
    """Contact renewed after start postpones the power-off; it runs once, ttl s after the
    last contact."""
    contact, fired = tmp_path / "contact", tmp_path / "fired"
    code = f"""
import os, threading, time
from flotilla._node.cloud import Config, watchdog
open({str(contact)!r}, "a").close()
def renew():  # the agent's contact, 0.5 s after start
    time.sleep(0.5)
    os.utime({str(contact)!r})
threading.Thread(target=renew).start()
watchdog(Config({str(contact)!r}, 1.0, ("sh", "-c", "date +%s.%N >> {fired}")))
"""
    started = time.time()
    proc = _node_python(code)
    assert proc.returncode == 0, proc.stderr
    times = [float(t) for t in fired.read_text().split()]
    assert len(times) == 1
    last_contact = contact.stat().st_mtime
    assert last_contact >= started + 0.4  # the renewal counted ...
    assert times[0] >= last_contact + 1.0  # ... and the power-off waited ttl after it


def test_watchdog_runs_a_failed_power_off_again(tmp_path: Any) -> None:
    """A power-off command that fails (the API throttled) is run again until it succeeds:
    the instance still runs, and costs."""
    contact, tries = tmp_path / "contact", tmp_path / "tries"
    command = ("sh", "-c", f'echo x >> {tries}; [ "$(wc -l < {tries})" -ge 3 ]')
    code = f"""
from flotilla._node.cloud import Config, watchdog
open({str(contact)!r}, "a").close()
watchdog(Config({str(contact)!r}, 0.1, {command!r}, retry=0.05))
"""
    proc = _node_python(code)
    assert proc.returncode == 0, proc.stderr
    assert tries.read_text().count("x") == 3
    log = contact.with_name("contact.log").read_text()
    assert log.count("the power-off command failed (exit status 1)") == 2


def test_watchdog_counts_a_removed_contact_file_as_no_contact(tmp_path: Any) -> None:
    """The contact file removed under a running watchdog (a cleanup, a stale-file removal
    running late) and no contact after: the watchdog still powers off, ttl s after the
    last contact it saw, instead of reading "no file" as "a contact now" forever."""
    contact, fired = tmp_path / "watchdog" / "i-1", tmp_path / "fired"
    code = f"""
import os, threading, time
from flotilla._node.cloud import Config, watchdog
path = {str(contact)!r}
os.makedirs(os.path.dirname(path))
open(path, "a").close()  # the agent's start
def remove():  # once the watchdog is in charge (its lock file is there)
    while not os.path.exists(path + ".lock"):
        time.sleep(0.01)
    os.unlink(path)
threading.Thread(target=remove).start()
watchdog(Config(path, 1.0, ("sh", "-c", "date +%s.%N >> {fired}")))
"""
    proc = _node_python(code)  # it hung until the timeout: it never powered off
    assert proc.returncode == 0, proc.stderr
    assert len(fired.read_text().split()) == 1
    assert not contact.exists()


def test_watchdog_makes_its_removed_lock_file_again(tmp_path: Any) -> None:
    """The watchdog folder removed under a running watchdog: it makes its lock file again
    (the boot guard powers off an instance whose lock file is missing at the end of its
    wait, taking it for one whose agent never started) and still powers off, once."""
    contact, fired = tmp_path / "watchdog" / "i-1", tmp_path / "fired"
    code = f"""
import os, shutil, threading, time
from flotilla._node.cloud import Config, watchdog
path = {str(contact)!r}
os.makedirs(os.path.dirname(path))
open(path, "a").close()  # the agent's start
back = []
def remove():  # once the watchdog is in charge: the whole folder
    while not os.path.exists(path + ".lock"):
        time.sleep(0.01)
    shutil.rmtree(os.path.dirname(path))
    deadline = time.monotonic() + 30
    while not os.path.exists(path + ".lock") and time.monotonic() < deadline:
        time.sleep(0.01)
    back.append(os.path.exists(path + ".lock"))
thread = threading.Thread(target=remove)
thread.start()
watchdog(Config(path, 2.0, ("sh", "-c", "date +%s.%N >> {fired}")))
thread.join()
assert back == [True], "the lock file was not made again"
"""
    proc = _node_python(code)
    assert proc.returncode == 0, proc.stderr
    assert len(fired.read_text().split()) == 1


def test_a_removed_contact_file_is_made_again_by_the_agents_next_contact(tmp_path: Any) -> None:
    """The agent's side makes a removed contact file (and its folder) again: a contact
    gives it the time now, a hold the deadline it sets, which the watchdog then keeps (a
    hold for 0 s with a ttl of 600 s: the power-off at once, not 600 s later)."""
    contact, fired = tmp_path / "watchdog" / "i-1", tmp_path / "fired"
    code = f"""
import os, shutil, time
from flotilla._node.cloud import Config, Contact, watchdog
path = {str(contact)!r}
os.makedirs(os.path.dirname(path))
open(path, "a").close()
shutil.rmtree(os.path.dirname(path))
before = time.time()
Contact(path, 0.0, ttl=600.0).touch(time.monotonic())  # a frame from the client
assert os.path.exists(path), "the contact did not make the file again"
assert os.stat(path).st_mtime >= before - 1
os.unlink(path)
Contact(path, 5.0, ttl=600.0).hold(0.0)  # nobody re-attached: the instance ends now
assert os.path.exists(path), "the hold did not make the file again"
assert os.stat(path).st_mtime <= time.time() - 599
watchdog(Config(path, 600.0, ("sh", "-c", "date +%s.%N >> {fired}")))
"""
    proc = _node_python(code)
    assert proc.returncode == 0, proc.stderr
    assert len(fired.read_text().split()) == 1


def test_watchdog_is_in_charge_before_the_agent_goes_on(tmp_path: Any) -> None:
    """cloud.start() returns once the watchdog holds its lock: an agent killed right after
    (a client killed at once) leaves an instance that still powers off ttl s later."""
    contact, fifo = tmp_path / "watchdog" / "i-1", tmp_path / "fired"
    os.mkfifo(fifo)
    config = {"contact": str(contact), "ttl": 0.5, "poweroff": ["sh", "-c", f"echo on > {fifo}"]}
    code = f"""
import json, os
os.environ["FLOTILLA_CLOUD"] = json.dumps({config!r})
from flotilla._node.cloud import start
start()
print(os.path.exists({str(contact) + ".lock"!r}), flush=True)
os._exit(0)  # the agent dies at once
"""
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        proc = _node_python(code)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "True"
        assert "did not start" not in proc.stderr
        ready, _, _ = select.select([reader], [], [], 60)
        assert ready and os.read(reader, 16) == b"on\n"
    finally:
        os.close(reader)


def test_the_cloud_helper_is_a_fork_of_the_agent(tmp_path: Any) -> None:
    """The watchdog and the poller cost an instance's start no interpreter of their own
    (issue 42 item 1: ``python -m flotilla._node.cloud`` cost about what the agent did): the
    helper is a fork of the agent, and the agent imports no HTTP client, ``subprocess`` or
    ``dataclasses`` for it, nor ``typing``, nor ``signal`` (its handlers are ``_signal``'s)."""
    contact = str(tmp_path / "contact")
    config = {"contact": contact, "ttl": 30, "poweroff": ["true"]}
    code = f"""
import json, os, sys
os.environ["FLOTILLA_CLOUD"] = json.dumps({config!r})
from flotilla._node.cloud import start
start()
me = os.getpid()
with open(f"/proc/{{me}}/task/{{me}}/children") as f:
    kids = [int(p) for p in f.read().split()]
lines = []
for pid in kids:
    with open(f"/proc/{{pid}}/cmdline", "rb") as f:
        lines.append(f.read().decode())
print(json.dumps({{"kids": lines, "me": open("/proc/self/cmdline", "rb").read().decode(),
    "imported": [m for m in ("subprocess", "urllib.request", "http.client", "dataclasses",
        "typing", "signal") if m in sys.modules]}}))
os._exit(0)
"""
    proc = _node_python(code)
    try:
        assert proc.returncode == 0, proc.stderr
        seen = json.loads(proc.stdout)
        assert seen["kids"] == [seen["me"]], seen  # the poller: the agent's own command line
        assert seen["imported"] == [], seen
    finally:  # the watchdog (ttl 30 s): it names this test's contact file
        kill_quietly(_naming(contact))


def _naming(text: str) -> list[int]:
    """The processes whose command line or environment holds ``text``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for part in ("environ", "cmdline"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/{part}", "rb") as f:
                if text.encode() in f.read():
                    out.append(int(pid))
                    break
    return out


def test_the_helper_ends_when_its_agent_died_before_it_started(tmp_path: Any) -> None:
    """An agent that dies right after cloud.start() (before the helper it started got to
    watch it): the helper ends too, instead of waiting forever under another parent with
    the agent's stderr (the test above then hung until its timeout)."""
    contact = str(tmp_path / "contact")
    config = {"contact": contact, "ttl": 0}  # no watchdog: only the helper
    code = f"""
import json, os
os.environ["FLOTILLA_CLOUD"] = json.dumps({config!r})
from flotilla._node.cloud import start
start()
os._exit(0)  # the agent dies at once, before the helper is up
"""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(sky.__file__))}
    agent = subprocess.run([sys.executable, "-c", code], env=env, stderr=subprocess.DEVNULL)
    assert agent.returncode == 0  # (the helper keeps the agent's stderr: not a pipe here)

    def helpers() -> list[int]:  # (a fork of the agent: its command line names the contact)
        return _naming(contact)

    try:
        assert wait_until(lambda: helpers() == [], 30), (
            f"the helper outlived its agent: {helpers()}"
        )
    finally:
        kill_quietly(helpers())


class _Metadata(http.server.BaseHTTPRequestHandler):
    """A metadata service's handler in a test (the poller's tests below): answers of bytes
    (``_send``), nothing logged."""

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_poller_ends_with_its_agent_without_ctypes(tmp_path: Any) -> None:
    """The helper polling the metadata service ends when its agent is killed, and its
    start imported no ``ctypes`` (issue 42 item 1: ~3-5 ms of an instance start's CPU for
    ``PR_SET_PDEATHSIG``): it watches the agent's pidfd between two requests."""
    import threading

    asked = threading.Event()

    class Handler(_Metadata):
        def do_PUT(self) -> None:
            self._send(200, b"tok")

        def do_GET(self) -> None:  # no interruption notice: the helper polls on
            asked.set()
            self._send(404, b"")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    contact = str(tmp_path / "contact")
    config = {"contact": contact, "ttl": 0, "imds": f"http://127.0.0.1:{server.server_port}"}
    code = f"""
import json, os, sys
os.environ["FLOTILLA_CLOUD"] = json.dumps({config!r})
from flotilla._node.cloud import start
start()
me = os.getpid()
with open(f"/proc/{{me}}/task/{{me}}/children") as f:
    print(f.read().split()[0], flush=True)
sys.stdin.read()
"""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(sky.__file__))}
    agent = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    helper = 0
    try:
        assert agent.stdout is not None
        helper = int(agent.stdout.readline())
        assert asked.wait(60), "the helper never asked the metadata service"
        with open(f"/proc/{helper}/maps") as f:  # it polls: its start is behind it
            assert "_ctypes" not in f.read()
        agent.kill()
        agent.wait(60)

        def gone() -> bool:
            try:
                with open(f"/proc/{helper}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except FileNotFoundError:
                return True

        assert wait_until(gone, 60), "the helper outlived its agent"
    finally:
        server.shutdown()
        if agent.poll() is None:
            agent.kill()
            agent.wait(60)
        kill_quietly(_naming(contact))


def test_interruption_poller_announces_the_notice(tmp_path: Any) -> None:
    import threading

    token = "tok123"
    seen: list[str] = []

    class Handler(_Metadata):
        def do_PUT(self) -> None:
            seen.append(
                f"PUT {self.path} {self.headers.get('X-aws-ec2-metadata-token-ttl-seconds')}"
            )
            self._send(200, token.encode())

        def do_GET(self) -> None:
            ok = self.headers.get("X-aws-ec2-metadata-token") == token
            seen.append(f"GET {self.path} {ok}")
            if not ok:
                return self._send(401, b"")
            self._send(200, b'{"action": "stop", "time": "2026-11-23T19:00:00Z"}')

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        code = f"""
import sys
from flotilla._node.cloud import Config, poll_interruptions
poll_interruptions(Config("/nonexistent", 0, (), imds={url!r}, poll=0.1))
print([m for m in ("http.client", "urllib.request") if m in sys.modules])
"""
        proc = _node_python(code)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("FLOTILLA_CLOUD NOTICE ")
    assert '"action": "stop"' in proc.stderr
    assert proc.stdout.strip() == "[]"  # no HTTP client to import (~27 ms a spot start paid)
    assert seen[:2] == [
        "PUT /latest/api/token 21600",
        "GET /latest/meta-data/spot/instance-action True",
    ]


def test_interruption_poller_takes_only_whole_answers() -> None:
    """The metadata poller's bare-socket HTTP: an answer cut short (the connection closed
    before its ``Content-Length`` bytes came) is no notice, the poller asks again; a whole
    answer is taken without waiting for the server to close the connection (one that keeps
    it open: a wait for its end would time out, every time), and a chunked one is decoded.
    The notice announced is the whole one."""
    import threading

    notice = b'{"action": "stop", "time": "2026-11-23T19:00:00Z"}'
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(notice)
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(
        b"%x\r\n%s\r\n" % (len(part), part) for part in (notice[:9], notice[9:])
    )
    answers = [  # GETs of spot/instance-action, in turn: (bytes, keep the connection open)
        (head + notice[:20], False),  # cut short
        (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", True),  # no notice yet
        (chunked + b"0\r\n\r\n", True),
    ]
    seen: list[bytes] = []
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                with conn:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        request += conn.recv(4096) or b"\r\n\r\n"
                    line = request.split(b"\r\n", 1)[0]
                    seen.append(line)
                    if line.startswith(b"PUT "):
                        answer, keep = b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\ntok", False
                    elif answers:
                        answer, keep = answers.pop(0)
                    else:
                        answer, keep = b"HTTP/1.0 404 Not Found\r\n\r\n", False
                    conn.sendall(answer)
                    while keep and conn.recv(4096):  # until the client closes it
                        pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        code = f"""
from flotilla._node.cloud import Config, poll_interruptions
poll_interruptions(Config("/nonexistent", 0, (), imds={url!r}, poll=0.01))
"""
        proc = _node_python(code)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("FLOTILLA_CLOUD NOTICE "), proc.stderr
    assert json.loads(lines[0].removeprefix("FLOTILLA_CLOUD NOTICE ")) == json.loads(notice)
    gets = [line for line in seen if line.startswith(b"GET ")]
    assert len(gets) == 3, seen  # the cut one, "not yet" and the chunked one: none waited


def _guard(tmp_path: Any, ttl: float) -> subprocess.Popen[str]:
    """The boot guard's bootcmd line run by ``sh`` as cloud-init would (INSTANCE_ID set),
    with a power-off command that records that it ran."""
    from flotilla._providers.cloud.guard import guard_command

    record = f"echo $FLOTILLA_BOOT_GUARD >> {tmp_path}/fired"
    line = guard_command(ttl, 1, str(tmp_path / "work"), "root", ["sh", "-c", record])
    return subprocess.Popen(
        ["sh", "-c", line],
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": os.environ["PATH"], "INSTANCE_ID": "i-0123"},
    )


def test_boot_guard_script_powers_off_without_contact(tmp_path: Any) -> None:
    """No watchdog lock file, or only one left from an earlier boot (removed at boot,
    with its contact file): the guard runs the power-off command (FLOTILLA_BOOT_GUARD=1
    set), once."""
    contact = tmp_path / "work" / "watchdog" / "i-0123"
    lock = contact.with_name("i-0123.lock")
    contact.parent.mkdir(parents=True)
    contact.write_text("")  # the last boot's
    lock.write_text("")
    proc = _guard(tmp_path, 1)
    out, _ = proc.communicate(timeout=60)  # stdout ends when the detached guard does
    assert (tmp_path / "fired").read_text() == "1\n"
    assert "no agent started within 1 s of the boot" in out
    assert not contact.exists() and not lock.exists()


def test_boot_guard_script_exits_once_a_watchdog_started(tmp_path: Any) -> None:
    lock = tmp_path / "work" / "watchdog" / "i-0123.lock"
    proc = _guard(tmp_path, 1)
    assert proc.stdout is not None
    assert "powering off in 1 s unless an agent starts" in proc.stdout.readline()
    lock.parent.mkdir(parents=True)
    lock.write_text("")  # the watchdog's start
    out, _ = proc.communicate(timeout=60)
    assert "an agent started" in out and "watchdog is in charge" in out
    assert not (tmp_path / "fired").exists()


def test_boot_guard_finds_the_login_users_home() -> None:
    """The guard runs as root: ``~`` in the workdir is the ssh_user's home, looked up by
    the shell when the guard checks (the user may not exist yet at boot)."""
    import pwd

    from flotilla._providers.cloud.guard import _as_root, contact_path, home_path

    me = pwd.getpwuid(os.getuid())
    word = _as_root(home_path("~/.flotilla dir"), me.pw_name)
    out = subprocess.run(
        ["sh", "-c", f'printf %s {word}/"$1"', "sh", "x"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == f"{me.pw_dir}/.flotilla dir/x"
    assert contact_path("fl", "i-1") == "~/fl/watchdog/i-1"  # relative: to the home
    with pytest.raises(sky.ConfigurationError, match="ssh_user"):
        sky.AWS(ssh_user="ubuntu; rm -rf /")


def test_a_node_above_max_node_hourly_cost_is_refused_before_launching(aws_lab: AwsLab) -> None:
    """Skyward's per-node cap (``Spec(max_hourly_cost=)``, ``max_node_hourly_cost``): the
    spot price of the type chosen is above it, so nothing is launched; the pool's cap
    (``max_hourly_cost``) is another, for all the nodes together."""
    provider = aws_lab.provider(allocation="spot")
    spec = _spec(2, vcpus=2, max_node_hourly_cost=0.000001)
    with pytest.raises(sky.ProvisionError, match=r"above max_node_hourly_cost=\$1e-06/h"):
        _acquire(provider, spec)
    assert aws_lab.pool_instances(spec.pool_id) == []


def test_launch_line_shows_the_choice_and_the_spot_price(
    aws_lab: AwsLab, capfd: pytest.CaptureFixture[str]
) -> None:
    """Before launching, the choice is shown: type, market (and fallback), zones, the spot
    price from the emulator's spot price history, the AMI. The emulator has no Price List
    API: the on-demand price is left out and the launch goes on."""
    provider = aws_lab.provider(allocation="spot-if-available")
    spec = _spec(1, vcpus=2)
    allocation = _acquire(provider, spec)
    try:
        assert allocation.choice is not None
        kind = allocation.choice.instance_type
        line = next(
            ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("flotilla: AWS ")
        )
        assert f"1 x {kind}" in line
        assert "spot (on-demand if no spot capacity)" in line
        assert ", spot $" in line and "/h" in line
        assert "on-demand $" not in line
        assert f"AMI {aws_lab.ami}" in line
    finally:
        _release(allocation)
    _gone(aws_lab, spec.pool_id)


def test_on_demand_price_from_a_price_list_document() -> None:
    """A GetProducts answer as AWS sends it (each product a JSON string): the hourly USD
    price; a malformed or priceless document gives no price instead of an error."""
    import json

    from flotilla._providers.aws.price import describe, price_from_products

    product = {
        "product": {"attributes": {"instanceType": "m5.large", "regionCode": "us-east-1"}},
        "terms": {
            "OnDemand": {
                "ABC.JRTCKXETXF": {
                    "priceDimensions": {
                        "ABC.JRTCKXETXF.6YS6EN2CT7": {
                            "unit": "Hrs",
                            "pricePerUnit": {"USD": "0.0960000000"},
                            "description": "$0.096 per On Demand Linux m5.large Instance Hour",
                        }
                    }
                }
            }
        },
    }
    assert price_from_products([json.dumps(product)]) == pytest.approx(0.096)
    assert describe("on-demand", 0.096) == ", on-demand $0.096/h"
    assert price_from_products(["{not json", json.dumps({"terms": {}})]) is None
    assert describe("spot", None) == ""
