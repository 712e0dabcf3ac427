"""Bucket volumes (``flotilla.Volume``, ``Compute(volumes=...)``) against a real S3 server
(moto's, see ``_s3``): copied and FUSE-mounted (s3fs, installed by the fixture) on local
pools and on the SSH lab's hosts; checked before anything is provisioned; nothing left
behind (mounts, FUSE daemons, the secret key in a command line or a file)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _aws import AwsLab, aws_lab_fixture, aws_shared_lab_fixture  # noqa: F401
from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from _procs import agent_above, session_folder, wait_until
from _s3 import (
    CheckingS3Server,
    S3Server,
    fuse_unavailable,
    mounts_under,
    processes_with,
    s3_env,
    use,
)
from test_cli import CLI, SRC, node_lines
from test_cli import cli as cli  # the fixture
from test_managed import Jobs, assert_nothing_left
from test_managed import jobs as jobs  # the fixture

import flotilla as sky
from flotilla._errors import ConfigurationError

_ = s3_env  # a fixture

OBJECTS = {
    "data/a.txt": b"alpha",
    "data/sub/b.txt": b"beta",
    "other/c.txt": b"not under the prefix",
}


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = S3Server("127.0.0.1")
    yield server
    server.close()


@pytest.fixture
def local_s3(s3: S3Server, s3_env: None, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    use(s3, monkeypatch)
    return s3


@pytest.fixture
def fuse() -> None:
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)


@sky.function
def tree(path: str) -> dict[str, str]:
    """Every file under ``path`` (relative name -> text), and whether it is a mount."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full) as f:
                out[os.path.relpath(full, path)] = f.read()
    out["<mount>"] = str(os.path.ismount(path))
    return out


