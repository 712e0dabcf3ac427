"""Image: node environments built once per content hash, with real installs (uv)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture

import flotilla as sky

SECRET = "s3cr3t-value-never-shown"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh flotilla home (where nodes keep built environments)."""
    home = tmp_path / "home"
    monkeypatch.setenv("FLOTILLA_HOME", str(home))
    return home


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user project with a local package that the nodes do not have."""
    root = tmp_path / "project"
    pkg = root / "shipped_pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("ANSWER = 42\n")
    (pkg / "__pycache__" / "stale.pyc").write_bytes(b"junk")
    (pkg / "notes.tmp").write_text("excluded")
    monkeypatch.chdir(root)
    return root


@sky.function
def import_shipped() -> tuple[int, list[str]]:
    import shipped_pkg  # type: ignore[import-not-found]

    return shipped_pkg.ANSWER, sorted(os.listdir(os.path.dirname(shipped_pkg.__file__)))


def built_envs(home: Path) -> list[Path]:
    envs = home / "envs"
    return sorted(p for p in envs.iterdir() if p.is_dir()) if envs.exists() else []


def test_includes_make_a_local_package_importable(home: Path, project: Path) -> None:
    image = sky.Image(includes=["shipped_pkg"], excludes=["*.tmp"])
    with sky.Compute(nodes=2, image=image) as pool:
        results = import_shipped() @ pool
    assert results == [(42, ["__init__.py"])] * 2  # __pycache__ and *.tmp were not shipped


def test_second_pool_with_the_same_image_builds_nothing(
    home: Path, project: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    image = sky.Image(includes=["shipped_pkg"], setup=["echo built >> build-count.txt"])
    with sky.Compute(nodes=2, image=image) as pool:
        import_shipped() @ pool
    first = capfd.readouterr().err
    assert "building environment: setup" in first
    [env] = built_envs(home)
    assert (env / "build-count.txt").read_text() == "built\n"  # two nodes, one build

    with sky.Compute(nodes=2, image=image) as pool:
        assert import_shipped() @ pool == [(42, ["__init__.py", "notes.tmp"])] * 2
    assert "building environment" not in capfd.readouterr().err
    assert (env / "build-count.txt").read_text() == "built\n"
    assert built_envs(home) == [env]


def test_requirements_the_node_already_has_are_not_installed(
    home: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with sky.Compute(nodes=1, image=sky.Image(pip=["numpy", "cloudpickle>=2"])):
        pass
    assert "building environment: pip" in capfd.readouterr().err
    [env] = built_envs(home)
    assert list((env / "site").iterdir()) == []


def test_a_missing_package_is_installed_with_uv(home: Path) -> None:
    @sky.function
    def use_it() -> str:
        import humanize  # type: ignore[import-not-found]

        return str(humanize.__file__)

    with sky.Compute(nodes=1, image=sky.Image(pip=["humanize"])) as pool:
        where = use_it() >> pool
    [env] = built_envs(home)
    assert where.startswith(str(env / "site"))
    assert not (env / "site" / "numpy").exists()


def test_failing_setup_names_node_step_exit_code_and_output(home: Path) -> None:
    image = sky.Image(setup=["echo preparing; echo second line >&2; exit 3"])
    before = _agents(home)
    with pytest.raises(sky.ProvisionError) as info, sky.Compute(nodes=2, image=image):
        pass
    msg = str(info.value)
    assert msg.startswith("node ")
    assert "step 'setup'" in msg and "exit code 3" in msg
    assert "preparing" in msg and "second line" in msg
    assert built_envs(home) == []  # nothing half-built is kept
    _wait_gone(_agents(home) - before)


def test_secrets_never_appear_in_output_or_errors(
    home: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    image = sky.Image(
        env={"HF_TOKEN": SECRET, "PLAIN": "visible", "OTHER": sky.Secret(SECRET + "2")},
        setup=["echo token=$HF_TOKEN other=$OTHER; exit 1"],
    )
    assert SECRET not in repr(image)
    with pytest.raises(sky.ProvisionError) as info, sky.Compute(nodes=1, image=image):
        pass
    out, err = capfd.readouterr()
    for text in (str(info.value), out, err):
        assert SECRET not in text
    assert "token=*** other=***" in str(info.value)


def test_env_reaches_tasks_with_secrets_unwrapped(home: Path) -> None:
    @sky.function
    def read() -> tuple[str, str]:
        return os.environ["HF_TOKEN"], os.environ["PLAIN"]

    image = sky.Image(env={"HF_TOKEN": sky.Secret(SECRET), "PLAIN": "visible"})
    with sky.Compute(nodes=1, image=image) as pool:
        assert read() >> pool == (SECRET, "visible")
    assert built_envs(home) == []  # env alone needs no build


def test_wrong_python_version_fails_in_the_python_step(home: Path) -> None:
    """A patch release the node lacks (another minor version is refused earlier, at
    Compute(): tests/test_interpreter.py)."""
    wanted = "%d.%d.99" % sys.version_info[:2]  # noqa: UP031
    with (
        pytest.raises(sky.ProvisionError, match="step 'python'") as info,
        sky.Compute(nodes=1, image=sky.Image(python=wanted)),
    ):
        pass
    assert f"the image asks for {wanted}" in str(info.value)


def test_bad_images_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        sky.Image(includes=[str(tmp_path / "no-such-dir")])
    with pytest.raises(ValueError, match="Debian package name"):
        sky.Image(apt=["Bad Name!"])
    with pytest.raises(ValueError, match=r"3\.11"):
        sky.Image(python="eleven")
    with pytest.raises(ValueError, match="environment variable name"):
        sky.Image(env={"1BAD": "x"})
    for option in ("--index-url=https://evil.example/simple", "-r", "-rrequirements.txt"):
        with pytest.raises(sky.ConfigurationError, match="installer option, not a requirement"):
            sky.Image(pip=["numpy", option])
    with pytest.raises(sky.ConfigurationError, match="not a requirement specifier"):
        sky.Image(pip=["numpy >= = 2"])
    sky.Image(pip=["numpy>=1.26", "pkg @ https://example.com/pkg.whl", "git+https://x/y.git"])
    with pytest.raises(TypeError, match=r"flotilla\.Image"):
        sky.Compute(image="python:3.11").open()  # type: ignore[arg-type]


def test_image_hash_follows_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mod.py").write_text("X = 1\n")
    a = sky.Image(pip=["numpy"], includes=["mod.py"])
    spec_a = a.build_spec(a.includes_archive())
    assert spec_a == a.build_spec(a.includes_archive())  # deterministic
    (tmp_path / "mod.py").write_text("X = 2\n")
    assert a.build_spec(a.includes_archive())["hash"] != spec_a["hash"]
    b = sky.Image(pip=["numpy"], includes=["mod.py"], env={"A": "1"})
    assert b.build_spec(b.includes_archive())["hash"] == a.build_spec(a.includes_archive())["hash"]


def _agents(home: Path) -> set[int]:
    """This test's agents and environment builds: those started with its flotilla home
    (not another pool's on this machine, which may come and go meanwhile)."""
    mine = f"FLOTILLA_HOME={home}".encode()
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if (b"flotilla.agent" in cmd or b"flotilla._node.build" in cmd) and mine in env:
                out.add(int(pid))
    return out


def _wait_gone(pids: set[int], timeout: float = 60.0) -> None:
    """Wait until ``pids`` have ended: that they end is the behaviour; how fast is the
    benchmarks' (a loaded machine took more than 5 s)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = {p for p in pids if _alive(p)}
        if not alive:
            return
        time.sleep(0.02)
    raise AssertionError(f"processes still running: {alive}")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


needs_apt = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("apt-get") is None,
    reason="installing apt packages needs root and apt-get (CI runs as root)",
)


def _installed(package: str) -> bool:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True)
    return out.stdout.strip().endswith(b"installed")


@sky.function
def tree_version() -> str:
    return subprocess.run(["tree", "--version"], capture_output=True, text=True).stdout


@needs_apt
def test_a_missing_apt_package_is_installed_by_the_build(home: Path) -> None:
    had = _installed("tree")
    if had:
        subprocess.run(["dpkg", "-r", "tree"], check=True, capture_output=True)
    try:
        with sky.Compute(nodes=2, image=sky.Image(apt=["tree"])) as pool:
            assert all(v.startswith("tree v") for v in tree_version() @ pool)
        assert _installed("tree")
    finally:
        if not had:
            subprocess.run(["dpkg", "-r", "tree"], capture_output=True)


@needs_apt
def test_an_apt_package_that_cannot_be_installed_fails_the_apt_step(home: Path) -> None:
    image = sky.Image(apt=["flotilla-no-such-package"])
    with pytest.raises(sky.ProvisionError) as info, sky.Compute(nodes=1, image=image):
        pass
    msg = str(info.value)
    assert msg.startswith("node 0") and "step 'apt'" in msg and "exit code 100" in msg
    assert "Unable to locate package flotilla-no-such-package" in msg


def test_a_build_stopped_midway_leaves_no_half_built_folder(home: Path, tmp_path: Path) -> None:
    """Ctrl-C while a node builds its Image: the build stops and removes its half-built
    folder before the client returns."""
    import signal
    import sys
    import textwrap

    from _procs import interruptible, wait_until

    started = tmp_path / "building"
    script = tmp_path / "client.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import flotilla as sky
            image = sky.Image(setup=["touch {started}; sleep 60"])
            with sky.Compute(nodes=1, image=image):
                pass
            """
        )
    )
    src = str(Path(sky.__file__).resolve().parents[1])
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": src},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=interruptible,  # it is sent Ctrl-C (SIGINT)
    )
    try:
        assert wait_until(started.exists, 60.0), "the build did not start"
        half = [p.name for p in (home / "envs").iterdir() if ".tmp-" in p.name]
        assert len(half) == 1, half
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) != 0
    finally:
        proc.kill()
        proc.wait()
    assert built_envs(home) == []


