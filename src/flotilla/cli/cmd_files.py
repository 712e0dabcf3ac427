"""Files to and from a cluster's nodes: ``flotilla cp``, ``download`` and ``rsync``.

One side of a copy is ``CLUSTER:PATH`` or ``CLUSTER/NODE:PATH`` (default node: 0, the
head), the other a local path. A relative remote path is in the node's working directory
(where ``run`` and ``flotilla ssh`` start); ``~/`` is the node's home.

Every copy goes through the channel ``flotilla ssh`` uses, the backend's
:meth:`~.backends.base.Backend.shell` command: ssh with the pool's key and pinned host keys
(SSH, AWS, Vast), ``kubectl exec -i`` (Kubernetes), ``podman``/``docker exec -i``
(Container), ``srun --overlap`` into the cluster's allocation (SLURM), a local shell in
the node's folder (Local). Nothing else is opened on the nodes.

- ``cp`` streams a tar archive through that channel: it needs only ``tar`` and ``sh`` on
  the node (every image has them). What it receives is extracted by the one safe
  extraction (``_system.untar``: no absolute names, no ``..``, no links out, no devices).
- ``download CLUSTER[/NODE] PATH [LOCAL]`` is ``cp CLUSTER[/NODE]:PATH LOCAL``.
- ``rsync`` runs this machine's rsync with that channel as its remote shell (``rsync -e``,
  through :mod:`flotilla.cli.rsh`): incremental, its own flags passed on; the node needs
  rsync too.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from typing import Any, NoReturn

from .._errors import ConfigurationError
from .backends import registry
from .backends.base import ShellCommand
from .clusters import running
from .console import CLIError
from .state import NAME_RE, Paths

_REMOTE = re.compile(rf"({NAME_RE.pattern})(?:/(\d+))?:(.*)", re.S)


@dataclass(frozen=True)
class Remote:
    """``CLUSTER[/NODE]:PATH``.

    Attributes:
        cluster: the cluster's name.
        node: the node's index.
        path: the path on the node ('' : its working directory).
    """

    cluster: str
    node: int
    path: str

    @property
    def shell_path(self) -> str:
        """The path as the node's shell reads it: quoted, ``~/`` kept for the shell."""
        path = self.path or "."
        if path == "~" or path.startswith("~/"):
            return "~/" + shlex.quote(path[2:] or ".")
        return shlex.quote(path)


def endpoint(text: str) -> Remote | None:
    """The remote side ``text`` names (None: a local path; ``./a:b`` and ``/a:b`` are
    local, as for rsync and scp)."""
    found = _REMOTE.fullmatch(text)
    if found is None:
        return None
    return Remote(found[1], int(found[2]) if found[2] else 0, found[3])


def node_shell(remote: Remote, command: str) -> ShellCommand:
    """The backend's shell running ``command`` on the node ``remote`` names (in its
    working directory)."""
    paths = Paths(remote.cluster)
    rec = running(paths)
    if not rec.nodes:
        raise CLIError(f"cluster {paths.name} is still starting")
    if not 0 <= remote.node < len(rec.nodes):
        raise CLIError(f"cluster {paths.name} has nodes 0 to {len(rec.nodes) - 1}", code=2)
    spec = registry.spec_from_dict(rec.provider)
    return registry.backend_for(spec).shell(paths, spec, rec.nodes, remote.node, command)


def exec_shell(shell: ShellCommand) -> NoReturn:
    """Replace this process with ``shell`` (``flotilla ssh``, rsync's remote shell)."""
    if shell.cwd is not None:
        os.chdir(shell.cwd)
    sys.stdout.flush()
    if shell.env is None:
        os.execvp(shell.argv[0], shell.argv)
    os.execvpe(shell.argv[0], shell.argv, dict(shell.env))


def run_shell(shell: ShellCommand, **kw: Any) -> subprocess.Popen[bytes]:
    """Start ``shell`` (its environment and folder) with ``kw`` for Popen."""
    env = dict(shell.env) if shell.env is not None else None
    return subprocess.Popen(list(shell.argv), env=env, cwd=shell.cwd, **kw)


def _sides(src: str, dst: str) -> tuple[Remote | None, Remote | None]:
    a, b = endpoint(src), endpoint(dst)
    if (a is None) == (b is None):
        raise ConfigurationError(
            "one side must be a cluster's node (CLUSTER:PATH or CLUSTER/NODE:PATH) and "
            f"the other a local path; got {src!r} and {dst!r}"
        )
    return a, b


# -- cp ------------------------------------------------------------------------------------------
def cmd_cp(args: argparse.Namespace) -> int:
    source, target = _sides(args.src, args.dst)
    if target is not None:
        upload(args.src, target)
    else:
        assert source is not None
        download(source, args.dst)
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    found = re.fullmatch(rf"({NAME_RE.pattern})(?:/(\d+))?", args.cluster)
    if found is None:
        raise ConfigurationError(f"{args.cluster!r}: expected CLUSTER or CLUSTER/NODE")
    node = int(found[2]) if found[2] else 0
    download(Remote(found[1], node, args.path), args.dest or ".")
    return 0


