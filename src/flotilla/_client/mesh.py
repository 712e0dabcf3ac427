"""Nodes that reach each other over SSH: ``ssh <node ip> CMD`` from any node of a cluster.

Launchers of large training runs (DeepSpeed's pdsh runner, ``mpirun``, pdsh itself) start
their workers by logging in from the head to every other node. A cluster whose nodes are
separate machines gets that at start-up, with no prompt and no trust on first use:

1. each node reads its own sshd's host keys (``ssh-keyscan`` of its own address, checked to
   be an address of this machine: the answer cannot come from elsewhere);
2. the client makes a key pair for the cluster and sends every node the private key, a
   ``known_hosts`` pinning every node's host keys at its address, and an ssh ``config``
   that uses them for the nodes' addresses only (other hosts keep the user's own config);
3. each node authorizes the public key for its login user (``~/.ssh/authorized_keys``), in a
   line restricted to the nodes' addresses (``from=...``) and tagged with the cluster;
4. jobs get ``ssh`` and ``scp`` wrappers first on their ``PATH`` that use that config, and
   the variables OpenMPI and pdsh read (``OMPI_MCA_plm_rsh_agent``, ``PDSH_RCMD_TYPE``),
   which name ``ssh`` rather than the wrapper's path: each node's folder is its own.

The key files live in a 0700 folder in the node's working directory (``.flotilla/mesh-<tag>``,
beside the job's hostfile); ``flotilla down``
removes them and the authorized line. Not on SLURM (compute nodes often forbid ssh between
them; ``srun --overlap`` within the allocation is the equivalent) nor where every node is
this machine (the local provider).

The functions marked ``@function`` run on the nodes (standard library only).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .._info import instance_info
from .._system import locks
from .function import function

if TYPE_CHECKING:
    from .compute import Compute

_MARK = "flotilla-mesh-"
"""The comment that tags a cluster's line in authorized_keys: ``flotilla-mesh-<tag>``."""
KEYSCAN_TIMEOUT = 10.0


def folder(tag: str, workdir: str) -> Path:
    """The folder of the cluster's keys on a node (in the node's working directory)."""
    return Path(workdir) / ".flotilla" / f"mesh-{tag}"


def job_env(tag: str, workdir: str) -> dict[str, str]:
    """On a node: the variables a job gets when the mesh is installed ({} otherwise)."""
    bin_dir = folder(tag, workdir) / "bin"
    if not (bin_dir / "ssh").is_file():
        return {}
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        # by name, found first on PATH (the wrapper) here; never the wrapper's path: mpirun
        # passes every OMPI_MCA_ variable on to the orted it starts on each other node
        # (``orted ... -mca plm_rsh_agent VALUE``), where this node's folder does not exist;
        # orted then dies at start ("plm_rsh_agent ... a path that could not be found")
        # and mpirun waits for it for ever. ``ssh`` is found on every node.
        "OMPI_MCA_plm_rsh_agent": "ssh",
        "OMPI_MCA_plm_rsh_no_tree_spawn": "1",  # every orted from the head, with our ssh
        "PDSH_RCMD_TYPE": "ssh",
    }


