"""One interpreter on both sides: nodes with another Python than the client's run the
client's functions on a matching interpreter found on the node, or are refused before any
task runs; Debian's Python 3.11.2 (tarfile without ``filter=``) extracts safely.

The node interpreters are this machine's: Debian's ``/usr/bin/python3`` (installed with
apt when missing, as root) and pyenv's other minor versions (a test skips, saying so, when
the one it needs is not here). SSH nodes are the test hosts of ``_hosts.py``, each with
its own PATH and, where a test needs it, without this machine's Python 3.11s.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _hosts import Lab, TestHost, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture
from test_cli import CLI, node_lines, ssh_flags

import flotilla as sky
from flotilla._errors import ConfigurationError, ProvisionError
from flotilla.cli.state import Paths

CLIENT = "%d.%d" % sys.version_info[:2]  # noqa: UP031
SRC = str(Path(__file__).resolve().parent.parent / "src")
DEBIAN = "/usr/bin/python3"
MakeHost = Callable[..., TestHost]
"""``host_with(python, hide=False, **env)``: a test host whose ``python3`` is ``python``."""


# -- the interpreters of this machine --------------------------------------------------------
def debian_python() -> str:
    """Debian's own ``/usr/bin/python3`` (installed with apt when missing and root)."""
    if not os.path.exists(DEBIAN):
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            pytest.skip(f"needs Debian's {DEBIAN} (apt-get install python3, as root)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "python3"]
        if subprocess.run(install, capture_output=True, env=env).returncode != 0:
            subprocess.run(["apt-get", "update"], capture_output=True, env=env)
            subprocess.run(install, capture_output=True, env=env)
        if not os.path.exists(DEBIAN):
            pytest.skip(f"cannot install Debian's python3 for {DEBIAN}")
    return DEBIAN


def version_of(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def pyenv_python(minor: str) -> str:
    """pyenv's Python ``minor`` on this machine (the test skips when there is none)."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found = sorted(glob.glob(os.path.join(root, "versions", f"{minor}.*", "bin", f"python{minor}")))
    found = [p for p in found if os.path.basename(os.path.dirname(os.path.dirname(p)))[-1:] != "t"]
    if not found:
        pytest.skip(f"needs a Python {minor} (pyenv's, under {root}/versions): none here")
    return found[-1]


def node_minor(minor: str) -> str:
    """pyenv's Python ``minor``, for a node on another minor version than the client's."""
    if minor == CLIENT:
        pytest.skip(f"{minor} is the client's own minor version")
    return pyenv_python(minor)


def other_minor(*minors: str) -> str:
    """The first of ``minors`` that is not the client's, as pyenv has it."""
    return pyenv_python(next(m for m in minors if m != CLIENT))


def client_pythons() -> list[str]:
    """Every ``python3.X`` of the client's minor version on this machine (hidden on a node
    that must not find one; their libraries stay)."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    name = f"python{CLIENT}"
    out = glob.glob(f"/usr/bin/{name}") + glob.glob(f"/usr/local/bin/{name}")
    out += glob.glob(os.path.join(root, "versions", f"{CLIENT}.*", "bin", name))
    return sorted({os.path.realpath(p) for p in out} | set(out))


@sky.function
def version() -> str:
    return "%d.%d.%d" % sys.version_info[:3]  # noqa: UP031


@sky.function
def touch(path: str) -> str:
    Path(path).write_text("ran")
    return "%d.%d.%d" % sys.version_info[:3]  # noqa: UP031


# -- safe extraction, on every supported patch release ------------------------------------
def _tar(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def _member(
    name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


UNSAFE = {
    "absolute": _tar((_member("/tmp/flotilla-untar-abs"), b"x")),
    "dotdot": _tar((_member("a/../../escaped"), b"x")),
    "symlink-absolute": _tar((_member("l", tarfile.SYMTYPE, "/etc"), b"")),
    "symlink-out": _tar((_member("d/l", tarfile.SYMTYPE, "../../.."), b"")),
    "hardlink-out": _tar((_member("h", tarfile.LNKTYPE, "/etc/passwd"), b"")),
    "device": _tar((_member("dev", tarfile.CHRTYPE), b"")),
    "fifo": _tar((_member("fifo", tarfile.FIFOTYPE), b"")),
}
GOOD = _tar(
    (_member("pkg", tarfile.DIRTYPE, mode=0o755), b""),
    (_member("pkg/run.sh", mode=0o4755), b"echo hi\n"),
    (_member("pkg/data.txt", mode=0o666), b"data"),
    (_member("pkg/alias", tarfile.SYMTYPE, "data.txt"), b""),
)
_PROBE = """
import io, os, sys, tarfile
from flotilla._system import untar
from flotilla.cli.state import Paths
dest = sys.argv[1]
with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read()), mode="r:gz") as tar:
    try:
        untar.extract(tar, dest)
    except untar.UnsafeArchive as e:
        print("REFUSED", e)
        sys.exit(0)
