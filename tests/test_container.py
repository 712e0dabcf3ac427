"""The Container provider (``sky.Container``).

Real: podman runs the containers (``_container``: a root filesystem built here, this
machine's Python mounted read-only), on a network of their own; the tests skip with
podman's own error where no container can run. Stood in: the command lines and the cleanup
when the engine fails are also checked against ``standin_podman`` below, a small script
that follows podman's command line (and keeps its containers as files), so that they are
tested on machines without a container runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from _container import (  # noqa: F401 - the fixtures
    ContainerLab,
    container_lab_fixture,
    no_netns_left,
    podman_netns,
)
from _ddp import assert_ddp_averages
from _procs import all_pids, cmdline, wait_until

import flotilla as sky
from flotilla._errors import ConfigurationError, ProvisionError
from flotilla._providers.container import Container
from flotilla._providers.container.orphans import remove_orphans
from flotilla._providers.container.settings import ContainerSettings


@sky.function
def where() -> dict[str, Any]:
    import socket

    info = sky.instance_info()
    return {
        "node": info.node,
        "addr": info.addr,
        "head": info.head_addr,
        "is_head": info.is_head,
        "peers": [(p.node, p.addr) for p in info.peers],
        "hostname": socket.gethostname(),
    }


# -- bad input: refused before anything starts -------------------------------------------------
@pytest.mark.parametrize(
    "image", ["Python:3.11", "python:3.11 slim", "-rm", "python::3", "a/B/c", "x@sha256:12"]
)
def test_a_bad_image_name_is_refused_when_made(image: str) -> None:
    with pytest.raises(ConfigurationError, match="is not an image name"):
        sky.Container(image=image)


def test_image_names_and_skywards_placeholder() -> None:
    for image in ("python:3.11-slim", "ghcr.io/org/img:v1", "localhost:5000/a/b", "ubuntu"):
        assert ContainerSettings(image=image).image_name == image
    minor = "%d.%d" % sys.version_info[:2]  # noqa: UP031
    custom = ContainerSettings(image="ghcr.io/x/sky:py{python_version}")
    assert custom.image_name == f"ghcr.io/x/sky:py{minor}"
    assert ContainerSettings().image_name == f"python:{minor}-slim"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"binary": "nerdctl"}, "docker and podman"),
        ({"binary": ""}, "must be 'docker' or 'podman'"),
        ({"network": "my net"}, "letters, digits"),
        ({"rootfs": "relative/dir", "binary": "podman"}, "absolute folder"),
        ({"rootfs": "/srv/root"}, "binary='podman'"),
        ({"rootfs": "/srv/root", "binary": "podman", "image": "x"}, "not both"),
        ({"volumes": ["/a"]}, "HOST:CONTAINER"),
        ({"run_args": "--privileged"}, "list of non-empty strings"),
    ],
)
def test_bad_settings_are_refused_when_made(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        sky.Container(**kwargs)


def test_a_missing_binary_is_refused_before_anything_starts(tmp_path: Path) -> None:
    before = set(all_pids())
    provider = sky.Container(binary=str(tmp_path / "podman"))
    with pytest.raises(ConfigurationError, match="no such command"):
        sky.Compute(provider=provider, nodes=2).open()
    started = [p for p in set(all_pids()) - before if str(tmp_path) in cmdline(p)]
    assert started == []  # no janitor (its command line names the binary)


def test_an_accelerator_and_a_missing_rootfs_are_refused(standin: Path, tmp_path: Path) -> None:
    podman = standin
    with pytest.raises(ConfigurationError, match="no accelerators"):
        sky.Compute(provider=sky.Container(binary=str(podman)), accelerator="A100").open()
    rootfs = str(tmp_path / "nothing")
    with pytest.raises(ConfigurationError, match="no such folder"):
        sky.Compute(provider=sky.Container(binary=str(podman), rootfs=rootfs), nodes=1).open()
    assert calls(tmp_path) == []


def test_exported_with_skywards_name() -> None:
    assert "Container" in sky.__all__
    assert sky.Container is Container
    assert Container.settings_type is ContainerSettings


# -- the stand-in: command lines and cleanup without a runtime ---------------------------------
STANDIN = """\
import json, os, sys
state = os.environ["STANDIN_STATE"]
os.makedirs(state, exist_ok=True)
with open(os.path.join(state, "calls.jsonl"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
while args and args[0].startswith("--"):  # podman's own options (--runtime X)
    args = args[2:]
cmd, rest = args[0], args[1:]
def path(kind, name):
    return os.path.join(state, kind + "-" + name)
def fail(message, status=125):
    sys.stderr.write("Error: " + message + "\\n")
    sys.exit(status)
if cmd == "network":
    sub, name = rest[0], rest[-1]
    if sub == "create":
        if os.path.exists(path("net", name)):
            fail("network name " + name + " already used: network already exists")
        open(path("net", name), "w").close(); print(name)
    elif sub == "rm":
        if not os.path.exists(path("net", name)):
            fail("unable to find network with name or ID " + name + ": network not found")
        os.remove(path("net", name)); print(name)
    elif sub == "inspect":
        if not os.path.exists(path("net", name)):
            fail("network " + name + ": network not found")
        print("[{}]")
elif cmd == "run":
    error = os.environ.get("STANDIN_RUN_ERROR")
    name = rest[rest.index("--name") + 1]
    labels = dict(rest[i + 1].split("=", 1) for i, a in enumerate(rest) if a == "--label")
    with open(path("ctr", name), "w") as f:
        json.dump({"labels": labels, "net": rest[rest.index("--network") + 1]}, f)
    if error:
        fail(error)
    print("id-" + name)
elif cmd == "ps":
    label = rest[rest.index("--filter") + 1].split("=", 1)[1]
    for entry in sorted(os.listdir(state)):
        if entry.startswith("ctr-"):
            data = json.load(open(os.path.join(state, entry)))
            key, _, value = label.partition("=")
            if data["labels"].get(key) == value:
                print(entry[4:])
elif cmd == "rm":
    for name in [a for a in rest if not a.startswith("-") and a != "0"]:
        if os.path.exists(path("ctr", name)):
            os.remove(path("ctr", name))
        print(name)
else:
    fail("stand-in: unsupported command " + cmd)
"""


def standin_podman(tmp_path: Path) -> Path:
    """A ``podman`` that follows podman's command line for what the provider calls, keeps
    its containers and networks as files under ``tmp_path/state`` and logs every call."""
    script = tmp_path / "bin" / "podman"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"#!{sys.executable}\n" + STANDIN)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def calls(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "state" / "calls.jsonl"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def standing(tmp_path: Path) -> list[str]:
    state = tmp_path / "state"
    return sorted(p.name for p in state.iterdir() if p.name.startswith(("ctr-", "net-")))


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STANDIN_STATE", str(tmp_path / "state"))
    return standin_podman(tmp_path)


def test_the_run_command_line(standin: Path, tmp_path: Path) -> None:
    provider = sky.Container(
        binary=str(standin),
        rootfs=str(tmp_path),
        volumes=["/usr:/usr:ro"],
        run_args=["--ulimit", "nofile=1024:1024"],
        binary_args=["--runtime", "runc"],
        python="/opt/py/bin/python3",
        container_prefix="dev",
    )
    spec = sky.PoolSpec("p1", 2, None, None, (), sky.Options(), vcpus=1.5, memory_gb=0.5)
    argv = provider.run_args(spec, 1, "dev-p1-1", "flotilla-p1")
    assert argv[:6] == ["run", "-d", "--name", "dev-p1-1", "--hostname", "dev-p1-1"]
    assert argv[6:8] == ["--network", "flotilla-p1"]
    labels = [argv[i + 1] for i, a in enumerate(argv) if a == "--label"]
    assert labels[:3] == ["flotilla.managed=true", "flotilla.pool=p1", "flotilla.rank=1"]
    assert labels[3].startswith(f"flotilla.client={os.uname().nodename}:{os.getpid()}:")
    tail = argv[argv.index("--cpus") :]
    assert tail[:4] == ["--cpus", "1.5", "--memory", "512m"]
    assert tail[4:8] == ["-v", "/usr:/usr:ro", "--ulimit", "nofile=1024:1024"]
    assert tail[8:10] == ["--rootfs", f"{tmp_path}:O"]
    assert tail[10:12] == ["/opt/py/bin/python3", "-S"]
    image = sky.Container(binary="docker", image="python:3.11-slim").run_args(spec, 0, "n", "w")
    assert image[-5:-3] == ["python:3.11-slim", "python3"]


def test_an_engine_failure_leaves_nothing_and_says_why(standin: Path, tmp_path: Path) -> None:
    os.environ["STANDIN_RUN_ERROR"] = "crun: setrlimit `RLIMIT_NOFILE`: Operation not permitted"
    try:
        provider = sky.Container(binary=str(standin), binary_args=["--runtime", "crun"])
        with pytest.raises(ProvisionError, match="RLIMIT_NOFILE") as err:
            sky.Compute(provider=provider, nodes=2).open()
    finally:
        del os.environ["STANDIN_RUN_ERROR"]
    assert "did not start" in str(err.value)
    assert standing(tmp_path) == []  # both containers and the network removed
    made = calls(tmp_path)
    assert all(c[:2] == ["--runtime", "crun"] for c in made)
    subcommands = [c[2] if c[2] != "network" else f"network {c[3]}" for c in made]
    assert subcommands[0] == "network create"
    assert subcommands.count("run") == 2
    assert subcommands[-3:] == ["ps", "rm", "network rm"]
    assert made[-2][3:6] == ["-f", "-t", "0"]  # podman: no stop grace


def test_a_shared_network_is_made_once_and_kept(standin: Path, tmp_path: Path) -> None:
    os.environ["STANDIN_RUN_ERROR"] = "no"
    try:
        for _ in range(2):
            provider = sky.Container(binary=str(standin), network="shared")
            with pytest.raises(ProvisionError):
                sky.Compute(provider=provider, nodes=1).open()
    finally:
        del os.environ["STANDIN_RUN_ERROR"]
    assert standing(tmp_path) == ["net-shared"]
    creates = [c for c in calls(tmp_path) if c[:2] == ["network", "create"]]
    assert creates == [["network", "create", "shared"]]


# -- real containers ---------------------------------------------------------------------------
def test_two_containers_form_a_cluster_on_their_network(container_lab: ContainerLab) -> None:
    with sky.Compute(provider=container_lab.provider(), nodes=2) as pool:
        infos = where() @ pool
        names = container_lab.containers(pool.pool_id)
        assert names == [f"flotilla-{pool.pool_id}-0", f"flotilla-{pool.pool_id}-1"]
        network = f"flotilla-{pool.pool_id}"
        ips = [
            container_lab.inspect(n)["NetworkSettings"]["Networks"][network]["IPAddress"]
            for n in names
        ]
        assert network in container_lab.networks()
    assert [i["hostname"] for i in infos] == names
    assert [i["addr"] for i in infos] == ips
    assert all(i["peers"] == [(0, ips[0]), (1, ips[1])] for i in infos)
    assert {i["head"] for i in infos} == {ips[0]}
    assert [i["is_head"] for i in infos] == [True, False]
    assert container_lab.containers(pool.pool_id) == []
    assert network not in container_lab.networks()


@sky.function
def node_of(i: int) -> tuple[int, int, str]:
    import socket

    return i, sky.instance_info().node, socket.gethostname()


def test_an_elastic_pool_of_containers_starts_empty_and_scales_to_zero(
    container_lab: ContainerLab,
) -> None:
    """``Nodes(0, max=2, min=0)``: no container before the first call; a burst runs on up
    to 2 containers (run as the pool grows); idle, every container is removed (the
    network stays until the pool closes), and the next call runs one again."""
    options = sky.Options(autoscale_idle_timeout=1.0, autoscale_cooldown=0, start_timeout=300)
    provider = container_lab.provider()
    with sky.Compute(provider, nodes=sky.Nodes(0, max=2, min=0), options=options) as pool:
        pool_id = pool.pool_id
        assert pool.current_nodes() == 0 and container_lab.containers(pool_id) == []
        out = pool.map(node_of, range(20))
        assert [i for i, _, _ in out] == list(range(20))
        assert {node for _, node, _ in out} <= {0, 1}
        assert 1 <= len({host for _, _, host in out}) <= 2
        assert wait_until(lambda: pool.current_nodes() == 0, timeout=120)
        assert wait_until(lambda: container_lab.containers(pool_id) == [], timeout=60)
        assert f"flotilla-{pool_id}" in container_lab.networks()
        assert (node_of(1) >> pool)[:2] == (1, 0)
        assert len(container_lab.containers(pool_id)) == 1
    assert container_lab.containers(pool_id) == []
    assert f"flotilla-{pool_id}" not in container_lab.networks()


def test_ddp_across_containers(container_lab: ContainerLab) -> None:
    pytest.importorskip("torch")
    provider = container_lab.provider()
    options = sky.Options(start_timeout=300)
    with sky.Compute(
        provider=provider, nodes=2, plugins=[sky.plugins.torch()], options=options
    ) as pool:
        assert_ddp_averages(pool, 2)
        pool_id = pool.pool_id
    assert container_lab.containers(pool_id) == []


def test_an_exception_or_ctrl_c_in_the_block_leaves_nothing(container_lab: ContainerLab) -> None:
    ids = []
    for error in (RuntimeError("boom"), KeyboardInterrupt()):
        with (
            pytest.raises(type(error)),
            sky.Compute(provider=container_lab.provider(), nodes=2) as pool,
        ):
            ids.append(pool.pool_id)
            assert len(container_lab.containers(pool.pool_id)) == 2
            raise error
    for pool_id in ids:
        assert container_lab.containers(pool_id) == []
        assert f"flotilla-{pool_id}" not in container_lab.networks()


def test_a_removed_container_is_replaced_at_its_rank(container_lab: ContainerLab) -> None:
    with sky.Compute(provider=container_lab.provider(), nodes=2) as pool:
        first = where() @ pool
        lost = pool._nodes[1]
        container_lab.podman("rm", "-f", "-t", "0", f"flotilla-{pool.pool_id}-1")
        assert wait_until(
            lambda: pool._nodes[1] is not lost and pool._nodes[1].state.value == "ready",
            timeout=120,
        ), "node 1 was not replaced"
        again = where() @ pool
        assert container_lab.containers(pool.pool_id) == [
            f"flotilla-{pool.pool_id}-0",
            f"flotilla-{pool.pool_id}-1-1",
        ]
    assert again[1]["hostname"] == f"flotilla-{pool.pool_id}-1-1"
    # every node, the one that went on too, knows the new container's address
    assert [i["peers"] for i in again] == [[(0, again[0]["addr"]), (1, again[1]["addr"])]] * 2
    assert again[1]["addr"] != first[1]["addr"]
    assert first[0]["addr"] == again[0]["addr"]
    assert container_lab.containers(pool.pool_id) == []


def test_a_start_cut_short_leaves_no_network_namespace(container_lab: ContainerLab) -> None:
    """A pool's start cut short (Ctrl-C; an elastic pool closing while it grows) while
    the engine sets up a container's network: the engine's ``run`` is let end, and the
    release removes the container with its network namespace and its processes. (podman 4
    with CNI leaves that namespace behind for good when ``run`` is killed right then: made,
    not yet recorded with the container; killed a little later, the container's ``conmon``
    and ``runc init`` stay, in a namespace no container names.)"""
    from flotilla._providers.base import Options, PoolSpec

    provider = container_lab.provider()
    spec = PoolSpec(uuid.uuid4().hex[:8], 1, None, None, (), Options())
    name = f"{provider.settings.prefix}-{spec.pool_id}-0"
    before = podman_netns()

    def engine_run() -> list[int]:  # this process's `podman run` of the container
        kids = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
        return [int(p) for p in kids if f" --name {name} " in cmdline(int(p))]

    async def cut_short() -> set[str]:
        start = asyncio.create_task(provider.acquire(spec))
        runs: list[int] = []
        while not (runs and podman_netns() - before):  # the namespace is made: hold it
            assert not start.done(), "the pool started before its network was set up"
            runs = runs or engine_run()
            await asyncio.sleep(0.001)
        made = podman_netns() - before
        for pid in runs:
            os.kill(pid, signal.SIGSTOP)
        try:
            start.cancel()
            for _ in range(10):  # the cancellation reaches the engine's call
                await asyncio.sleep(0)
        finally:
            for pid in runs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        with pytest.raises(asyncio.CancelledError):
            await start
        return made

    made = asyncio.run(cut_short())
    assert container_lab.containers(spec.pool_id) == []
    assert f"flotilla-{spec.pool_id}" not in container_lab.networks()
    assert wait_until(lambda: not container_lab.orphan_netns(made), timeout=60), (
        container_lab.orphan_netns(made)
    )

    def monitors() -> list[str]:  # a conmon (and its `runc init`) left of the container
        return [cmdline(p) for p in all_pids() if f" -n {name} " in cmdline(p)]

    assert wait_until(lambda: not monitors(), timeout=60), monitors()


_CLIENT = """
import sys, time
sys.path[:0] = {path!r}
import flotilla as sky
from flotilla._providers.container import Container
with sky.Compute(provider=Container(**{settings!r}), nodes=2) as pool:
    print(pool.pool_id, flush=True)
    time.sleep(600)
"""


def _killed_client(lab: ContainerLab, janitor_too: bool = False) -> str:
    """Start a client in a process of its own, kill it with SIGKILL once its pool runs
    (its janitor first, when ``janitor_too``); the pool's id."""
    code = _CLIENT.format(path=[str(Path(__file__).parent), *sys.path], settings=lab.settings())
    client = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout is not None
        line = client.stdout.readline()
        assert line, client.stderr.read() if client.stderr else ""
        if janitor_too:
            janitors = _janitor_of(line.strip())
            assert len(janitors) == 1
            os.kill(janitors[0], signal.SIGKILL)
    finally:
        client.kill()
        client.wait()
    return line.strip()


def _janitor_of(pool_id: str) -> list[int]:
    return [p for p in all_pids() if "label=flotilla.pool=" in cmdline(p) and pool_id in cmdline(p)]


def test_a_killed_clients_pool_is_removed_by_its_janitor(container_lab: ContainerLab) -> None:
    pool_id = _killed_client(container_lab)
    assert wait_until(lambda: not container_lab.containers(pool_id), timeout=60), (
        container_lab.containers(pool_id)
    )
    assert wait_until(lambda: f"flotilla-{pool_id}" not in container_lab.networks(), timeout=30)


def test_orphans_are_found_by_their_labels(container_lab: ContainerLab) -> None:
    """Client and janitor both killed: the containers stay, labelled; remove_orphans
    (``flotilla down --orphans``) finds the pool by its dead client and removes it."""
    pool_id = _killed_client(container_lab, janitor_too=True)
    left = container_lab.containers(pool_id)
    assert len(left) == 2
    settings = ContainerSettings(**container_lab.settings(rootfs=None, python=None, volumes=()))
    found = remove_orphans(settings, dry_run=True)
    assert pool_id in found.pools
    assert set(left) <= set(found.containers)
    assert container_lab.containers(pool_id) == left  # a dry run removes nothing
    found = remove_orphans(settings)
    assert pool_id in found.pools
    assert container_lab.containers(pool_id) == []
    assert f"flotilla-{pool_id}" not in container_lab.networks()