def upload(local: str, target: Remote) -> None:
    """``local`` (a file or folder) to ``target``: into it when it is a folder there,
    else as that name (its folder created)."""
    if not os.path.lexists(local):
        raise ConfigurationError(f"{local}: no such file or folder")
    name = os.path.basename(os.path.abspath(local))  # `cp . dev:code`: the folder's name
    dest = target.shell_path
    script = (
        f"set -e; d={dest}; n={shlex.quote(name)}; "
        'if [ -d "$d" ]; then tar -xf - -C "$d"; else '
        'p=$(dirname -- "$d"); mkdir -p -- "$p"; t=$(mktemp -d "$p/.flotilla-cp.XXXXXX"); '
        'trap \'rm -rf -- "$t"\' EXIT; tar -xf - -C "$t"; mv -- "$t/$n" "$d"; fi'
    )
    proc = run_shell(node_shell(target, script), stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        with tarfile.open(fileobj=proc.stdin, mode="w|") as tar:
            tar.add(local, arcname=name)
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the node's side ended first: its status says why
    _finish(proc, f"copying {local} to {target.cluster}/{target.node}:{target.path}")


def download(source: Remote, local: str) -> None:
    """``source`` (a file or folder on the node) to ``local``: into it when it is a
    folder here, else as that name. The archive is checked before anything is written."""
    from .._system.untar import UnsafeArchive, extract

    path = source.path.rstrip("/") or "."
    folder, name = os.path.split(path)
    remote = Remote(source.cluster, source.node, folder or ".")
    script = f"cd {remote.shell_path} && tar -cf - -- {shlex.quote(name)}"
    into = os.path.isdir(local)
    parent = local if into else os.path.dirname(os.path.abspath(local))
    if not os.path.isdir(parent):
        raise ConfigurationError(f"{local}: its folder {parent} does not exist")
    with tempfile.TemporaryDirectory(dir=parent, prefix=".flotilla-cp.") as staging:
        archive = os.path.join(staging, "archive.tar")
        with open(archive, "wb") as out:
            proc = run_shell(node_shell(remote, script), stdout=out, stderr=subprocess.PIPE)
            _finish(proc, f"copying {source.cluster}/{source.node}:{source.path}")
        unpacked = os.path.join(staging, "files")
        os.mkdir(unpacked)
        try:
            with tarfile.open(archive) as tar:
                extract(tar, unpacked)
        except (UnsafeArchive, tarfile.TarError) as e:
            raise CLIError(
                f"refused what the node sent: {e} (nothing was written; `flotilla rsync` "
                "copies links as links)"
            ) from None
        whole = name in (".", "")  # a folder's content (the working directory's)
        got = unpacked if whole else os.path.join(unpacked, name)
        final = local if whole or not into else os.path.join(local, name)
        if os.path.isdir(final) and os.path.isdir(got):
            _merge(got, final)
        else:
            os.replace(got, final)


def _merge(src: str, dst: str) -> None:
    """Move ``src``'s entries into the existing folder ``dst`` (replacing same names)."""
    for entry in os.listdir(src):
        target = os.path.join(dst, entry)
        if os.path.isdir(target) and os.path.isdir(os.path.join(src, entry)):
            _merge(os.path.join(src, entry), target)
        else:
            os.replace(os.path.join(src, entry), target)


def _finish(proc: subprocess.Popen[bytes], what: str) -> None:
    err = proc.stderr.read() if proc.stderr is not None else b""
    proc.wait()
    if proc.returncode != 0:
        said = (err or b"").decode(errors="replace").strip().splitlines()
        raise CLIError(f"{what} failed: {said[-1] if said else f'exit {proc.returncode}'}")


# -- rsync ---------------------------------------------------------------------------------------
def cmd_rsync(args: argparse.Namespace) -> int:
    """This machine's rsync, the node's shell channel as its remote shell."""
    source, target = _sides(args.src, args.dst)
    remote = source or target
    assert remote is not None
    node_shell(remote, "true")  # the cluster is up and has that node: before rsync starts
    spelled = f"{remote.node}.{remote.cluster}:{remote.path or '.'}"
    src = spelled if source is not None else args.src
    dst = spelled if target is not None else args.dst
    rsh = f"{shlex.quote(sys.executable)} -m flotilla.cli.rsh"
    argv = ["rsync", "-a", *args.options, "-e", rsh, src, dst]
    try:
        done = subprocess.run(argv, check=False)
    except FileNotFoundError:
        raise CLIError("rsync is not installed here: use `flotilla cp`", code=2) from None
    if done.returncode != 0:
        raise CLIError(
            f"rsync exited with {done.returncode} (a node without rsync: use `flotilla cp`)"
        )
    return 0


def add_file_parsers(sub: Any) -> None:
    """``flotilla cp``, ``download`` and ``rsync``."""
    where = "CLUSTER:PATH or CLUSTER/NODE:PATH (a relative PATH: the node's working directory)"
    q = sub.add_parser("cp", help="copy a file or folder to or from a node (tar, any node)")
    q.add_argument("src", help=f"a local path or {where}")
    q.add_argument("dst", help=f"a local path or {where}")
    q.set_defaults(func=cmd_cp)
    q = sub.add_parser("download", help="copy a file or folder from a node to here")
    q.add_argument("cluster", metavar="CLUSTER[/NODE]")
    q.add_argument("path", help="the path on the node (relative: its working directory)")
    q.add_argument("dest", nargs="?", help="where to put it (default: the current folder)")
    q.set_defaults(func=cmd_download)
    q = sub.add_parser(
        "rsync", help="rsync to or from a node through its shell channel (rsync on both)"
    )
    q.add_argument("src", help=f"a local path or {where}")
    q.add_argument("dst", help=f"a local path or {where}")
    q.set_defaults(func=cmd_rsync, takes_options=True, options=[])  # after `--`: rsync's
    q.epilog = "rsync's own flags go after `--`: flotilla rsync dev:out ./out -- --delete"
