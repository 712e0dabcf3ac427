"""A container lab: podman running containers from a root filesystem built here (no registry
is reachable): empty folders, with this machine's ``/usr``, this interpreter's installation
and this virtual environment bind-mounted read-only, so the containers run the client's
Python (torch included). Every container writes to an overlay of its own (``--rootfs DIR:O``).

Where podman's defaults cannot start a container (this test machine: crun cannot raise
RLIMIT_NOFILE and refuses cgroups in hybrid mode), the lab tries runc with the limits set
to what this process has; where nothing runs, the tests skip with the runtime's own error.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _hosts import LabError, ensure_package

from flotilla._providers.container import Container

_VARIANTS: list[tuple[list[str], list[str]]] = []


def _ulimits() -> list[str]:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    nproc = min(4096, nproc) if nproc != resource.RLIM_INFINITY else 4096
    return ["--ulimit", f"nofile={soft}:{soft}", "--ulimit", f"nproc={nproc}:{nproc}"]


def build_rootfs(path: Path) -> Path:
    """Empty top-level folders and the usual links into /usr."""
    for d in ("proc", "sys", "dev", "tmp", "etc", "usr", "root", "run", "var"):
        (path / d).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        if not (path / link).exists():
            (path / link).symlink_to(f"usr/{link}")
    return path


class ContainerLab:
    """podman and what its containers need here.

    Attributes:
        rootfs: the root filesystem folder.
        binary_args: podman's own arguments that work here (e.g. ``--runtime runc``).
        run_args: ``run`` arguments that work here (ulimits).
        volumes: the read-only mounts of the host's Python.
        python: the interpreter in the containers (this virtual environment's).
    """

    def __init__(self, rootfs: Path, binary_args: list[str], run_args: list[str]) -> None:
        self.rootfs = rootfs
        self.binary_args = binary_args
        self.run_args = run_args
        venv = os.path.realpath(sys.prefix)
        base = os.path.realpath(sys.base_prefix)
        self.volumes = ["/usr:/usr:ro", f"{base}:{base}:ro"]
        if venv != base:
            self.volumes.append(f"{venv}:{venv}:ro")
        self.python = f"{venv}/bin/python"

    def settings(self, **kwargs: Any) -> dict[str, Any]:
        options: dict[str, Any] = {
            "binary": "podman",
            "rootfs": str(self.rootfs),
            "python": self.python,
            "volumes": self.volumes,
            "run_args": self.run_args,
            "binary_args": self.binary_args,
        }
        options.update(kwargs)
        return options

    def provider(self, **kwargs: Any) -> Container:
        return Container(**self.settings(**kwargs))

    def podman(self, *args: str) -> str:
        out = subprocess.run(
            ["podman", *self.binary_args, *args], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    def containers(self, pool: str | None = None) -> list[str]:
        """Names of the containers flotilla made (of ``pool``), running or not."""
        label = f"flotilla.pool={pool}" if pool else "flotilla.managed=true"
        out = self.podman("ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}")
        return sorted(out.split())

    def networks(self) -> list[str]:
        out = self.podman("network", "ls", "--format", "{{.Name}}")
        return sorted(n for n in out.split() if n.startswith("flotilla-"))

    def inspect(self, name: str) -> dict[str, Any]:
        data = json.loads(self.podman("inspect", name))
        return data[0]  # type: ignore[no-any-return]

    def orphan_netns(self, among: set[str]) -> set[str]:
        """The network namespaces of ``among`` that podman made (``netns-*``) and still
        exist though no container has them (a container's ``SandboxKey``): left for good."""
        made = {n for n in among if n.startswith("netns-")} & podman_netns()
        if not made:
            return set()
        ids = self.podman("ps", "-a", "-q").split()
        if ids:
            used = self.podman("inspect", "--format", "{{.NetworkSettings.SandboxKey}}", *ids)
            made -= {os.path.basename(key) for key in used.split()}
        return made


def podman_netns() -> set[str]:
    """The network namespaces in /run/netns that podman made (``netns-<uuid>``)."""
    try:
        return {n for n in os.listdir("/run/netns") if n.startswith("netns-")}
    except FileNotFoundError:
        return set()


def _probe(rootfs: Path, binary_args: list[str], run_args: list[str]) -> str:
    """'' when a container runs with these arguments, else podman's error."""
    argv = ["podman", *binary_args, "run", "--rm", *run_args, "-v", "/usr:/usr:ro"]
    argv += ["--rootfs", f"{rootfs}:O", "/usr/bin/true"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    return "" if out.returncode == 0 else (out.stderr.strip() or f"exit status {out.returncode}")


def lab_or_reason(tmp: Path) -> tuple[ContainerLab | None, str]:
    """A lab, or why none can run here (podman and runc are installed when missing)."""
    if os.geteuid() != 0:
        return None, "the container lab runs rootful podman: run as root"
    try:
        ensure_package("podman", "/usr/bin/podman")
        ensure_package("runc", "/usr/sbin/runc")  # where crun cannot run (see above)
    except LabError as e:
        return None, str(e)
    rootfs = build_rootfs(tmp / "rootfs")
    errors = []
    variants = [([], []), ([], _ulimits())]
    if shutil.which("runc") is not None:
        variants.append((["--runtime", "runc"], _ulimits()))
    for binary_args, run_args in variants:
        error = _probe(rootfs, binary_args, run_args)
        if not error:
            return ContainerLab(rootfs, binary_args, run_args), ""
        errors.append(f"podman {' '.join(binary_args + run_args) or '(defaults)'}: {error}")
    return None, "no container runs here: " + " | ".join(errors)


@pytest.fixture(scope="session", name="container_lab")
def container_lab_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ContainerLab]:
    global _lab, _reason
    if _lab is None and _reason is None:
        _lab, _reason = lab_or_reason(tmp_path_factory.mktemp("container-lab"))
    if _lab is None:
        pytest.skip(_reason or "no container lab")
    yield _lab


@pytest.fixture(autouse=True)
def no_netns_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that uses the lab: no network namespace podman made meanwhile is
    left without its container (a user's machine would collect them). Test modules
    import it with the lab's fixture."""
    if "container_lab" not in request.fixturenames:
        yield
        return
    lab: ContainerLab = request.getfixturevalue("container_lab")
    before = podman_netns()
    yield
    deadline = time.monotonic() + 60  # a container starting now has one not yet recorded
    while (left := lab.orphan_netns(podman_netns() - before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"podman network namespaces left without a container: {sorted(left)}"


_lab: ContainerLab | None = None
_reason: str | None = None