def test_a_killed_builders_folder_is_removed_by_the_next_build(home: Path) -> None:
    """A builder killed outright (SIGKILL: no time to clean up) leaves its temporary
    folder; the next build of that environment, holding its lock, removes it."""
    image = sky.Image(setup=["echo built > marker.txt"])
    with sky.Compute(nodes=1, image=image):
        pass
    (env,) = built_envs(home)
    shutil.rmtree(env)
    stale = env.parent / f"{env.name}.tmp-killed"
    (stale / "site").mkdir(parents=True)
    with sky.Compute(nodes=1, image=image):
        pass
    assert built_envs(home) == [env]
    assert (env / "marker.txt").read_text() == "built\n"


CLIENT = """
import flotilla as sky

@sky.function
def where() -> str:
    import iniconfig

    return iniconfig.__file__

with sky.Compute(nodes=1, image=sky.Image(pip=["iniconfig"])) as pool:
    print(where() >> pool)
"""


def bare_venv(folder: Path) -> Path:
    """A virtualenv of this Python with flotilla's dependencies and uv only, none of
    this environment's other packages (iniconfig): its interpreter."""
    subprocess.run(
        [getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", folder],
        check=True,
    )
    deps = folder / "deps"
    deps.mkdir()
    import importlib

    for name in (
        "cloudpickle",
        "yaml",
        "rich",
        "markdown_it",
        "mdurl",
        "pygments",
        "pathspec",
        "packaging",
        "uv",
    ):
        module = importlib.import_module(name)
        assert module.__file__ is not None
        (deps / name).symlink_to(Path(module.__file__).parent)
    [site] = folder.glob("lib/python*/site-packages")
    (site / "deps.pth").write_text(f"{deps}\n")
    (folder / "bin" / "uv").symlink_to(Path(sys.executable).parent / "uv")  # uv.find_uv_bin()
    return folder / "bin" / "python"


def run_client(python: Path | str, home: Path, folder: Path) -> str:
    """Run ``CLIENT`` with ``python`` (this checkout's flotilla): what it printed."""
    script = folder / "client.py"
    script.write_text(CLIENT)
    src = str(Path(sky.__file__).parent.parent)
    env = dict(os.environ, FLOTILLA_HOME=str(home), PYTHONPATH=src)
    proc = subprocess.run(
        [str(python), str(script)], cwd=folder, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_an_environment_built_for_one_interpreter_is_not_reused_by_another(
    home: Path, tmp_path: Path
) -> None:
    """One FLOTILLA_HOME, two programs with one Image: the first's interpreter has
    iniconfig (its environment is empty), the second's has not: it builds its own
    environment, with iniconfig, and the first still finds its own."""
    here = run_client(sys.executable, home, tmp_path)
    assert not here.startswith(str(home))  # the interpreter's own
    [first] = built_envs(home)
    assert list((first / "site").iterdir()) == []

    other = bare_venv(tmp_path / "bare")
    there = run_client(other, home, tmp_path)
    [second] = [e for e in built_envs(home) if e != first]
    assert there.startswith(str(second / "site"))

    assert run_client(sys.executable, home, tmp_path) == here
    assert len(built_envs(home)) == 2


PROBE = "flotilla-probe-pkg"
"""A package of this test's making, served from a local index (the SSH test hosts have no
internet)."""


def probe_index(folder: Path) -> tuple[str, Path]:
    """A wheel of ``PROBE`` (module ``flotilla_probe``) in a simple index under ``folder``,
    and the same unpacked: (the index's URL, the unpacked folder)."""
    unpacked = folder / "unpacked"
    wheel = make_wheel(folder, PROBE, "1.0", "flotilla_probe", unpacked)
    return simple_index(folder, [wheel]), unpacked


def simple_index(folder: Path, wheels: list[Path]) -> str:
    """A PEP 503 index of ``wheels`` under ``folder``: its file:// URL."""
    for wheel in wheels:
        project = wheel.name.split("-")[0].replace("_", "-")
        page = folder / "simple" / project / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        with page.open("a") as f:
            f.write(f'<a href="{wheel.as_uri()}">{wheel.name}</a>\n')
    return (folder / "simple").as_uri() + "/"


def make_wheel(
    folder: Path, name: str, version: str, module: str, unpacked: Path | None = None
) -> Path:
    """A pure-Python wheel of ``name`` ``version`` with an empty ``module`` in ``folder``
    (unpacked also into ``unpacked`` when given): its path."""
    import base64
    import hashlib
    import zipfile

    info = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{n},sha256={digest(d)},{len(d)}\n" for n, d in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    wheel = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
            if unpacked is not None:
                (unpacked / path).parent.mkdir(parents=True, exist_ok=True)
                (unpacked / path).write_bytes(data)
    return wheel


@sky.function
def probe_versions() -> tuple[str, str]:
    import importlib.metadata as md

    return md.version("flotilla-probe-a"), md.version("flotilla-probe-b")


def test_an_index_scoped_to_packages_serves_only_them(home: Path, tmp_path: Path) -> None:
    """The scoped index (as PyTorch's) has both packages in a newer version, and comes
    first: only the package it is scoped to comes from it, the other from the next index."""
    scoped = simple_index(
        tmp_path / "scoped",
        [make_wheel(tmp_path / "scoped", f"flotilla-probe-{p}", "2.0", f"probe_{p}") for p in "ab"],
    )
    shared = simple_index(
        tmp_path / "shared",
        [make_wheel(tmp_path / "shared", f"flotilla-probe-{p}", "1.0", f"probe_{p}") for p in "ab"],
    )
    image = sky.Image(
        pip=["flotilla-probe-a", "flotilla-probe-b"],
        pip_indexes=[scoped, shared],
        pip_index_packages={scoped: ["flotilla-probe-a"]},
    )
    with sky.Compute(nodes=1, image=image) as pool:
        assert probe_versions() >> pool == ("2.0", "1.0")


@sky.function
def where_probe() -> str:
    import flotilla_probe  # type: ignore[import-not-found]

    return str(flotilla_probe.__file__)


def test_over_ssh_an_environment_is_kept_per_interpreter(ssh_lab: Lab, tmp_path: Path) -> None:
    """One host and its work folder, one Image, SSH(python=...) changed: the first
    interpreter has the package (its environment is empty), the second has not: it gets
    an environment of its own, with the package."""
    base = ssh_lab.shared / tmp_path.name  # the index and interpreters: the host sees them
    base.mkdir()
    index, unpacked = probe_index(base)
    has_it, lacks_it = bare_venv(base / "has"), bare_venv(base / "lacks")
    [site] = (base / "has").glob("lib/python*/site-packages")
    (site / "probe.pth").write_text(f"{unpacked}\n")
    hosts = ssh_lab.hosts[:1]
    envs = ssh_lab.tmp / "workdir" / "envs"  # on the host
    seen = hosts[0].path(envs)  # (its /tmp is its own)
    before = {p.name for p in seen.iterdir()} if seen.exists() else set()
    image = sky.Image(pip=[PROBE], pip_indexes=[index])
    provider = ssh_lab.provider(hosts, python=str(has_it))
    with sky.Compute(provider=provider, nodes=1, image=image) as pool:
        assert where_probe() >> pool == str(unpacked / "flotilla_probe" / "__init__.py")
    provider = ssh_lab.provider(hosts, python=str(lacks_it))
    with sky.Compute(provider=provider, nodes=1, image=image) as pool:
        there = where_probe() >> pool
    made = {p.name for p in seen.iterdir() if p.is_dir()} - before
    assert len(made) == 2, made
    assert any(there.startswith(str(envs / name / "site")) for name in made), (there, made)