@sky.function
def write(path: str, text: str) -> str:
    """Write ``text`` at ``path`` as a checkpoint is written: a temporary file, renamed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return os.path.abspath(path)


# -- configuration -------------------------------------------------------------------------
def test_volume_fields_and_bad_arguments() -> None:
    v = sky.Volume("s3://bkt/some/prefix", "data")
    assert (v.bucket, v.prefix, v.read_only, v.mode) == ("bkt", "some/prefix", True, "mount")
    with pytest.raises(ConfigurationError, match="mode"):
        sky.Volume("bkt", "data", mode="rsync")
    with pytest.raises(ConfigurationError, match="only S3"):
        sky.Volume("gs://bkt", "data")
    with pytest.raises(ConfigurationError, match="bucket name has no '/'"):
        sky.Volume("bkt/x", "data")
    with pytest.raises(ConfigurationError, match="two volumes"):
        sky.Compute(volumes=[sky.Volume("a", "d"), sky.Volume("b", "d/")])
    with pytest.raises(ConfigurationError, match="takes a list"):
        sky.Compute(volumes=sky.Volume("a", "d"))  # type: ignore[arg-type]


def test_missing_bucket_fails_before_provisioning(local_s3: S3Server, tmp_path: Path) -> None:
    pool = sky.Compute(sky.Local(workdir=str(tmp_path)), volumes=[sky.Volume("no-such", "d")])
    with pytest.raises(ConfigurationError) as e:
        pool.open()
    message = str(e.value)
    assert "'no-such'" in message and "does not exist" in message
    assert "AKIA...0001 (from env)" in message  # the credential used, masked
    assert local_s3.secret_key not in message
    assert os.listdir(tmp_path) == []  # no node was started


def test_no_credentials_fails_before_provisioning(s3_env: None, tmp_path: Path) -> None:
    pool = sky.Compute(sky.Local(workdir=str(tmp_path)), volumes=[sky.Volume("bkt", "d")])
    with pytest.raises(ConfigurationError, match="no AWS credentials found for s3://bkt"):
        pool.open()
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def checking_s3() -> Iterator[CheckingS3Server]:
    server = CheckingS3Server()
    server.client().create_bucket(Bucket="checked")
    server.client().put_object(Bucket="checked", Key="data/a.txt", Body=b"alpha")
    yield server
    server.close()


@pytest.mark.parametrize(
    ("key", "secret", "why"),
    [
        (None, "not-the-secret", "the secret key is wrong"),
        ("AKIAUNKNOWNKEY000000", "whatever", "the access key is not known"),
    ],
)
def test_refused_credentials_fail_before_provisioning(
    checking_s3: CheckingS3Server,
    s3_env: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    key: str | None,
    secret: str,
    why: str,
) -> None:
    """Against a server that checks signatures: the message names the bucket, the reason
    and the key (masked), never the secret."""
    for name, value in checking_s3.env.items():
        monkeypatch.setenv(name, value)
    key = key or checking_s3.key
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    pool = sky.Compute(sky.Local(workdir=str(tmp_path)), volumes=[sky.Volume("checked", "d")])
    with pytest.raises(ConfigurationError) as e:
        pool.open()
    message = str(e.value)
    assert "bucket 'checked'" in message and why in message
    assert f"access key {key[:4]}...{key[-4:]} (from env)" in message
    assert secret not in message
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ["copy", "mount"])
def test_nodes_sign_requests_a_checking_server_accepts(
    checking_s3: CheckingS3Server,
    s3_env: None,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    request: pytest.FixtureRequest,
) -> None:
    """The nodes' SigV4 client (copy) and rclone (mount) against a server that checks
    every signature, the written object included. (Not s3fs: moto's check of a signed
    query string that holds a '/', as s3fs's listings do, refuses what AWS accepts.)"""
    if mode == "mount":
        request.getfixturevalue("fuse")
        monkeypatch.setenv("FLOTILLA_FUSE_TOOL", "rclone")
    for name, value in checking_s3.env.items():
        monkeypatch.setenv(name, value)
    vol = sky.Volume("checked", "d", prefix="data", read_only=False, mode=mode)
    with sky.Compute(volumes=[vol]) as pool:
        assert (tree("d") >> pool)["a.txt"] == "alpha"
        write(f"d/{mode}.txt", "signed") >> pool
    got = checking_s3.client().get_object(Bucket="checked", Key=f"data/{mode}.txt")
    assert got["Body"].read() == b"signed"


# -- copy mode -----------------------------------------------------------------------------
def test_copy_read_only_on_every_local_node(local_s3: S3Server) -> None:
    bucket = local_s3.bucket(OBJECTS)
    vol = sky.Volume(bucket, "vol", prefix="data", mode="copy")
    with sky.Compute(nodes=2, volumes=[vol]) as pool:
        seen = tree("vol") @ pool
    for files in seen:
        assert files == {"a.txt": "alpha", os.path.join("sub", "b.txt"): "beta", "<mount>": "False"}


def test_copy_writable_writes_back_and_a_second_pool_sees_it(local_s3: S3Server) -> None:
    bucket = local_s3.bucket(OBJECTS)
    vol = sky.Volume(bucket, "ckpt", prefix="run1", read_only=False, mode="copy")
    with sky.Compute(nodes=2, volumes=[vol]) as pool:
        write("ckpt/step-3/model.txt", "weights at 3") >> pool
        assert processes_with(local_s3.secret_key.encode()) == []  # not in any argv
    assert local_s3.get(bucket, "run1/step-3/model.txt") == b"weights at 3"
    assert "run1/step-3/model.txt.tmp" not in local_s3.keys(bucket)
    with sky.Compute(nodes=1, volumes=[vol]) as pool:
        assert (tree("ckpt") >> pool)["step-3/model.txt"] == "weights at 3"


def test_copy_writable_syncs_while_the_pool_runs(local_s3: S3Server) -> None:
    bucket = local_s3.bucket()
    vol = sky.Volume(bucket, "out", read_only=False, mode="copy", sync_interval=0.2)
    with sky.Compute(nodes=1, volumes=[vol]) as pool:
        write("out/log.txt", "first") >> pool
        deadline = time.monotonic() + 30
        while "log.txt" not in local_s3.keys(bucket):
            assert time.monotonic() < deadline, "the periodic sync never wrote back"
            time.sleep(0.1)
        assert local_s3.get(bucket, "log.txt") == b"first"


# -- FUSE mount mode -----------------------------------------------------------------------
@pytest.mark.parametrize("tool", ["s3fs", "rclone"])
def test_mount_on_every_local_node_then_nothing_left(
    local_s3: S3Server, fuse: None, tmp_path: Path, tool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOTILLA_FUSE_TOOL", tool)  # the nodes inherit it
    bucket = local_s3.bucket(OBJECTS)
    ro = sky.Volume(bucket, "in", prefix="data")
    rw = sky.Volume(bucket, "out", prefix="results", read_only=False)
    with sky.Compute(sky.Local(workdir=str(tmp_path)), nodes=2, volumes=[ro, rw]) as pool:
        seen = tree("in") @ pool
        assert len(mounts_under(tmp_path)) == 4
        write("out/node0.txt", "from node 0") >> pool
        assert processes_with(local_s3.secret_key.encode()) == []
        daemons = processes_with(bucket.encode())
        assert daemons
    for files in seen:
        assert files == {"a.txt": "alpha", os.path.join("sub", "b.txt"): "beta", "<mount>": "True"}
    assert local_s3.get(bucket, "results/node0.txt") == b"from node 0"
    assert mounts_under(tmp_path) == []
    assert [p for p in daemons if os.path.exists(f"/proc/{p}")] == []


def test_mount_falls_back_to_a_copy_without_fuse(
    local_s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no s3fs nor rclone on the nodes
    bucket = local_s3.bucket(OBJECTS)
    with sky.Compute(volumes=[sky.Volume(bucket, "in", prefix="data")]) as pool:
        files = tree("in") >> pool
    assert files["a.txt"] == "alpha" and files["<mount>"] == "False"


# -- absolute paths on a local pool: each node's own view ------------------------------------
@pytest.fixture
def private_views() -> None:
    """The nodes' mount namespaces: this machine must allow them (root here, as in CI)."""
    import shutil
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("a mount namespace per local node: tested as root (CI runs as root)")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here to check that mount namespaces can be made")
    done = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"this machine gives no process a mount namespace: {done.stderr.strip()}")


def mounted_anywhere(*paths: str | Path) -> list[str]:
    """``pid: mount point`` of every mount at or under ``paths`` in any process's mount
    namespace (the machine's and the nodes' own)."""
    wanted = [str(p) for p in paths]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/mounts") as f:
                points = [line.split()[1] for line in f if len(line.split()) > 1]
        except OSError:
            continue  # gone meanwhile
        for point in points:
            if any(point == w or point.startswith(w.rstrip("/") + "/") for w in wanted):
                found.append(f"{entry}: {point}")
    return found


@sky.function
def view(path: str) -> dict[str, object]:
    """What this node sees at ``path``: whether it is a mount, its device, its files, and
    this node's mount namespace."""
    files = {}
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full) as f:
                files[os.path.relpath(full, path)] = f.read()
    return {
        "mount": os.path.ismount(path),
        "dev": os.stat(path).st_dev,
        "files": files,
        "ns": os.readlink("/proc/self/ns/mnt"),
    }


@sky.function
def write_mine(folder: str, name: str) -> str:
    """Write this node's rank in ``folder/name`` (``{rank}`` in ``name`` is replaced by
    it; a temporary file, renamed); what this node reads back."""
    rank = sky.instance_info().node
    path = os.path.join(folder, name.format(rank=rank))
    with open(path + ".tmp", "w") as f:
        f.write(f"node {rank}")
    os.replace(path + ".tmp", path)
    with open(path) as f:
        return f.read()


def test_an_absolute_mount_is_each_local_nodes_own(
    local_s3: S3Server, fuse: None, private_views: None, tmp_path: Path
) -> None:
    """Issue 43: ``Volume(mount="/abs/path")`` on a 2-node local pool (it was refused:
    "2 nodes of this pool share one filesystem"). Each node mounts the bucket there with
    its own s3fs, in a mount namespace of its own, as on separate machines; this machine's
    view of the path is untouched; nothing stays mounted in any namespace afterwards."""
    bucket = local_s3.bucket(OBJECTS)
    data, out = tmp_path / "abs" / "data", tmp_path / "abs" / "out"
    ro = sky.Volume(bucket, str(data), prefix="data")
    rw = sky.Volume(bucket, str(out), prefix="results", read_only=False)
    nodes = sky.Local(workdir=str(tmp_path / "nodes"))
    with sky.Compute(nodes, nodes=2, volumes=[ro, rw]) as pool:
        seen = view(str(data)) @ pool
        write_mine(str(out), "node{rank}.txt") @ pool  # every node writes its own file
        assert mounted_anywhere(data, out) and mounts_under(tmp_path) == []  # not ours
        daemons = processes_with(bucket.encode())
        assert len(daemons) == 4  # an s3fs per node and volume
    for node in seen:
        assert node["mount"] is True
        assert node["files"] == {"a.txt": "alpha", os.path.join("sub", "b.txt"): "beta"}
    assert seen[0]["dev"] != seen[1]["dev"]  # two mounts, one per node
    assert len({seen[0]["ns"], seen[1]["ns"], os.readlink("/proc/self/ns/mnt")}) == 3
    assert local_s3.get(bucket, "results/node0.txt") == b"node 0"
    assert local_s3.get(bucket, "results/node1.txt") == b"node 1"
    assert wait_until(lambda: not mounted_anywhere(data, out), 30), mounted_anywhere(data, out)
    assert [p for p in daemons if os.path.exists(f"/proc/{p}")] == []
    assert os.listdir(data) == [] and os.listdir(out) == []  # nothing written on the machine


def test_an_absolute_copy_is_each_local_nodes_own(
    local_s3: S3Server, private_views: None, tmp_path: Path
) -> None:
    """Copy mode at an absolute path: each node's copy is its own folder (bound at the
    path in its namespace): two nodes writing the same file each read back their own, the
    bucket gets one whole version, and the machine's folder stays empty."""
    bucket = local_s3.bucket(OBJECTS)
    path = tmp_path / "abs" / "ckpt"
    vol = sky.Volume(bucket, str(path), prefix="data", read_only=False, mode="copy")
    with sky.Compute(sky.Local(workdir=str(tmp_path / "nodes")), nodes=2, volumes=[vol]) as pool:
        mine = write_mine(str(path), "same.txt") @ pool
        seen = view(str(path)) @ pool
    assert mine == ["node 0", "node 1"]
    for rank, node in enumerate(seen):
        assert node["files"]["a.txt"] == "alpha" and node["files"]["same.txt"] == f"node {rank}"
    assert local_s3.get(bucket, "data/same.txt") in (b"node 0", b"node 1")
    assert wait_until(lambda: not mounted_anywhere(path), 30), mounted_anywhere(path)
    assert os.listdir(path) == []


def test_a_killed_agent_leaves_no_mount_at_an_absolute_path(
    local_s3: S3Server, fuse: None, private_views: None, tmp_path: Path
) -> None:
    """kill -9 of a node's agent: its helper (in the node's namespace) sees it end and
    unmounts; nothing stays mounted in any namespace, no FUSE daemon stays."""
    bucket = local_s3.bucket(OBJECTS)
    path = tmp_path / "abs" / "vol"
    rw = sky.Volume(bucket, str(path), prefix="data", read_only=False)
    options = sky.Options(replace_lost_nodes=False)
    nodes = sky.Local(workdir=str(tmp_path / "nodes"))
    with sky.Compute(nodes, nodes=2, volumes=[rw], options=options) as pool:
        assert len(mounted_anywhere(path)) >= 2  # one per node's namespace
        os.kill(agent_pid() >> pool, signal.SIGKILL)
        assert wait_until(lambda: len(processes_with(bucket.encode())) == 1, 30)
    assert wait_until(lambda: not mounted_anywhere(path), 30), mounted_anywhere(path)
    assert processes_with(bucket.encode()) == []
    assert local_s3.keys(bucket) == sorted(OBJECTS)


def test_task_file_mounts_at_absolute_paths_on_a_local_cluster(
    cli: CLI, local_s3: S3Server, fuse: None, private_views: None, tmp_path: Path
) -> None:
    """Issue 43: ``file_mounts: {/abs: s3://...}`` on the local provider (it was refused):
    a read-only copy and a writable mount at absolute paths, on 2 nodes, each its own."""
    bucket = local_s3.bucket(OBJECTS)
    data, ckpt = tmp_path / "abs" / "data", tmp_path / "abs" / "ckpt"
    task = cli.task(
        "task.yaml",
        f"""\
        num_nodes: 2
        file_mounts:
          {data}: s3://{bucket}/data
          {ckpt}:
            source: s3://{bucket}/ckpt
            mode: MOUNT
        run: |
          echo "seen: $(cat {data}/a.txt) $(cat {data}/sub/b.txt)"
          echo "rank $SKYPILOT_NODE_RANK" > {ckpt}/node-$SKYPILOT_NODE_RANK.txt
          echo "mounted: $(grep -c ' {ckpt} fuse' /proc/self/mounts)"
        """,
    )
    env = {**local_s3.env, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
    done = cli.ok("launch", "-c", "absvols", task, env=env)
    assert node_lines(done.stdout, "seen: ") == {0: "alpha beta", 1: "alpha beta"}
    assert node_lines(done.stdout, "mounted: ") == {0: "1", 1: "1"}
    shell = cli.ok("ssh", "absvols", "--node", "1", "--", f"cat {ckpt}/node-1.txt")
    assert shell.stdout == "rank 1\n"  # `flotilla ssh` is in the node's own view
    cli.ok("down", "absvols", "-y", env=env)
    assert local_s3.get(bucket, "ckpt/node-0.txt") == b"rank 0\n"
    assert local_s3.get(bucket, "ckpt/node-1.txt") == b"rank 1\n"
    assert wait_until(lambda: not mounted_anywhere(data, ckpt), 30)
    assert os.listdir(data) == [] and os.listdir(ckpt) == []
    assert processes_with(bucket.encode()) == []


def _python_for_others() -> str | None:
    """An interpreter of this version that another user can run (this one may be in a
    private folder, e.g. under /root), or None."""
    import sysconfig

    version = sysconfig.get_python_version()
    for candidate in (os.path.realpath(sys.executable), f"/usr/bin/python{version}"):
        parts = Path(candidate).parents
        if os.path.exists(candidate) and all(os.stat(p).st_mode & 0o001 for p in parts):
            return candidate
    return None


@pytest.fixture
def plain_user(private_views: None) -> Iterator[tuple[str, Path]]:
    """A user other than root (a unique name, removed afterwards) and a folder of its own
    (in the temp folder: pytest's are root's alone)."""
    import pwd
    import shutil
    import subprocess

    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    name = f"flh3{os.getpid() % 100000}"
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
    entry = pwd.getpwnam(name)
    home = session_folder("user")
    os.chown(home, entry.pw_uid, entry.pw_gid)
    os.chmod(home, 0o755)
    try:
        yield name, home
    finally:

        def theirs() -> list[int]:
            found = []
            for entry_name in os.listdir("/proc"):
                if entry_name.isdigit():
                    try:
                        if os.stat(f"/proc/{entry_name}").st_uid == entry.pw_uid:
                            found.append(int(entry_name))
                    except OSError:
                        continue
            return found

        for pid in theirs():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not theirs(), 60)
        for _ in range(20):  # userdel refuses while a process of the user still exists
            if subprocess.run(["userdel", name], capture_output=True).returncode in (0, 6):
                break
            wait_until(lambda: not theirs(), 5)
        shutil.rmtree(home, ignore_errors=True)


def test_a_user_other_than_root_gets_its_own_view_in_a_user_namespace(
    local_s3: S3Server, plain_user: tuple[str, Path]
) -> None:
    """Not root: each node's namespace is a user namespace that maps the user to itself
    (the tasks keep its uid), and the volumes helper keeps the capability to bind its
    copy (an exec drops it otherwise: "cannot bind ... Operation not permitted"). A path
    this user cannot create is refused before anything starts."""
    import pwd
    import subprocess
    import sysconfig

    python = _python_for_others()
    if python is None:
        pytest.skip("no interpreter of this version that another user can run")
    name, home = plain_user
    entry = pwd.getpwnam(name)
    bucket = local_s3.bucket(OBJECTS)
    path = home / "abs" / "ckpt"
    code = f"""
import os, sys, json
import flotilla as sky

@sky.function
def mine(path):
    rank = sky.instance_info().node
    with open(os.path.join(path, "same.txt"), "w") as f:
        f.write(f"node {{rank}}")
    with open(os.path.join(path, "same.txt")) as f:
        return [os.getuid(), f.read(), sorted(os.listdir(path))]

try:
    sky.Compute(nodes=2, volumes=[sky.Volume({bucket!r}, "/flotilla-h3-nope/x")])
except sky.ConfigurationError as e:
    print("REFUSED", e)
vol = sky.Volume({bucket!r}, {str(path)!r}, prefix="data", read_only=False, mode="copy")
with sky.Compute(sky.Local(workdir={str(home / "nodes")!r}), nodes=2, volumes=[vol]) as pool:
    print("SEEN", json.dumps(mine({str(path)!r}) @ pool))
"""
    paths = [SRC, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env = {
        **local_s3.env,
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.pathsep.join(paths),
        "HOME": str(home),
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_CONFIG_FILE": "/nonexistent",
    }

    def drop() -> None:
        os.setgroups([])
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)

    done = subprocess.run(
        [python, "-c", code],
        env=env,
        cwd=home,
        preexec_fn=drop,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    refused = [line for line in done.stdout.splitlines() if line.startswith("REFUSED")]
    assert (
        refused and "/flotilla-h3-nope/x does not exist and this user cannot create" in (refused[0])
    ), done.stdout
    seen = json.loads(done.stdout.split("SEEN ", 1)[1])
    for rank, (uid, text, files) in enumerate(seen):
        assert uid == entry.pw_uid and text == f"node {rank}"
        assert files == ["a.txt", "same.txt", "sub"]
    assert local_s3.get(bucket, "data/same.txt") in (b"node 0", b"node 1")
    assert wait_until(lambda: not mounted_anywhere(path), 30), mounted_anywhere(path)
    assert os.listdir(path) == []


# -- SSH lab -------------------------------------------------------------------------------
@pytest.fixture
def lab_s3(ssh_lab: Lab, s3_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    server = S3Server(f"{ssh_lab.subnet}.1")  # the hosts reach the bridge's address
    use(server, monkeypatch)
    yield server
    server.close()


@pytest.mark.parametrize("mode", ["copy", "mount"])
def test_ssh_hosts_read_and_write_back(
    ssh_lab: Lab, lab_s3: S3Server, mode: str, request: pytest.FixtureRequest
) -> None:
    if mode == "mount":
        request.getfixturevalue("fuse")
    bucket = lab_s3.bucket(OBJECTS)
    ro = sky.Volume(bucket, f"in-{mode}", prefix="data", mode=mode)
    rw = sky.Volume(bucket, f"out-{mode}", prefix="results", read_only=False, mode=mode)
    hosts = ssh_lab.hosts[:3]
    # a start that never ends (seen twice in full local runs, [copy], never alone) fails
    # with the stage and the nodes it stopped at, before the test's own timeout
    options = sky.Options(start_timeout=90)
    with sky.Compute(ssh_lab.provider(hosts), nodes=3, volumes=[ro, rw], options=options) as pool:
        seen = tree(f"in-{mode}") @ pool
        write(f"out-{mode}/{mode}.txt", "from the lab") >> pool
    for files in seen:
        assert files["a.txt"] == "alpha"
        assert files[os.path.join("sub", "b.txt")] == "beta"
        assert files["<mount>"] == str(mode == "mount")
    assert lab_s3.get(bucket, f"results/{mode}.txt") == b"from the lab"
    assert processes_with(bucket.encode()) == []  # no FUSE daemon left


@sky.function
def agent_pid() -> int:
    return os.getppid()  # the executor's parent: the node's agent


def test_a_killed_agent_leaves_no_mount_and_the_bucket_intact(
    local_s3: S3Server, fuse: None, tmp_path: Path
) -> None:
    """The helper sees its agent's end (its stdin closes) and unmounts; the node's folder
    is removed without walking into the bucket."""
    bucket = local_s3.bucket(OBJECTS)
    rw = sky.Volume(bucket, "vol", prefix="data", read_only=False)
    options = sky.Options(replace_lost_nodes=False)
    with sky.Compute(sky.Local(workdir=str(tmp_path)), volumes=[rw], options=options) as pool:
        os.kill(agent_pid() >> pool, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while mounts_under(tmp_path) or processes_with(bucket.encode()):
            assert time.monotonic() < deadline, "the mount outlived its agent"
            time.sleep(0.05)
    assert local_s3.keys(bucket) == sorted(OBJECTS)
    assert mounts_under(tmp_path) == []


# -- task files ----------------------------------------------------------------------------
def test_task_file_mounts_from_s3_in_every_form(
    cli: CLI, local_s3: S3Server, fuse: None, tmp_path: Path
) -> None:
    """``/p: s3://...`` (a read-only copy), ``{source, mode: MOUNT}`` (a writable mount)
    and a storage entry (``name``, ``store: s3``) on a two-node local cluster."""
    bucket = local_s3.bucket(OBJECTS)
    other = local_s3.bucket({"note.txt": b"stored"})
    task = cli.task(
        "task.yaml",
        f"""\
        num_nodes: 2
        file_mounts:
          ~/data: s3://{bucket}/data
          ~/ckpt:
            source: s3://{bucket}/ckpt
            mode: MOUNT
          ~/store:
            name: {other}
            store: s3
            mode: COPY
            persistent: true
        run: |
          echo "seen: $(cat ~/data/a.txt) $(cat ~/data/sub/b.txt) $(cat ~/store/note.txt)"
          echo "rank $SKYPILOT_NODE_RANK" > ~/ckpt/node-$SKYPILOT_NODE_RANK.txt
        """,
    )
    env = {**local_s3.env, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
    done = cli.ok("launch", "--down", "-c", "vols", task, env=env)
    assert node_lines(done.stdout, "seen: ") == {0: "alpha beta stored", 1: "alpha beta stored"}
    assert local_s3.get(bucket, "ckpt/node-0.txt") == b"rank 0\n"
    assert local_s3.get(bucket, "ckpt/node-1.txt") == b"rank 1\n"
    assert local_s3.secret_key not in done.stdout + done.stderr
    assert mounts_under(tmp_path) == []
    secret = local_s3.secret_key.encode()  # not in any file flotilla wrote
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    assert written and [p for p in written if secret in p.read_bytes()] == []


def test_task_file_with_a_missing_bucket_fails_before_provisioning(
    cli: CLI, local_s3: S3Server
) -> None:
    task = cli.task("task.yaml", "file_mounts:\n  ~/d: s3://no-such-bucket/x\nrun: echo hi\n")
    done = cli("launch", "-c", "nob", task, env=local_s3.env)
    assert done.returncode != 0
    assert "'no-such-bucket'" in done.stderr and "does not exist" in done.stderr
    assert cli.record("nob") is None  # no cluster was started


# -- checkpoints that survive ---------------------------------------------------------------
CHECKPOINTED = """\
    name: checkpointed
    num_nodes: 2
    file_mounts:
      ~/ckpt:
        source: s3://{bucket}/run
        mode: MOUNT
    run: |
      R=$SKYPILOT_NODE_RANK
      mkdir -p ~/ckpt/rank-$R
      step=0
      [ -e ~/ckpt/rank-$R/latest ] && step=$(cat ~/ckpt/rank-$R/latest)
      echo "rank $R resumes from step $step"
      echo "$SKYPILOT_TASK_ID" >> $LOCAL/ids-$R
      first=$step
      while [ $step -lt 6 ]; do
        step=$((step + 1))
        echo $step > ~/ckpt/rank-$R/latest.tmp             # write, then rename
        mv ~/ckpt/rank-$R/latest.tmp ~/ckpt/rank-$R/latest
        if [ $step -eq 3 ] && [ $first -eq 0 ]; then
          echo $$ > $LOCAL/pid-$R
          exec sleep 300                                    # until its node is lost
        fi
      done
      echo "rank $R done at step $step"
"""


@pytest.mark.timeout(150)
def test_a_managed_job_resumes_from_its_bucket_checkpoint_after_a_node_is_killed(
    jobs: Jobs, local_s3: S3Server, fuse: None
) -> None:
    bucket = local_s3.bucket()
    jobs.env.update(local_s3.env)
    task = jobs.task("ckpt.yaml", CHECKPOINTED.format(bucket=bucket))
    launch = jobs.popen("launch", task, "--env", f"LOCAL={jobs.ckpt}")
    try:
        pid_files = [jobs.ckpt / "pid-0", jobs.ckpt / "pid-1"]
        assert wait_until(
            lambda: all(p.exists() and p.read_text().strip() for p in pid_files), 60
        ), "the ranks never reached step 3"
        assert wait_until(lambda: jobs.record().state == "RUNNING", 30)
        os.kill(agent_above(int(pid_files[1].read_text())), signal.SIGKILL)  # node 1 lost
        out, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    rec = jobs.record()
    assert (rec.state, rec.recoveries) == ("SUCCEEDED", 1)
    for rank in (0, 1):
        assert f"rank {rank} resumes from step 3" in out  # the bucket's checkpoint
        assert f"rank {rank} done at step 6" in out
        assert (jobs.ckpt / f"ids-{rank}").read_text().splitlines() == [rec.task_id] * 2
        assert local_s3.get(bucket, f"run/rank-{rank}/latest") == b"6\n"
    assert not [k for k in local_s3.keys(bucket) if k.endswith(".tmp")]
    assert_nothing_left(jobs)
    assert processes_with(bucket.encode()) == []  # no FUSE daemon left


def test_aws_lab_instances_mount_and_copy_a_bucket(aws_lab: AwsLab, fuse: None) -> None:
    """EC2 instances of the moto lab (hosts on its bridge) reach its S3 at the same
    endpoint, with the lab's credentials from the environment."""
    s3 = aws_lab.client("s3")
    bucket = "flotilla-aws-vol"
    s3.create_bucket(Bucket=bucket)
    for key, body in OBJECTS.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    ro = sky.Volume(bucket, "in-aws", prefix="data")
    rw = sky.Volume(bucket, "out-aws", prefix="results", read_only=False, mode="copy")
    with sky.Compute(aws_lab.provider(), nodes=2, volumes=[ro, rw]) as pool:
        seen = tree("in-aws") @ pool
        write("out-aws/ec2.txt", "from an instance") >> pool
    for files in seen:
        assert files["a.txt"] == "alpha" and files["<mount>"] == "True"
    body = s3.get_object(Bucket=bucket, Key="results/ec2.txt")["Body"].read()
    assert body == b"from an instance"
    assert processes_with(bucket.encode()) == []
