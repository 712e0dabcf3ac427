"""Ray and Dask clusters as plugins (issue 41), on three SSH test hosts that install the
engines from a package index on the lab's bridge (the hosts have no route out: tests/_wheels
serves them wheels downloaded on this machine once, as a company's mirror would).

Every host has a second interface carrying its default route (as a machine with two NICs):
the engines must bind the pool's. One Ray pool and one Dask pool serve their module's tests,
in file order: the Ray pool's
last tests kill a node (a spare host takes its rank and joins the cluster) and close it.
Ray is kept small: one CPU per node, an 80 MiB object store, no dashboard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _hosts import Lab, TestHost, lab_unavailable
from _procs import Client, wait_until
from _wheels import HOST_PYTHON, PackageIndex, wheels_for

import flotilla as sky
from flotilla._client.forward import RELAY, PortForward
from flotilla._info import SINGLE_NODE
from flotilla.plugins._daemons import MARKER_VAR, Daemon, EngineError
from flotilla.plugins._ray import START_ATTEMPTS, WATCH, start_node

RAY = "2.60.0"
DISTRIBUTED = "2026.8.0"
OBJECT_STORE = 80 * 1024 * 1024
STALE = "/tmp/ray/flotilla-00dead00-0"
"""A scratch folder a dead pool left on node 0's host (each host has its own /tmp: the test
puts and reads it there, through ``TestHost.path``)."""
HELD_PORTS = {0: (6379, 10001, 52365), 1: (52365,)}
"""Ports another process holds on the hosts of nodes 0 and 1 before the Ray pool starts:
Ray's defaults (GCS, client server, dashboard agent), which a plain ``ray start`` takes."""

pytestmark = pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))


# -- the lab: 3 hosts and a spare, with a package index on the bridge ---------------------


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    folders = [wheels_for([f"ray=={RAY}", f"distributed=={DISTRIBUTED}"])]
    folders.append(wheels_for([f"ray[default]=={RAY}"]))  # the dashboard's extras
    with Lab() as lab:
        index = PackageIndex(folders, f"{lab.subnet}.1")
        try:
            bin_dir = os.path.dirname(sys.executable)  # uv for the builds, as the lab's hosts
            env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **index.host_env()}
            for i in range(4):
                host = lab.add_host(env=env)
                second_interface(host, f"198.51.100.{i + 2}")
            yield lab
        finally:
            index.close()


def second_interface(host: TestHost, addr: str) -> None:
    """Give ``host`` a second interface that carries its default route, as a machine with a
    public and a private NIC has: an engine that picks its address by the route out (Ray
    does) would take this one, not the pool's. A veth pair with both ends in the host:
    nothing sent to it leaves the host, and the address is in a documentation range
    (TEST-NET-2)."""
    for cmd in (
        ["link", "add", "second0", "type", "veth", "peer", "name", "second1"],
        ["addr", "add", f"{addr}/24", "dev", "second0"],
        ["link", "set", "second0", "up"],
        ["link", "set", "second1", "up"],
        ["route", "add", "default", "dev", "second0"],
    ):
        subprocess.run(["ip", "-n", host.netns, *cmd], check=True, capture_output=True)


def provider(lab: Lab, hosts: list[TestHost] | None = None) -> Any:
    """The lab's hosts with Debian's python3 (no engine installed) and a fresh workdir per
    lab (environments are built once per lab, on the hosts' shared disk)."""
    return lab.provider(hosts, python=HOST_PYTHON)


