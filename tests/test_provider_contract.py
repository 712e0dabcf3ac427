"""The provider contract: what every provider does the same way, run against each of them
(the in-process fake, local processes, SSH test hosts, a SLURM test cluster, the AWS lab,
the Kubernetes lab, podman containers, and the example provider of docs/providers.md): a
pool starts and takes a broadcast, every node knows its place (rank, peers, head), a killed
node is replaced at its rank, closing the pool leaves nothing behind, and a provider refuses
what it cannot honour before anything starts. What is specific to one provider stays in its
own test module."""

from __future__ import annotations

import base64
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _aws import AwsLab, aws_lab_fixture, aws_shared_lab_fixture  # noqa: F401
from _container import ContainerLab, container_lab_fixture  # noqa: F401 - its fixture
from _fake import FakeCall, FakeProvider
from _gcp import GcpLab, gcp_lab_fixture  # noqa: F401 - the gcp_lab fixture
from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from _k8s import K8sLab, k8s_lab_fixture  # noqa: F401 - the k8s_lab fixture
from _procs import assert_all_gone, wait_until
from _slurm import SlurmCluster, slurm_cluster_fixture  # noqa: F401 - the slurm_cluster fixture
from _standin import key_folders
from _vast import VastLab, vast_lab_fixture  # noqa: F401 - the vast_lab fixture
from test_example_provider import _example_package

import flotilla as sky
from flotilla._errors import ConfigurationError
from flotilla._info import InstanceInfo
from flotilla._providers.base import AllocationState, Provider

PROVIDERS = ("fake", "local", "ssh", "slurm", "aws", "vast", "gcp", "netns", "k8s", "container")


@sky.function
def where() -> dict[str, Any]:
    """What a node knows of its place in the pool."""
    return _place(sky.instance_info())


def _place(info: InstanceInfo) -> dict[str, Any]:
    return {
        "node": info.node,
        "total": info.total_nodes,
        "addr": info.addr,
        "peers": [(p.node, p.addr) for p in info.peers],
        "head": info.head_addr,
        "is_head": info.is_head,
    }


@dataclass
class Kit:
    """One provider under the contract.

    Attributes:
        make: a provider that can run a 2-node pool and replace one of its nodes.
        refused: opens a pool the provider must refuse (a ConfigurationError) before
            anything starts.
        leftovers: what of the provider's is still there (empty once released).
        in_process: the agents live in the test process (the fake): no pid to kill.
        ends_later: what a killed client leaves ends by itself later (cloud instances,
            after their watchdog's ttl), not when its agents exit.
        creates: its acquire creates something that outlives the client's connections
            (instances, pods, containers, folders), recorded before each create is sent.
        fake: the fake provider, when it is the one.
    """

    make: Callable[[], Provider]
    refused: Callable[[], None]
    leftovers: Callable[[], list[str]]
    in_process: bool = False
    ends_later: bool = False
    creates: bool = True
    fake: FakeProvider | None = None
    started: list[int] = field(default_factory=list)


