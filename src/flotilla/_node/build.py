"""Node side of ``Image``: build an environment once per content hash.

Run by the agent as ``python -m flotilla._node.build HOME`` with the build spec as JSON on stdin
(followed by the includes archive), and the image's env in its environment (never on disk).
It prints ``::step NAME`` before each step; the agent turns its output into progress and,
on failure, into an error naming the step, the exit code and the last lines.

Layout: ``HOME/envs/<hash>-<interpreter key>/{site,includes}`` (:func:`interpreter_key`)
plus ``.complete`` once finished. The build happens in a temporary directory renamed into
place, under a lock, so concurrent pools on one machine build once and a failed build leaves
nothing half-made. Standard library only.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile

from .._system.locks import exclusive
from .._system.untar import UnsafeArchive, extract

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def interpreter_key() -> str:
    """What decides an environment's content besides its Image, as a short hash: this
    interpreter (its path, version and platform) and what it already provides (every
    distribution on its import path, with its version), since a build installs only what
    is missing. An environment is kept under the Image's hash and this key."""
    import hashlib
    import platform

    dists: set[str] = set()  # "<name>-<version>.dist-info" names say both: nothing is read
    for folder in sys.path:
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        dists.update(n.lower() for n in names if n.endswith((".dist-info", ".egg-info")))
    facts = [
        os.path.realpath(sys.executable),
        sys.executable,
        sys.version,
        sys.platform,
        platform.machine(),
        sys.prefix,
        *sorted(dists),
    ]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:12]


def env_dir(home: str, spec_hash: str) -> str:
    return os.path.join(os.path.expanduser(home), "envs", spec_hash)


def is_built(home: str, spec_hash: str) -> bool:
    return os.path.exists(os.path.join(env_dir(home, spec_hash), ".complete"))


class BuildError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def step(name: str) -> None:
    print(f"::step {name}", flush=True)


def run(cmd: list[str] | str, **kw: Any) -> None:
    """Run a command, streaming its output; BuildError with its exit code on failure."""
    shown = cmd if isinstance(cmd, str) else " ".join(cmd)
    print(f"$ {shown}", flush=True)
    proc = subprocess.run(cmd, stdout=sys.stdout, stderr=subprocess.STDOUT, **kw)
    if proc.returncode != 0:
        raise BuildError(
            f"command failed with exit code {proc.returncode}: {shown}", proc.returncode
        )


def check_python(wanted: str | None) -> None:
    if not wanted:
        return
    have = "%d.%d.%d" % sys.version_info[:3]  # noqa: UP031
    if not (have + ".").startswith(wanted + "."):
        raise BuildError(
            f"the node's Python is {have} ({sys.executable}) but the image asks for {wanted}"
        )


def install_apt(packages: list[str]) -> None:
    missing = [p for p in packages if not _dpkg_installed(p.split("=")[0])]
    if not missing:
        print("apt: every package is already installed", flush=True)
        return
    if shutil.which("apt-get") is None:
        raise BuildError(f"apt packages {missing} are missing and this node has no apt-get")
    if os.geteuid() != 0:
        raise BuildError(f"apt packages {missing} are missing and installing them needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    try:
        run(cmd, env=env)
    except BuildError:
        run(["apt-get", "update"], env=env)
        run(cmd, env=env)


def _dpkg_installed(name: str) -> bool:
    if shutil.which("dpkg-query") is None:
        return False
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", name], capture_output=True, text=True
    ).stdout
    return out.strip().endswith("installed")


def _requirement_api() -> Any:
    try:
        from packaging.requirements import Requirement
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import (  # type: ignore[assignment]
                Requirement,
            )
        except ImportError:
            return None
    return Requirement


def unsatisfied(requirements: list[str], path: list[str]) -> list[str]:
    """The requirements that the node's environment (``path``) does not satisfy yet."""
    import importlib.metadata as md

    requirement = _requirement_api()
    out = []
    for text in requirements:
        if requirement is None or text.startswith(("-", "git+", "http:", "https:", "file:")):
            out.append(text)
            continue
        req = requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        dists = list(md.distributions(name=req.name, path=path))
        if not dists or not req.specifier.contains(dists[0].version, prereleases=True):
            out.append(text)
    return out


def installed_names(path: list[str]) -> set[str]:
    import importlib.metadata as md

    names = set()
    for dist in md.distributions(path=path):
        name = dist.metadata["Name"]
        if name:
            names.add(re.sub(r"[-_.]+", "-", name).lower())
    return names


def find_uv(home: str) -> list[str]:
    try:
        import uv

        return [uv.find_uv_bin()]
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("uv")
    if found:
        return [found]
    tools = os.path.join(os.path.expanduser(home), "tools", "uv")
    binary = os.path.join(tools, "bin", "uv")
    if not os.path.exists(binary):
        print("installing uv for this node", flush=True)
        run([sys.executable, "-m", "pip", "install", "--quiet", "--target", tools, "uv"])
    return [binary]