@contextlib.contextmanager
def held_ports(host: TestHost, ports: tuple[int, ...]) -> Iterator[None]:
    """Another process listening on ``ports`` on every address of ``host``."""
    code = (
        "import socket, sys\n"
        "socks = []\n"
        "for p in map(int, sys.argv[1:]):\n"
        "    s = socket.socket(); s.bind(('', p)); s.listen(); socks.append(s)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    argv = ["nsenter", f"--net=/run/netns/{host.netns}", sys.executable, "-c", code]
    proc = subprocess.Popen(
        [*argv, *map(str, ports)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield
    finally:
        proc.kill()
        proc.wait()


def engine_pids(lab: Lab) -> list[int]:
    """Processes on the lab's hosts that an engine daemon started (they carry its marker)."""
    out = []
    for host in lab.hosts:
        for pid in lab.pids(host):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
                if f"{MARKER_VAR}=".encode() in f.read():
                    out.append(pid)
    return out


def scratch_folders(
    engine: str, pool: sky.Compute, hosts: list[TestHost] | None = None
) -> list[str]:
    """The pool's scratch folders under /tmp/<engine>: on each of ``hosts`` as that host
    sees its own /tmp, or on this machine (the local provider's nodes) when None."""
    roots = [Path("/tmp", engine)] if hosts is None else [h.path(f"/tmp/{engine}") for h in hosts]
    pattern = f"flotilla-{pool.pool_id[:8]}-*"
    return [p.name for root in roots if root.exists() for p in root.glob(pattern)]


# -- Ray ----------------------------------------------------------------------------------


@sky.function
def ray_view() -> dict[str, Any]:
    """The cluster as a task sees it: its alive nodes, and the rank a task pinned to each
    node (by its node IP resource) reads there."""
    import logging

    import ray

    ray.init(ignore_reinit_error=True, logging_level=logging.ERROR, log_to_driver=False)

    @ray.remote(num_cpus=0)
    def rank_here() -> int:
        return int(json.loads(os.environ["COMPUTE_POOL"])["node"])

    alive = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    addrs = sorted(n["NodeManagerAddress"] for n in alive)
    pinned = {a: ray.get(rank_here.options(resources={f"node:{a}": 0.001}).remote()) for a in addrs}
    ports = sorted({n["NodeManagerPort"] for n in alive} | {n["ObjectManagerPort"] for n in alive})
    out = {"addrs": addrs, "pinned": pinned, "ports": ports, "address": os.environ["RAY_ADDRESS"]}
    ray.shutdown()
    return out


@pytest.fixture(scope="module")
def ray_pool(lab: Lab) -> Iterator[sky.Compute]:
    plugin = sky.plugins.ray(version=RAY, num_cpus=1, object_store_memory=OBJECT_STORE)
    hosts = lab.hosts  # 3 nodes and a spare
    stale = hosts[0].path(STALE)  # a pool's whose client died (killed owner)
    stale.mkdir(parents=True, exist_ok=True)
    (stale / ".flotilla-owner").write_text(f"999999999.1.{os.stat('/proc/self/ns/pid').st_ino}")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, stale, ignore_errors=True)
        for node, ports in HELD_PORTS.items():
            stack.enter_context(held_ports(hosts[node], ports))
        pool = sky.Compute(provider(lab, hosts), nodes=3, plugins=[plugin])
        stack.callback(pool.close)
        pool.open()
        yield pool


def test_ray_has_every_node_and_a_task_pinned_to_a_node_runs_there(
    ray_pool: sky.Compute, lab: Lab
) -> None:
    view = ray_view() >> ray_pool
    pool_addrs = [h.addr for h in lab.hosts[:3]]
    assert view["addrs"] == sorted(pool_addrs)  # the pool's, not the route's (198.51.100.x)
    assert view["pinned"] == {addr: rank for rank, addr in enumerate(pool_addrs)}
    assert view["address"].startswith(f"{pool_addrs[0]}:")


def test_a_temp_dir_a_dead_pool_left_is_removed_by_the_next_one(
    ray_pool: sky.Compute, lab: Lab
) -> None:
    assert lab.hosts[0].path("/tmp/ray").is_dir()  # the host's own /tmp/ray, where it was
    assert not lab.hosts[0].path(STALE).exists()


def test_ray_uses_no_port_another_process_holds(ray_pool: sky.Compute) -> None:
    view = ray_view() >> ray_pool
    gcs = int(view["address"].rsplit(":", 1)[1])
    held = {p for ports in HELD_PORTS.values() for p in ports}
    assert gcs not in held and not held & set(view["ports"])


@pytest.mark.timeout(600)  # its own deadline (300 s for the replacement) must be the one
def test_a_killed_ray_node_is_replaced_and_its_replacement_joins(
    ray_pool: sky.Compute, lab: Lab
) -> None:
    lost, spare = lab.hosts[2], lab.hosts[3]
    node = ray_pool._nodes[2]
    lab.kill_all(lost)  # the host's sshd, agent and Ray processes
    try:
        assert wait_until(
            lambda: ray_pool._nodes[2] is not node and ray_pool._nodes[2].state.value == "ready",
            timeout=300,
        )
    finally:
        lab.start_sshd(lost)  # the host is back for the next pools (no agent on it)
    view = ray_view() >> ray_pool
    assert view["addrs"] == sorted([lab.hosts[0].addr, lab.hosts[1].addr, spare.addr])
    assert view["pinned"][spare.addr] == 2


def test_closing_the_ray_pool_leaves_no_ray_process_nor_temp_dir(
    ray_pool: sky.Compute, lab: Lab
) -> None:
    assert engine_pids(lab) and scratch_folders("ray", ray_pool, lab.hosts)  # while it runs
    ray_pool.close()
    assert wait_until(lambda: not engine_pids(lab), timeout=30), engine_pids(lab)
    assert scratch_folders("ray", ray_pool, lab.hosts) == []


def dashboard_version(url: str) -> str | None:
    """The Ray version the dashboard at ``url`` says it runs (None: it does not answer)."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy: ours
    try:
        with direct.open(f"{url}/api/version", timeout=30) as answer:
            return str(json.load(answer)["ray_version"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.timeout(600)  # its own deadlines (the build of ray[default], the start) decide
def test_the_ray_dashboard_answers_on_the_head_through_the_pools_channel(lab: Lab) -> None:
    """The head's dashboard listens on its pool address at a port of its block, which
    nothing opens to others; ``pool.ray_dashboard()`` forwards it to this machine through
    the pool's own SSH channel (a relay per connection), as ``ssh -L`` would by hand."""
    plugin = sky.plugins.ray(
        version=RAY, dashboard=True, num_cpus=1, object_store_memory=OBJECT_STORE
    )
    with sky.Compute(provider(lab, lab.hosts[:1]), nodes=1, plugins=[plugin]) as pool:
        url = pool.ray_dashboard()
        assert url.startswith("http://127.0.0.1:"), url
        assert wait_until(lambda: dashboard_version(url) == RAY, timeout=120), url
        head = f"http://{lab.hosts[0].addr}:{pool._bringup.head_port + 18}"
        assert wait_until(lambda: dashboard_version(head) == RAY, timeout=30), head
    assert dashboard_version(url) is None  # the forward closed with the pool
    assert wait_until(lambda: not engine_pids(lab), timeout=30), engine_pids(lab)


def test_a_ray_version_that_does_not_exist_fails_the_build_naming_it(lab: Lab) -> None:
    plugin = sky.plugins.ray(version="0.0.1", num_cpus=1, object_store_memory=OBJECT_STORE)
    pool = sky.Compute(provider(lab, lab.hosts[:1]), nodes=1, plugins=[plugin])
    with pytest.raises(sky.ProvisionError) as info, pool:
        pass
    text = str(info.value)
    assert "ray==0.0.1" in text and "step 'pip'" in text, text


@pytest.mark.timeout(600)  # its own deadlines (300 s up, 60 s down) must be the ones
def test_a_killed_clients_ray_processes_end_with_its_agents(lab: Lab, tmp_path: Path) -> None:
    hosts = lab.hosts[:2]
    script = f"""
        import flotilla as sky

        provider = sky.SSH({[h.addr for h in hosts]!r}, user="root",
                           key={str(lab.client_key)!r}, known_hosts={str(lab.known_hosts)!r},
                           workdir={str(lab.tmp / "workdir")!r}, python={HOST_PYTHON!r})
        plugin = sky.plugins.ray(version={RAY!r}, num_cpus=1, object_store_memory={OBJECT_STORE})
        with sky.Compute(provider=provider, nodes=2, plugins=[plugin]) as pool:
            print("up", flush=True)
            import threading; threading.Event().wait()
    """
    client = Client(script, tmp_path)
    try:
        client.expect(lambda line: line == "up", timeout=300)
        assert engine_pids(lab)
        client.signal(signal.SIGKILL)  # no close(): the agents' watchdog (end of stdin)
        assert client.wait() == -signal.SIGKILL
        assert wait_until(lambda: not engine_pids(lab), timeout=60), engine_pids(lab)
    finally:
        client.kill()


# -- Dask ---------------------------------------------------------------------------------


@sky.function
def dask_view() -> dict[str, Any]:
    """Through ``distributed.Client()`` with no address: the workers and a map's sum."""
    from distributed import Client

    with Client() as client:
        workers = client.scheduler_info()["workers"]
        hosts = sorted(w["host"] for w in workers.values())
        futures = client.map(lambda x: x * x, range(1000))
        total = client.submit(sum, futures).result()
    return {
        "hosts": hosts,
        "threads": sorted(w["nthreads"] for w in workers.values()),
        "sum": total,
    }


@pytest.fixture(scope="module")
def dask_pool(lab: Lab) -> Iterator[sky.Compute]:
    plugin = sky.plugins.dask(version=DISTRIBUTED)
    with sky.Compute(provider(lab, lab.hosts[:3]), nodes=3, plugins=[plugin]) as pool:
        yield pool


def test_dask_has_a_worker_per_node_and_maps_in_tasks(dask_pool: sky.Compute, lab: Lab) -> None:
    view = dask_view() >> dask_pool
    assert view["hosts"] == sorted(h.addr for h in lab.hosts[:3])
    assert view["threads"] == [len(os.sched_getaffinity(0))] * 3  # the node's CPUs
    assert view["sum"] == sum(x * x for x in range(1000))


def test_dask_client_from_this_machine_goes_through_the_pools_ssh_channel(
    dask_pool: sky.Compute,
) -> None:
    pytest.importorskip("distributed")
    client = dask_pool.dask_client()
    assert client.scheduler.address.startswith("tcp://127.0.0.1:")  # the forward's end: ssh relays
    assert len(client.scheduler_info()["workers"]) == 3
    assert client.submit(sum, client.map(lambda x: x + 1, range(1000))).result() == 500500


def test_closing_the_dask_pool_leaves_no_dask_process_nor_folder(
    dask_pool: sky.Compute, lab: Lab
) -> None:
    assert engine_pids(lab) and scratch_folders("dask", dask_pool, lab.hosts)  # while it runs
    dask_pool.close()
    assert wait_until(lambda: not engine_pids(lab), timeout=30), engine_pids(lab)
    assert scratch_folders("dask", dask_pool, lab.hosts) == []


# -- bad input, before anything starts ---------------------------------------------------


def test_ray_with_torch_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(sky.ConfigurationError, match=r"plugins\.ray\(\) and plugins\.torch\(\)"):
        sky.Compute(
            sky.Local(workdir=str(tmp_path)),
            nodes=2,
            plugins=[sky.plugins.ray(), sky.plugins.torch()],
        )
    assert not list(tmp_path.iterdir())


def test_bad_engine_options_are_refused() -> None:
    with pytest.raises(sky.ConfigurationError, match="75 MiB"):
        sky.plugins.ray(object_store_memory=1024)
    with pytest.raises(sky.ConfigurationError, match="num_cpus"):
        sky.plugins.ray(num_cpus=-1)
    with pytest.raises(sky.ConfigurationError, match="invalid version"):
        sky.plugins.ray(version="two")
    with pytest.raises(sky.ConfigurationError, match="threads"):
        sky.plugins.dask(threads=0)


def test_a_daemon_that_fails_shows_the_root_cause_its_long_traceback_starts_with(
    tmp_path: Path,
) -> None:
    """A chained Python traceback prints the root cause first ("Scheduler failed to start"
    is its last line): a daemon's failure must show its first lines, not only its last."""
    code = (
        "import sys\n"
        "print('OSError: [Errno 98] the root cause', flush=True)\n"
        "for i in range(100): print(f'frame {i}', flush=True)\n"
        "print('RuntimeError: Scheduler failed to start.', flush=True)\n"
        "sys.exit(1)\n"
    )
    daemon = Daemon("dask scheduler", [sys.executable, "-c", code], {}, str(tmp_path / "s"))
    daemon.start()
    try:
        with pytest.raises(EngineError) as info:
            daemon.wait_for(lambda: False, 120, "listening")
    finally:
        daemon.stop()
    text = str(info.value)
    assert "exited (status 1) before listening" in text
    assert "the root cause" in text and "Scheduler failed to start." in text, text
    assert "frame 0" in text and "frame 99" in text and "lines left out" in text, text


def test_a_ray_worker_that_joined_a_replaced_head_starts_again(tmp_path: Path) -> None:
    """CI run 23: in a group restart a worker's ``ray start`` reached the last head's GCS,
    then the new head at the same address, and failed with ``WrongClusterID``: another
    ``ray start`` joins the new head, though Ray's traceback after that line is longer than
    the lines a daemon keeps (CI's stop 54 gave up at the first try). A failure another try
    does not mend is raised at the first, and every daemon tried is stopped (stand-in
    ``ray start`` processes: the first fails as Ray's does, the second says Ray's words for
    being up)."""
    tries = tmp_path / "tries"
    code = (
        "import pathlib, sys, time\n"
        f"tries = pathlib.Path({str(tries)!r})\n"
        "n = len(tries.read_text()) if tries.exists() else 0\n"
        "tries.write_text('x' * (n + 1))\n"
        "if n == 0 or sys.argv[1] == 'never':\n"
        "    print('RPC error: WrongClusterID: Perhaps the client is accessing GCS', flush=True)\n"
        "    for i in range(80): print(f'  traceback frame {i}', flush=True)\n"
        "    sys.exit(1)\n"
        "print('Ray runtime started.', flush=True)\n"
        "time.sleep(600)\n"
    )
    made: list[Daemon] = []

    def make(mode: str) -> Daemon:
        argv = [sys.executable, "-c", code, mode]
        made.append(Daemon("ray worker node 1", argv, {}, str(tmp_path / "s"), WATCH))
        return made[-1]

    daemon = start_node(lambda: make("once"))
    try:
        assert daemon is made[1] and daemon.running() and len(made) == 2
        assert not made[0].running()
    finally:
        daemon.stop()
    assert not daemon.running()

    tries.unlink()
    made.clear()
    with pytest.raises(EngineError, match="WrongClusterID"):
        start_node(lambda: make("never"))
    assert len(made) == START_ATTEMPTS and not any(d.running() for d in made)

    tries.unlink()
    made.clear()
    plain = [sys.executable, "-c", "import sys; print('some other failure'); sys.exit(1)"]
    with pytest.raises(EngineError, match="some other failure"):
        start_node(
            lambda: (
                made.append(Daemon("ray head", plain, {}, str(tmp_path / "h"), WATCH)) or made[-1]
            )
        )
    assert len(made) == 1 and not made[0].running()  # tried once


def test_a_pool_address_given_as_a_name_is_bound_as_its_ip() -> None:
    """A node whose pool address is a host name (an SSH host given by name): the engines
    bind the IP it resolves to, as the torch plugin's interface rule resolves it (Ray's
    ``--node-ip-address`` takes an IP: with a name its ``node:`` resource and its drivers'
    own address would not match)."""
    info = dataclasses.replace(SINGLE_NODE, addr="localhost", head_addr="localhost")
    ray = sky.plugins.ray(dashboard=True).start_argv(info, 6379, "/tmp/x")
    assert "--node-ip-address=127.0.0.1" in ray and "--dashboard-host=127.0.0.1" in ray, ray
    dask = sky.plugins.dask().worker_argv(info, "localhost:8786", "/tmp/x")
    assert dask[dask.index("--host") + 1] == "127.0.0.1", dask


# -- the client's forward (pool.dask_client(), pool.ray_dashboard()) ----------------------


def test_a_forward_relays_both_ways_and_ends_its_relays_when_closed() -> None:
    """A forward whose "shell" runs the relay on this machine (as ``srun`` or ``kubectl
    exec`` run it on a node): 2 MB each way intact, a half-read answer included, and no
    relay left once it is closed."""
    code = (
        "import socket\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True)\n"
        "c, _ = s.accept(); data = b''\n"
        "while len(data) < 2 << 20: data += c.recv(65536)\n"
        "c.sendall(data[::-1]); c.close()\n"
    )
    echo = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None
        port = int(echo.stdout.readline())
        forward = PortForward(lambda command: command, None, sys.executable, "127.0.0.1", port)
        try:
            payload = os.urandom(2 << 20)
            with socket.create_connection(("127.0.0.1", forward.local_port), timeout=60) as c:
                c.sendall(payload)
                got = b""
                while len(got) < len(payload) and (chunk := c.recv(65536)):
                    got += chunk
            assert got == payload[::-1]
            assert echo.wait(30) == 0
        finally:
            forward.close()
        assert wait_until(lambda: not relay_pids(), timeout=30), relay_pids()
    finally:
        echo.kill()
        echo.wait()


def test_a_forward_to_a_closed_port_says_why() -> None:
    with socket.socket() as held:  # a port nothing listens on (bound, never listening)
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        forward = PortForward(lambda command: command, None, sys.executable, "127.0.0.1", port)
        try:
            with socket.create_connection(("127.0.0.1", forward.local_port), timeout=60) as c:
                c.settimeout(60)
                assert c.recv(1) == b""  # the relay could not connect: the connection ends
            assert wait_until(lambda: "cannot connect to 127.0.0.1" in forward.said(), 30)
            assert "Connection refused" in forward.said(), forward.said()
        finally:
            forward.close()


def relay_pids() -> list[int]:
    """Processes of this machine running a forward's relay."""
    return [pid for pid in processes_with("") if RELAY in cmdline(pid)]


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace")
    return ""


# -- the local provider: nodes on this machine --------------------------------------------


def test_dask_on_local_nodes_and_a_client_that_connects_directly(tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    plugin = sky.plugins.dask(threads=1)
    with sky.Compute(sky.Local(workdir=str(tmp_path)), nodes=2, plugins=[plugin]) as pool:
        client = pool.dask_client()
        port = pool._bringup.head_port + 17  # the scheduler itself: no tunnel here
        assert client.scheduler.address == f"tcp://127.0.0.1:{port}"
        assert len(client.scheduler_info()["workers"]) == 2
        assert client.submit(sum, client.map(lambda x: x + 1, range(1000))).result() == 500500
        assert scratch_folders("dask", pool)
    assert client.status == "closed"  # closed with the pool
    assert scratch_folders("dask", pool) == []


# -- flotilla launch: a task file's engines ---------------------------------------------


def flotilla_cli(home: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m flotilla ARGS`` with its own FLOTILLA_HOME (this checkout, this venv)."""
    env = {k: v for k, v in os.environ.items() if k != "COMPUTE_POOL"}
    src = str(Path(sky.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    env["FLOTILLA_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "flotilla", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def processes_with(text: str) -> list[int]:
    """Live processes whose environment mentions ``text``."""
    out = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if text.encode() in f.read():
                out.append(pid)
    return out


def test_a_task_files_ray_engine_gives_its_commands_the_cluster(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    task = tmp_path / "ray.yaml"
    task.write_text(
        "name: ray-job\n"
        "num_nodes: 2\n"
        "engines: [ray]\n"
        "run: |\n"
        "  python -c \"import os, ray; ray.init(logging_level='ERROR'); "
        "print('NODES', sum(n['Alive'] for n in ray.nodes()), os.environ['RAY_ADDRESS'])\"\n"
    )
    home = tmp_path / "home"
    done = flotilla_cli(home, tmp_path, "launch", str(task), "-c", "rayjob", "--down")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NODES 2 127.0.0.1:" in done.stdout, done.stdout
    assert wait_until(lambda: not processes_with(str(home)), timeout=30)


def test_an_unknown_engine_in_a_task_file_is_refused_naming_the_line(tmp_path: Path) -> None:
    task = tmp_path / "spark.yaml"
    task.write_text("name: j\nengines: [ray, spark]\nrun: echo hi\n")
    done = flotilla_cli(tmp_path / "home", tmp_path, "launch", str(task), "-c", "sparkjob")
    assert done.returncode == 2
    assert f"{task}:2: `engines` lists engines the cluster starts: ray and/or dask" in (
        done.stderr
    ), done.stderr