# -- on the nodes ----------------------------------------------------------------------------
@function
def own_host_keys(port: int = 22) -> list[str]:
    """This node's sshd host keys (``TYPE BASE64`` lines), asked of the sshd listening on
    the node's address, checked to be an address of this machine; [] when none answers."""
    addr = instance_info().addr
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        try:
            s.bind((addr, 0))  # succeeds only for an address of this machine
        except OSError:
            return []
    keyscan = shutil.which("ssh-keyscan")
    if keyscan is None:
        return []
    try:
        done = subprocess.run(
            [keyscan, "-T", "5", "-p", str(port), addr],
            capture_output=True,
            text=True,
            timeout=KEYSCAN_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return []
    keys = []
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and not line.startswith("#"):
            keys.append(f"{parts[1]} {parts[2]}")
    return keys


@function
def install(
    tag: str,
    private_key: str,
    public_key: str,
    known_hosts: str,
    addrs: list[str],
    workdirs: dict[int, str],
) -> str:
    """Install the cluster's keys on this node, in its ``workdirs`` entry (again: replaces
    what was there); the folder."""
    where = folder(tag, workdirs[instance_info().node])
    shutil.rmtree(where, ignore_errors=True)
    where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.mkdir(where, 0o700)
    (where / "bin").mkdir(0o700)
    _write(where / "id_ed25519", private_key, 0o600)
    _write(where / "known_hosts", known_hosts, 0o600)
    user_config = Path.home() / ".ssh" / "config"
    include = f"Match all\n    Include {user_config}\n" if user_config.is_file() else ""
    _write(
        where / "config",
        f"Host {' '.join(addrs)}\n"
        f"    IdentityFile {where / 'id_ed25519'}\n"
        "    IdentitiesOnly yes\n"
        f"    UserKnownHostsFile {where / 'known_hosts'}\n"
        "    GlobalKnownHostsFile /dev/null\n"
        "    StrictHostKeyChecking yes\n"
        "    BatchMode yes\n"
        "    LogLevel ERROR\n" + include,
        0o600,
    )
    for tool in ("ssh", "scp"):
        real = shutil.which(tool)
        if real is not None:
            _write(
                where / "bin" / tool, f'#!/bin/sh\nexec {real} -F "{where}/config" "$@"\n', 0o700
            )
    _authorize(tag, f'from="{",".join(addrs)}" {public_key.strip()} {_MARK}{tag}')
    return str(where)


@function
def remove(tag: str, workdirs: dict[int, str]) -> None:
    """Remove the cluster's keys and its authorized line from this node."""
    _authorize(tag, None)
    shutil.rmtree(folder(tag, workdirs[instance_info().node]), ignore_errors=True)


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _authorize(tag: str, line: str | None) -> None:
    """Replace the cluster's line in ``~/.ssh/authorized_keys`` by ``line`` (None: remove
    it), atomically; the file and ``~/.ssh`` are created (0600, 0700) when missing."""
    dot_ssh = Path.home() / ".ssh"
    path = dot_ssh / "authorized_keys"
    if line is None and not path.exists():
        return
    dot_ssh.mkdir(mode=0o700, exist_ok=True)
    with locks.named(str(path)):  # nodes may share a home folder (NFS)
        _replace_line(path, tag, line)


def _replace_line(path: Path, tag: str, line: str | None) -> None:
    try:
        old = path.read_text().splitlines()
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        old, mode = [], 0o600
    kept = [x for x in old if not x.endswith(f" {_MARK}{tag}")]
    if line is None and len(kept) == len(old):
        return
    new = [*kept, *([line] if line else [])]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".authorized_keys.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{x}\n" for x in new))
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# -- on the client ----------------------------------------------------------------------------
def connect(pool: Compute, addrs: Sequence[str], workdirs: dict[int, str], tag: str) -> str | None:
    """Let the pool's nodes (``addrs``, in rank order; their working directories) reach
    each other over SSH; None when done, else why not (the cluster works without it)."""
    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        return "ssh-keygen is not installed on this machine (apt-get install openssh-client)"
    scanned: list[list[str]] = pool.broadcast(own_host_keys())
    missing = [f"node {rank} ({addrs[rank]})" for rank, keys in enumerate(scanned) if not keys]
    if missing:
        return f"no sshd answers on {', '.join(missing)}"
    known = "".join(
        f"{addr} {key}\n" for addr, keys in zip(addrs, scanned, strict=True) for key in keys
    )
    with tempfile.TemporaryDirectory(prefix="flotilla-mesh-") as tmp:
        key = Path(tmp) / "key"
        subprocess.run(
            [keygen, "-q", "-t", "ed25519", "-N", "", "-C", f"{_MARK}{tag}", "-f", str(key)],
            check=True,
            capture_output=True,
        )
        private, public = key.read_text(), key.with_suffix(".pub").read_text()
    public = " ".join(public.split()[:2])
    pool.broadcast(install(tag, private, public, known, list(addrs), workdirs))
    return None


def disconnect(pool: Compute, workdirs: dict[int, str], tag: str) -> None:
    """Remove the cluster's keys from every node (best effort: nodes may be gone)."""
    pool.broadcast(remove(tag, workdirs))