@pytest.fixture(params=PROVIDERS)
def kit(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kit]:
    name = request.param
    if name == "fake":
        fake = FakeProvider()
        fake.on("where", lambda call: _place(_info(call)))

        def fake_refused() -> None:
            sky.Compute(
                provider=fake,
                nodes=2,
                options=sky.Options(cluster=False),
                plugins=[_NeedsCluster()],
            ).open()

        def fake_left() -> list[str]:
            alloc = fake.allocation
            if alloc is not None and alloc.state is not AllocationState.RELEASED:
                return ["the fake allocation is not released"]
            return [f"fake agent {a.machine.ident}" for a in fake.agents if a.status is None]

        yield Kit(lambda: fake, fake_refused, fake_left, in_process=True, fake=fake)
    elif name == "local":
        nodes = tmp_path / "nodes"

        def local_refused() -> None:
            sky.Compute(provider=sky.Local(workdir=str(nodes)), nodes=2, vcpus=10**6).open()

        yield Kit(
            lambda: sky.Local(workdir=str(nodes)),
            local_refused,
            lambda: [p.name for p in nodes.iterdir()] if nodes.exists() else [],
        )
    elif name == "ssh":
        lab: Lab = request.getfixturevalue("ssh_lab")
        hosts = lab.hosts[:3]  # two ranks and a spare

        def ssh_left() -> list[str]:
            return [
                f"agent {pid} on {host}"
                for host, pids in lab.wait_no_agents(hosts).items()
                for pid in pids
            ]

        yield Kit(
            lambda: lab.provider(hosts),
            lambda: sky.Compute(provider=lab.provider(hosts[:1]), nodes=2).open(),
            ssh_left,
            creates=False,  # its agents end with their ssh connections
        )
    elif name == "slurm":
        cluster: SlurmCluster = request.getfixturevalue("slurm_cluster")
        monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))  # this process and its clients
        for var in [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            monkeypatch.delenv(var)

        def slurm_left() -> list[str]:
            wait_until(lambda: not _slurm_jobs(cluster), timeout=30)
            return _slurm_jobs(cluster)

        yield Kit(
            lambda: sky.Slurm(workdir=str(tmp_path)),
            lambda: sky.Compute(provider=sky.Slurm(), nodes=99).open(),
            slurm_left,
            creates=False,  # its salloc ends with the client (PR_SET_PDEATHSIG), the job too
        )
    elif name == "aws":
        aws: AwsLab = request.getfixturevalue("aws_lab")
        pools: list[str] = []

        def aws_make() -> Provider:
            return aws.provider()  # type: ignore[no-any-return]

        def aws_refused() -> None:
            options = sky.Options(heartbeat_timeout=30)
            sky.Compute(provider=aws.provider(ttl=10), nodes=2, options=options).open()

        def aws_left() -> list[str]:  # the pools named in `pools` ("*": every pool)
            def ours(resource: dict[str, Any]) -> bool:
                tags = {t["Key"]: t["Value"] for t in resource.get("Tags", [])}
                pool = tags.get("flotilla:pool")
                return pool is not None and ("*" in pools or pool in pools)

            out = [
                inst["InstanceId"]
                for inst in aws.describe()
                if ours(inst) and inst["State"]["Name"] != "terminated"
            ]
            groups = aws.client().describe_security_groups()["SecurityGroups"]
            return out + [g["GroupId"] for g in groups if ours(g)]

        kit = Kit(aws_make, aws_refused, aws_left, ends_later=True)
        kit.pools = pools  # type: ignore[attr-defined]
        yield kit
    elif name == "vast":
        vast: VastLab = request.getfixturevalue("vast_lab")
        vast.add_machines(3, cluster_id=1)  # two nodes and a replacement, on one cluster

        def vast_refused() -> None:
            options = sky.Options(heartbeat_timeout=30)
            sky.Compute(provider=sky.VastAI(ttl=10), nodes=2, options=options).open()

        def vast_left() -> list[str]:
            return [f"instance {i.id}" for i in vast.live()] + list(vast.overlays)

        yield Kit(sky.VastAI, vast_refused, vast_left, ends_later=True)
    elif name == "gcp":
        gcp: GcpLab = request.getfixturevalue("gcp_lab")

        def gcp_make() -> Provider:
            return sky.GCP(ssh_user="root", python=sys.executable)

        def gcp_refused() -> None:
            options = sky.Options(heartbeat_timeout=30)
            sky.Compute(provider=sky.GCP(ttl=10), nodes=2, options=options).open()

        def gcp_left() -> list[str]:
            return [f"instance {i.zone}/{i.name}" for i in gcp.live()]

        yield Kit(gcp_make, gcp_refused, gcp_left, ends_later=True)
    elif name == "k8s":
        k8s: K8sLab = request.getfixturevalue("k8s_lab")
        from flotilla._providers.k8s import Kubernetes

        def k8s_make() -> Provider:
            return Kubernetes(
                kubeconfig=str(k8s.kubeconfig), kubectl=k8s.kubectl_path, python=sys.executable
            )

        def k8s_refused() -> None:
            provider = Kubernetes(
                kubeconfig=str(k8s.kubeconfig), kubectl=k8s.kubectl_path, context="elsewhere"
            )
            sky.Compute(provider=provider, nodes=2).open()

        def k8s_left() -> list[str]:  # pods not ended (a killed client's end by themselves)
            return [
                p["metadata"]["name"]
                for p in k8s.pods(selector="app.kubernetes.io/managed-by=flotilla")
                if p["status"].get("phase") in ("Pending", "Running")
                or p["metadata"].get("deletionTimestamp")
            ]

        yield Kit(k8s_make, k8s_refused, k8s_left)
    elif name == "container":
        clab: ContainerLab = request.getfixturevalue("container_lab")
        # the host's PID namespace: the contract kills agents and watches them by their pid
        run_args = [*clab.run_args, "--pid=host"]

        def container_left() -> list[str]:
            return clab.containers() + clab.networks()

        yield Kit(
            lambda: clab.provider(run_args=run_args),
            lambda: sky.Compute(provider=clab.provider(), nodes=2, accelerator="A100").open(),
            container_left,
        )
    else:
        if os.geteuid() != 0:
            pytest.skip("the netns example provider needs root (unshare --net)")
        package = _example_package(tmp_path / "pkg")
        sys.path.insert(0, str(package))
        try:
            import flotilla_netns  # type: ignore[import-not-found]

            prefix = f"fc{os.getpid()}"
            yield Kit(
                lambda: flotilla_netns.NetnsProvider(prefix=prefix, workdir=str(tmp_path / "w")),
                lambda: sky.Compute(
                    provider=flotilla_netns.NetnsProvider(prefix=prefix),
                    nodes=2,
                    accelerator="A100",
                ).open(),
                list,  # a namespace ends with its agent (checked with the agents)
                creates=False,
            )
        finally:
            sys.path.remove(str(package))
            sys.modules.pop("flotilla_netns", None)


class _NeedsCluster:
    """A plugin that needs cluster mode (a pool without it must be refused)."""

    name = "needs-cluster"
    requires_cluster = True

    def around_process(self, info: object) -> Iterator[None]:
        yield


def _info(call: FakeCall) -> InstanceInfo:
    return call.agent.info  # type: ignore[no-any-return]


def _slurm_jobs(cluster: SlurmCluster) -> list[str]:
    return [j for j in cluster.jobs() if j.split()[1].startswith("flotilla-")]


def _agent_pids(pool: sky.Compute) -> list[int]:
    return [int(n.hello_info["pid"]) for n in pool._nodes if n.hello_info.get("pid")]


def _remember(kit: Kit, pool: sky.Compute) -> None:
    kit.started += _agent_pids(pool)
    pools = getattr(kit, "pools", None)
    if pools is not None:
        pools.append(pool.pool_id)


# -- the contract ------------------------------------------------------------------------------
def test_a_pool_starts_and_every_node_knows_its_place(kit: Kit) -> None:
    with sky.Compute(provider=kit.make(), nodes=2) as pool:
        _remember(kit, pool)
        places = where() @ pool
    assert [p["node"] for p in places] == [0, 1]
    assert {p["total"] for p in places} == {2}
    peers = places[0]["peers"]
    assert [rank for rank, _ in peers] == [0, 1]
    assert all(p["peers"] == peers for p in places)  # every node sees the same pool
    assert [p["addr"] for p in places] == [addr for _, addr in peers]
    assert {p["head"] for p in places} == {peers[0][1]}
    assert [p["is_head"] for p in places] == [True, False]


def test_a_killed_node_is_replaced_at_its_rank(kit: Kit) -> None:
    with sky.Compute(provider=kit.make(), nodes=2) as pool:
        _remember(kit, pool)
        lost = pool._nodes[1]
        if kit.fake is not None:
            kit.fake.live[1].lose()
        else:
            os.kill(int(lost.hello_info["pid"]), signal.SIGKILL)
        assert wait_until(
            lambda: pool._nodes[1] is not lost and pool._nodes[1].state.value == "ready",
            timeout=120,
        ), "node 1 was not replaced"
        _remember(kit, pool)
        places = where() @ pool
    assert [p["node"] for p in places] == [0, 1]
    assert pool._renewals.replaced == 1


def test_closing_the_pool_leaves_nothing(kit: Kit) -> None:
    with sky.Compute(provider=kit.make(), nodes=2) as pool:
        _remember(kit, pool)
        assert len(where() @ pool) == 2
    assert wait_until(lambda: not kit.leftovers(), timeout=60), kit.leftovers()
    if not kit.in_process:
        assert_all_gone(kit.started, timeout=10, what="the pool's agents")


def test_what_the_provider_cannot_honour_is_refused_before_anything_starts(kit: Kit) -> None:
    with pytest.raises(ConfigurationError):
        kit.refused()
    assert kit.leftovers() == []


_KILLED_CLIENT = """
import sys, time
sys.path[:0] = {path!r}
import flotilla as sky
provider = {make}
with sky.Compute(provider=provider, nodes=2, options=sky.Options(heartbeat_timeout=2)) as pool:
    print(" ".join(str(n.hello_info["pid"]) for n in pool._nodes), flush=True)
    time.sleep(600)
"""


def test_a_client_killed_with_sigkill_leaves_no_agent(kit: Kit, tmp_path: Path) -> None:
    """The client dies without closing its pool: its agents notice (end of stream, or
    silence) and exit, and what the provider made goes with them."""
    if kit.in_process:
        pytest.skip("the fake's agents live in the client")
    make = _source(kit, tmp_path)
    path = [str(Path(__file__).parent), str(tmp_path / "pkg"), *sys.path]
    code = _KILLED_CLIENT.format(path=path, make=make)
    client = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout is not None
        line = client.stdout.readline()
        assert line, client.stderr.read() if client.stderr else ""
        pids = [int(p) for p in line.split()]
    finally:
        client.kill()
        client.wait()
    assert_all_gone(pids, timeout=30, what="the killed client's agents")
    if kit.ends_later:
        # the clouds: the instances end by their watchdog, after ttl (see test_aws.py);
        # the orphans sweep (``flotilla down --orphans``) takes them and the pool's folder
        # on this machine (its keys) now
        killed = [f"{socket.gethostname()}:{client.pid}:"]
        assert key_folders(killed)
        kit.make().remove_orphans()  # type: ignore[attr-defined]
        assert key_folders(killed) == []
        return
    assert wait_until(lambda: not kit.leftovers(), timeout=30), kit.leftovers()


_INTERRUPTED_CLIENT = """
import contextlib, signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)  # even under a nohup'd suite
sys.path[:0] = {path!r}
import flotilla as sky
from flotilla._providers import base
provider = {make}
steps = []


def step(where):
    steps.append(where)
    if len(steps) == {step}:
        print("interrupted at", where, flush=True)
        # Ctrl-C, received by this thread (the loop's, an API call's), as Linux may deliver
        # it: not by the main thread, which the client must wake itself
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)


creating = getattr(base.Allocation, "creating", None)


@contextlib.contextmanager
def recorded(self, what, key):
    with creating(self, what, key):  # recorded: the create is sent after the Ctrl-C
        step("create " + what)
        yield


if creating is not None:
    base.Allocation.creating = recorded
start_agents = base.start_agents


async def starting(allocation, machines):
    step("start the agents")
    return await start_agents(allocation, machines)


base.start_agents = starting
with sky.Compute(provider=provider, nodes=2, options=sky.Options(heartbeat_timeout=2)):
    print("opened after", len(steps), "steps", flush=True)
"""


def test_an_acquire_interrupted_at_any_step_leaves_nothing(kit: Kit, tmp_path: Path) -> None:
    """Ctrl-C at each step of a pool's start (each create the provider records before it
    sends it, then the agents' start), received by the thread doing the step, not the main
    one: once the client has exited, nothing it created is left (cloud instances at once:
    no watchdog's ttl)."""
    if kit.in_process:
        pytest.skip("the fake's agents live in the client")
    make = _source(kit, tmp_path)
    path = [str(Path(__file__).parent), str(tmp_path / "pkg"), *sys.path]
    pools = getattr(kit, "pools", None)
    if pools is not None:
        pools.append("*")  # the clients' pools, whose ids this test does not know
    interrupted: list[str] = []
    for step in range(1, 20):
        code = _INTERRUPTED_CLIENT.format(path=path, make=make, step=step)
        client = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
        )
        if "opened after" in client.stdout:
            assert step > 1 and client.returncode == 0, client.stderr
            break
        assert "interrupted at" in client.stdout, client.stdout + client.stderr
        assert "KeyboardInterrupt" in client.stderr, client.stderr
        interrupted.append(client.stdout.split("interrupted at", 1)[1].strip())
        # the clouds: right after the exit (the client gave them back before it exited)
        left = kit.leftovers()
        if not kit.ends_later and left:  # deleted, perhaps not yet ended (pods, jobs)
            wait_until(lambda: not kit.leftovers(), timeout=60)
            left = kit.leftovers()
        assert left == [], f"interrupted at {interrupted[-1]}: {left}\n{client.stderr}"
    else:
        pytest.fail("the pool never opened")
    assert interrupted[-1] == "start the agents", interrupted
    if kit.creates:  # each create was a step
        assert any(i.startswith("create ") for i in interrupted), interrupted


def _source(kit: Kit, tmp_path: Path) -> str:
    """How a separate client process makes the kit's provider: from its settings."""
    provider = kit.make()
    data = base64.b64encode(pickle.dumps((type(provider), provider.settings))).decode()
    return (
        "(lambda made: made[0].from_settings(made[1]))(__import__('pickle').loads("
        f"__import__('base64').b64decode({data!r})))"
    )