print("OK", hasattr(tarfile, "data_filter"))
"""


def _untar_with(python: str, data: bytes, dest: Path) -> str:
    dest.mkdir()
    proc = subprocess.run(
        [python, "-c", _PROBE, str(dest)],
        input=data,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode().strip()


@pytest.fixture(params=["client", "debian"])
def python(request: pytest.FixtureRequest) -> str:
    return sys.executable if request.param == "client" else debian_python()


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_archives_are_refused_whole(python: str, case: str, tmp_path: Path) -> None:
    answer = _untar_with(python, UNSAFE[case], tmp_path / "dest")
    assert answer.startswith("REFUSED"), answer
    assert list((tmp_path / "dest").iterdir()) == []
    assert not os.path.exists("/tmp/flotilla-untar-abs") and not (tmp_path / "escaped").exists()


def test_a_safe_archive_extracts_with_tame_permissions(python: str, tmp_path: Path) -> None:
    answer = _untar_with(python, GOOD, tmp_path / "dest")
    assert answer.startswith("OK"), answer
    pkg = tmp_path / "dest" / "pkg"
    assert (pkg / "run.sh").read_text() == "echo hi\n"
    assert os.readlink(pkg / "alias") == "data.txt"
    assert (pkg / "run.sh").stat().st_mode & 0o7777 == 0o755  # no set-user-ID
    assert (pkg / "data.txt").stat().st_mode & 0o777 == 0o644  # others cannot write


def test_debian_python_lacks_the_filter_and_uses_the_helper_s_own_rules(tmp_path: Path) -> None:
    python = debian_python()
    answer = _untar_with(python, GOOD, tmp_path / "dest")
    if version_of(python) >= "3.11.4":
        pytest.skip(f"{python} is {version_of(python)}: it has tarfile's filter")
    assert answer == "OK False"


# -- the Image's python -------------------------------------------------------------------
def test_image_python_of_another_minor_is_refused_when_the_pool_is_made() -> None:
    other = "3.12" if CLIENT != "3.12" else "3.13"
    with pytest.raises(ConfigurationError) as info:
        sky.Compute(image=sky.Image(python=other))
    msg = str(info.value)
    assert f"Image(python='{other}')" in msg and f"Python {CLIENT}." in msg
    assert sky.Compute(image=sky.Image(python=CLIENT)).state is sky.PoolState.NEW


# -- the local provider -------------------------------------------------------------------
def test_local_with_debian_python_runs_without_the_client_s_paths() -> None:
    python = debian_python()
    if version_of(python).rpartition(".")[0] != CLIENT:
        pytest.skip(f"{python} is not Python {CLIENT}, the client's")
    with sky.Compute(provider=sky.Local(python=python), nodes=1) as pool:
        assert version() >> pool == version_of(python)


@pytest.mark.parametrize("minor", ["3.12", "3.13"])
def test_local_with_another_minor_is_refused_before_any_task(minor: str, tmp_path: Path) -> None:
    python = node_minor(minor)
    marker = tmp_path / "ran"
    with (
        pytest.raises(ProvisionError) as info,
        sky.Compute(provider=sky.Local(python=python), nodes=1) as pool,
    ):
        touch(str(marker)) >> pool
    msg = str(info.value)
    assert f"runs Python {version_of(python)}" in msg and f"client runs Python {CLIENT}." in msg
    assert "Local(python=" in msg and f"Image(python='{CLIENT}')" in msg
    assert f"run this client on Python {minor}" in msg
    assert not marker.exists()


# -- SSH hosts ---------------------------------------------------------------------------------
@pytest.fixture
def host_with(ssh_lab: Lab, tmp_path: Path) -> Iterator[MakeHost]:
    """Makes a test host whose ``python3`` is ``python`` (``hide``: its Python 3.Xs of
    the client's minor version are gone); removed after the test."""
    made = []

    def make(python: str, hide: bool = False, **env: str) -> TestHost:
        bin_dir = tmp_path / f"bin{len(made)}"
        bin_dir.mkdir()
        (bin_dir / "python3").symlink_to(python)
        if "uv" in env:
            (bin_dir / "uv").symlink_to(env.pop("uv"))
        hidden = tuple(client_pythons()) if hide else ()
        env["PATH"] = f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"
        host = ssh_lab.add_host(env=env, hidden=hidden)
        made.append(host)
        seen = host.path(bin_dir)  # the same folder on the host (its /tmp is its own)
        seen.mkdir(parents=True)
        for link in bin_dir.iterdir():
            (seen / link.name).symlink_to(os.readlink(link))
        return host

    yield make
    for host in made:
        ssh_lab.remove_host(host)


def test_ssh_debian_python_with_includes(ssh_lab: Lab, tmp_path: Path) -> None:
    python = debian_python()
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("ANSWER = 42\n")
    image = sky.Image(includes=[str(pkg)])

    @sky.function
    def answer() -> tuple[int, str]:
        import mypkg  # type: ignore[import-not-found]

        return mypkg.ANSWER, "%d.%d.%d" % sys.version_info[:3]  # noqa: UP031

    # a fresh workdir: the bundle is installed by that interpreter too
    provider = ssh_lab.provider([ssh_lab.hosts[0]], python=python, workdir=str(tmp_path / "w"))
    with sky.Compute(provider=provider, nodes=1, image=image) as pool:
        assert answer() >> pool == (42, version_of(python))


@pytest.mark.parametrize("minor", ["3.12", "3.13"])
def test_ssh_another_minor_runs_on_a_python_found_on_the_node(
    host_with: MakeHost, ssh_lab: Lab, capfd: pytest.CaptureFixture[str], minor: str
) -> None:
    node_python = node_minor(minor)
    host = host_with(node_python)
    with sky.Compute(provider=ssh_lab.provider([host]), nodes=1) as pool:
        ran = version() >> pool
    assert ran.rpartition(".")[0] == CLIENT
    err = capfd.readouterr().err
    assert f"runs on Python {ran}" in err and f"is Python {version_of(node_python)}" in err


@pytest.mark.parametrize("minor", ["3.12", "3.13"])
def test_ssh_another_minor_without_a_match_is_refused_before_any_task(
    host_with: MakeHost, ssh_lab: Lab, tmp_path: Path, minor: str
) -> None:
    node_python = node_minor(minor)
    host = host_with(node_python, hide=True)
    marker = tmp_path / "ran"
    with (
        pytest.raises(ProvisionError) as info,
        sky.Compute(provider=ssh_lab.provider([host]), nodes=1) as pool,
    ):
        touch(str(marker)) >> pool
    msg = str(info.value)
    assert msg.startswith(f"node 0 ({host.addr}): the node runs Python {version_of(node_python)}")
    assert f"client runs Python {CLIENT}." in msg and "none was found on the node" in msg
    assert "SSH(python=" in msg and f"Image(python='{CLIENT}')" in msg
    assert not host.path(marker).exists()


def _mirror(root: Path) -> tuple[str, str]:
    """A python-build-standalone mirror in ``root`` holding one "install_only" archive made
    from the client's own interpreter (its binary, libpython and standard library), and
    uv's download list naming it (as a release of version CLIENT.99, so that it is the
    newest): (mirror URL, list path)."""
    base = Path(sys.base_prefix)
    name = f"python{CLIENT}"
    if not (base / "bin" / name).exists() or not (base / "lib" / name / "os.py").exists():
        pytest.skip(f"the client's interpreter under {base} is not laid out as bin/ + lib/")
    stage = root / "stage" / "python"
    (stage / "bin").mkdir(parents=True)
    (stage / "lib").mkdir()
    shutil.copy2(base / "bin" / name, stage / "bin" / name)
    (stage / "bin" / "python3").symlink_to(name)
    for lib in glob.glob(str(base / "lib" / "libpython*.so*")):
        shutil.copy2(lib, stage / "lib" / os.path.basename(lib), follow_symlinks=False)
    skip = shutil.ignore_patterns("site-packages", "test", "__pycache__", "idlelib", "tkinter")
    shutil.copytree(base / "lib" / name, stage / "lib" / name, symlinks=True, ignore=skip)
    (stage / "lib" / name / "site-packages").mkdir()
    tag = "20250101"
    archive = f"cpython-{CLIENT}.99+{tag}-x86_64-unknown-linux-gnu-install_only.tar.gz"
    (root / tag).mkdir()
    with tarfile.open(root / tag / archive, "w:gz", compresslevel=1) as tar:
        tar.add(stage, "python")
    digest = hashlib.sha256((root / tag / archive).read_bytes()).hexdigest()
    major, minor = CLIENT.split(".")
    listing = {
        f"cpython-{CLIENT}.99-linux-x86_64-gnu": {
            "name": "cpython",
            "arch": {"family": "x86_64", "variant": None},
            "os": "linux",
            "libc": "gnu",
            "major": int(major),
            "minor": int(minor),
            "patch": 99,
            "prerelease": "",
            "url": "https://github.com/astral-sh/python-build-standalone/releases/download/"
            f"{tag}/{archive}",
            "sha256": digest,
            "variant": None,
        }
    }
    (root / "downloads.json").write_text(json.dumps(listing))
    return f"file://{root}", str(root / "downloads.json")


def test_ssh_image_python_installs_one_with_uv_from_the_mirror(
    host_with: MakeHost, ssh_lab: Lab, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """No Python of the client's minor version on the node, Image(python=...) given: uv
    installs one from UV_PYTHON_INSTALL_MIRROR (the Image's env). The mirror is local (no
    network here); uv's own list of downloads names GitHub's releases, with their hashes,
    so the node's UV_PYTHON_DOWNLOADS_JSON_URL names the mirror's own list."""
    if platform.machine() != "x86_64":
        pytest.skip("the mirror's archive is named for x86_64 Linux")
    uv = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if uv is None:
        pytest.skip("needs uv (the dev extra installs it)")
    mirror, listing = _mirror(tmp_path / "mirror")
    installs = tmp_path / "uv-pythons"
    host = host_with(
        other_minor("3.13", "3.12"),
        hide=True,
        uv=os.path.realpath(uv),
        UV_PYTHON_INSTALL_DIR=str(installs),
        UV_PYTHON_DOWNLOADS_JSON_URL=listing,
    )
    shutil.copytree(tmp_path / "mirror", host.path(tmp_path / "mirror"))  # the host's own /tmp
    image = sky.Image(python=CLIENT, env={"UV_PYTHON_INSTALL_MIRROR": mirror})

    @sky.function
    def where() -> str:
        return sys.executable

    with sky.Compute(provider=ssh_lab.provider([host]), nodes=1, image=image) as pool:
        ran, executable = version() >> pool, where() >> pool
    assert ran.rpartition(".")[0] == CLIENT
    assert executable.startswith(str(installs) + os.sep)
    assert "installed on the node" in capfd.readouterr().err


def test_ssh_named_python_of_another_minor_is_only_checked(ssh_lab: Lab) -> None:
    node_python = other_minor("3.13", "3.12")
    provider = ssh_lab.provider([ssh_lab.hosts[0]], python=node_python)
    with (
        pytest.raises(ProvisionError, match=r"was named with SSH\(python=\.\.\.\)"),
        sky.Compute(provider=provider, nodes=1) as pool,
    ):
        version() >> pool


def test_ssh_python_3_10_is_refused(ssh_lab: Lab) -> None:
    python = pyenv_python("3.10")
    provider = ssh_lab.provider([ssh_lab.hosts[0]], python=python)
    with pytest.raises(ProvisionError, match=r"is Python 3\.10; flotilla needs Python >= 3\.11"):
        sky.Compute(provider=provider, nodes=1).open()


def test_cli_workdir_on_debian_python(ssh_lab: Lab, tmp_path: Path) -> None:
    python = debian_python()
    cli = CLI(tmp_path / "home", tmp_path)
    try:
        (tmp_path / "project").mkdir()
        (tmp_path / "project" / "hello.txt").write_text("from the workdir\n")
        task = cli.task(
            "task.yaml",
            f"""\
            workdir: {tmp_path / "project"}
            run: echo "READ $(cat hello.txt)"
            """,
        )
        flags = ssh_flags(ssh_lab, ssh_lab.hosts[:1], tmp_path / "remote-workdir")
        done = cli.ok("launch", task, "-c", "deb", *flags, "--ssh-python", python)
        assert node_lines(done.stdout, "READ") == {0: "from the workdir"}
    finally:
        cli.clean_up()


def test_cli_launch_finds_a_python_or_refuses_before_the_run(
    host_with: MakeHost, ssh_lab: Lab, tmp_path: Path
) -> None:
    """``flotilla launch`` starts its pool through the same path: a host whose python3 is
    another minor version runs the task on a Python found there (the cluster's console,
    its daemon's log, says which); one named with ``--ssh-python`` is refused, and the
    task's commands never run."""
    node_python = other_minor("3.13", "3.12")
    cli = CLI(tmp_path / "home", tmp_path)
    marker = tmp_path / "ran"
    task = cli.task("task.yaml", f"run: touch {marker}\n")
    try:
        host = host_with(node_python)
        cli.ok("launch", task, "-c", "found", *ssh_flags(ssh_lab, [host], tmp_path / "w"))
        log = Paths("found", cli.home).daemon_log.read_text()
        assert f"runs on Python {CLIENT}." in log
        assert host.path(marker).exists()  # in the host's own /tmp
        other = ssh_lab.hosts[0]
        other.path(tmp_path).mkdir(parents=True, exist_ok=True)
        marker = other.path(marker)  # where the refused task would have made it
        flags = ssh_flags(ssh_lab, ssh_lab.hosts[:1], tmp_path / "w")
        refused = cli("launch", task, "-c", "pinned", *flags, "--ssh-python", node_python)
        assert refused.returncode != 0
        assert f"the node runs Python {version_of(node_python)}" in refused.stderr
        assert f"this client runs Python {CLIENT}." in refused.stderr
        assert not marker.exists()
    finally:
        cli.clean_up()
