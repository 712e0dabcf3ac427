"""Find (or install) a Python of the client's minor version on this node.

A function defined in the client's script travels as byte code, which only the Python minor
version that made it runs. When the agent's interpreter is another minor version, the
client asks for one that matches (a PYTHON frame, see :mod:`flotilla._client.interpreter`);
the agent then becomes that interpreter (``exec``, same process and stdio), or says what it
looked at. Places looked at, in order (each candidate is run to read its version):

* ``python3.X`` in every folder of ``PATH``;
* interpreters uv manages (``$UV_PYTHON_INSTALL_DIR``, else ``~/.local/share/uv/python``);
* pyenv's (``$PYENV_ROOT``, else ``~/.pyenv``: ``versions/3.X.Y``);
* conda's (``~/miniconda3``, ``~/miniforge3``, ``~/mambaforge``, ``~/anaconda3``,
  ``/opt/conda``: the base and its ``envs/*``).

With the user's leave (``Image(python="3.X")``) and none found, ``uv python install 3.X``
installs one (``UV_PYTHON_INSTALL_MIRROR`` honoured). Standard library only.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from dataclasses import dataclass

_VERSION = "import sys; print('%d.%d.%d' % sys.version_info[:3])"
_CONDA_ROOTS = ("~/miniconda3", "~/miniforge3", "~/mambaforge", "~/anaconda3", "/opt/conda")


@dataclass(frozen=True)
class Found:
    """The outcome of a search.

    Attributes:
        path: the interpreter to use ("" when none matched).
        version: its full version ("3.11.2").
        looked: what was tried, as "path (version or why not)".
        installed: whether it was installed for this search.
    """

    path: str
    version: str
    looked: tuple[str, ...]
    installed: bool = False


def candidates(minor: str) -> list[str]:
    """Paths that may be a Python ``minor`` ("3.11"), in order of preference, each once."""
    name = f"python{minor}"
    found = [os.path.join(d, name) for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    uv_root = os.environ.get("UV_PYTHON_INSTALL_DIR") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "uv", "python"
    )
    found += sorted(glob.glob(os.path.join(uv_root, f"cpython-{minor}.*", "bin", name)))
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    release = re.compile(rf"{re.escape(minor)}\.\d+$")  # not 3.13.0t (another ABI), not envs
    versions = sorted(glob.glob(os.path.join(pyenv, "versions", f"{minor}.*")))
    found += [os.path.join(v, "bin", name) for v in versions if release.match(os.path.basename(v))]
    for root in _CONDA_ROOTS:
        base = os.path.expanduser(root)
        found.append(os.path.join(base, "bin", name))
        found += sorted(glob.glob(os.path.join(base, "envs", "*", "bin", name)))
    out: list[str] = []
    for path in found:
        if path not in out and os.access(path, os.X_OK) and not os.path.isdir(path):
            out.append(path)
    return out


def version_of(python: str) -> str:
    """The full version of interpreter ``python`` ("3.12.1"); ValueError saying why not."""
    try:
        proc = subprocess.run(
            [python, "-S", "-c", _VERSION],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(str(e)) from None
    out = proc.stdout.strip()
    if proc.returncode != 0 or not re.fullmatch(r"\d+\.\d+\.\d+", out):
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise ValueError(why)
    return out


def find(minor: str) -> Found:
    """The first candidate that runs and is Python ``minor``."""
    looked: list[str] = []
    for path in candidates(minor):
        try:
            version = version_of(path)
        except ValueError as e:
            looked.append(f"{path} (does not run: {e})")
            continue
        if version.startswith(minor + "."):
            return Found(path, version, tuple(looked))
        looked.append(f"{path} ({version})")
    return Found("", "", tuple(looked))


def install(minor: str, uv: list[str], mirror: str | None) -> Found:
    """``uv python install minor``, then uv's path of it; ``looked`` holds uv's output's
    last lines when it failed."""
    env = dict(os.environ)
    if mirror:
        env["UV_PYTHON_INSTALL_MIRROR"] = mirror
    steps = [
        [*uv, "python", "install", "--no-bin", minor],  # nothing put on the user's PATH
        [*uv, "python", "find", "--python-preference", "only-managed", minor],
    ]
    out = ""
    for cmd in steps:
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL
            )
        except OSError as e:
            return Found("", "", (f"{' '.join(cmd)}: {e}",))
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return Found("", "", (f"`{' '.join(cmd)}` failed: {' / '.join(tail)}",))
        out = proc.stdout.strip()
    path = out.splitlines()[-1] if out else ""
    try:
        version = version_of(path)
    except ValueError as e:
        return Found("", "", (f"uv installed {path!r}, which does not run: {e}",))
    return Found(path, version, (), installed=True)


def this_python() -> str:
    """The running interpreter's full version."""
    return "%d.%d.%d" % sys.version_info[:3]  # noqa: UP031