def _name(requirement: str) -> str:
    """The normalised package name of a requirement."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;@]", requirement, maxsplit=1)[0]).lower()


def install_pip(spec: dict[str, Any], site: str, home: str) -> None:
    """Install what the node lacks of ``spec["pip"]`` into ``site``: one installer call,
    or one more per index scoped to some packages (``pip_index_packages``), which is
    searched for those packages only."""
    base = [p for p in sys.path if p]
    wanted = unsatisfied(spec["pip"], base)
    if not wanted:
        print("pip: every requirement is already satisfied on this node", flush=True)
        return
    scoped: dict[str, list[str]] = spec.get("pip_index_packages") or {}
    own_urls = {u.rstrip("/") for u in scoped}
    shared = [i for i in spec["pip_indexes"] if i.rstrip("/") not in own_urls]
    rest = list(wanted)
    for url, names in scoped.items():
        own = {re.sub(r"[-_.]+", "-", n).lower() for n in names}
        mine = [w for w in rest if _name(w) in own]
        if mine:
            rest = [w for w in rest if w not in mine]
            _install(mine, [url, *shared], site, home, base)
    if rest:
        _install(rest, shared, site, home, base)


def _install(wanted: list[str], indexes: list[str], site: str, home: str, base: list[str]) -> None:
    print(f"pip: installing {', '.join(wanted)}", flush=True)
    requested = {_name(w) for w in wanted}
    keep_out = sorted(installed_names([*base, site]) - requested)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("".join(f"{name} ; sys_platform == 'never'\n" for name in keep_out))
        overrides = f.name
    try:
        cmd = [*find_uv(home), "pip", "install", "--python", sys.executable, "--target", site]
        cmd += ["--overrides", overrides]  # what the node has is never installed again
        for index in indexes:
            cmd += ["--extra-index-url", index]
        run([*cmd, *wanted])
    finally:
        os.unlink(overrides)


def unpack_includes(data: bytes, target: str) -> None:
    os.makedirs(target, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        try:
            extract(tar, target)
        except UnsafeArchive as e:
            raise BuildError(f"the includes archive is unsafe: {e}") from e
    print(f"includes: unpacked {len(data)} bytes", flush=True)


def run_setup(commands: list[str], build: str) -> None:
    """Run the image's setup commands in the new environment's folder, its packages on the
    paths; ``FLOTILLA_PYTHON`` names the interpreter the tasks run on (a plugin's step,
    e.g. the HuggingFace models' download, runs Python code with it)."""
    env = dict(os.environ)
    env["FLOTILLA_PYTHON"] = sys.executable
    env["PATH"] = os.path.join(build, "site", "bin") + os.pathsep + env.get("PATH", "")
    paths = [os.path.join(build, "includes"), os.path.join(build, "site")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    for command in commands:
        run(command, shell=True, cwd=build, env=env, executable="/bin/bash")


def build(spec: dict[str, Any], includes: bytes, home: str) -> None:
    target = env_dir(home, spec["hash"])
    envs = os.path.dirname(target)
    os.makedirs(envs, exist_ok=True)
    with exclusive(target + ".lock"):  # another pool on this machine may be building it
        if is_built(home, spec["hash"]):
            print("environment already built", flush=True)
            return
        # with the lock held, a temporary folder of this hash is a builder's that was
        # killed (SIGKILL leaves no time to clean up): remove it
        prefix = f"{spec['hash']}.tmp-"
        for stale in os.listdir(envs):
            if stale.startswith(prefix):
                shutil.rmtree(os.path.join(envs, stale), ignore_errors=True)
        # a stop (SIGTERM) waits until the folder is ours to remove: between its making
        # and the try below, the handler's SystemExit would leave it behind
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        tmp = tempfile.mkdtemp(prefix=prefix, dir=envs)
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            if spec.get("python"):
                step("python")
                check_python(spec["python"])
            if spec["apt"]:
                step("apt")
                install_apt(spec["apt"])
            os.makedirs(os.path.join(tmp, "site"))
            if spec["pip"]:
                step("pip")
                install_pip(spec, os.path.join(tmp, "site"), home)
            if includes:
                step("includes")
                unpack_includes(includes, os.path.join(tmp, "includes"))
            if spec["setup"]:
                step("setup")
                run_setup(spec["setup"], tmp)
            with open(os.path.join(tmp, ".complete"), "w") as f:
                json.dump({k: v for k, v in spec.items() if k != "env"}, f)
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def main() -> None:
    # the agent stops a build with SIGTERM: unwind (the half-built folder is removed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    home = sys.argv[1]
    raw = sys.stdin.buffer.read()
    head, _, includes = raw.partition(b"\n")
    spec = json.loads(head)
    try:
        build(spec, includes, home)
    except BuildError as e:
        print(f"::error {e}", flush=True)
        sys.exit(e.code if 0 < e.code < 256 else 1)
    step("done")


if __name__ == "__main__":
    main()
