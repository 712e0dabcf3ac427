"""What the command-line jobs run on the nodes (flotilla functions, sent by reference).

A node runs shell scripts in its working directory with ``bash -c``; the script's output
goes straight to the executor's stdout/stderr, so it streams to the client with the node's
prefix, and the call returns the exit status. Stopping the call (``Compute.cancel``) kills
the executor's process group, which includes the script and its children.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import socket
import subprocess
import sys
import tarfile
import time
from typing import TYPE_CHECKING, Any

from .._client.function import function
from .._client.mesh import job_env as mesh_env
from .._info import instance_info
from .._system import locks, procs, untar
from .._system.gpus import gpu_count

if TYPE_CHECKING:
    from .._client.compute import Compute

WORKDIR_MEMBER = "workdir"
"""Archive members under this name go to the node's working directory."""
TOKEN_VAR = "FLOTILLA_RUN_TOKEN"
"""Every process a job starts inherits this variable (``<cluster token>.<job>.``), so its
processes can be found, and stopped, even those that left the process group (setsid,
daemons such as ``ray start``, torchrun's workers)."""


SLURM_STEP_VARS = frozenset(
    {
        "SLURM_STEPID",
        "SLURM_NTASKS",
        "SLURM_NPROCS",
        "SLURM_TASKS_PER_NODE",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_GTIDS",
        "SLURM_SRUN_COMM_HOST",
        "SLURM_SRUN_COMM_PORT",
        "SLURM_DISTRIBUTION",
        "SLURM_TASK_PID",
        "SLURM_LAUNCH_NODE_IPADDR",
        "SLURM_CPU_BIND",
        "SLURM_CPU_BIND_LIST",
        "SLURM_CPU_BIND_TYPE",
        "SLURM_CPU_BIND_VERBOSE",
    }
)
"""What ``srun`` sets for the agent's own step (one task on one node): a job's scripts do not
see them, so that ``srun`` and ``mpirun`` in them use the whole allocation."""


def slurm_allocation_env(nodes: list[str]) -> dict[str, str]:
    """The allocation's variables for a job's scripts on SLURM (``nodes``: its node names),
    as a batch script has them."""
    names = ",".join(nodes)
    count = str(len(nodes))
    return {
        "SLURM_JOB_NODELIST": names,
        "SLURM_NODELIST": names,
        "SLURM_JOB_NUM_NODES": count,
        "SLURM_NNODES": count,
    }


def describe_nodes(pool: Compute, subdir: str) -> list[dict[str, Any]]:
    """Every node's :func:`node_facts`, by rank. ``subdir`` (under each agent's folder;
    ``""``: the agent's own folder, for nodes on this machine, which the provider keeps
    apart) is where jobs run: the same path on every node, as launchers that ``cd`` into the
    head's folder on each node expect (DeepSpeed's pdsh runner, mpirun's default wdir), or
    ``subdir/node-K`` on the nodes that share a file system with another node, which each
    node finds out from the probe files all of them write first (:func:`mark_folder`)."""
    if not subdir:
        return pool.broadcast(node_facts())
    token = secrets.token_hex(16)
    try:
        pool.broadcast(mark_folder(subdir, token))
        return pool.broadcast(node_facts(subdir, token))
    finally:
        with contextlib.suppress(Exception):  # best effort: a node may be gone
            pool.broadcast(unmark_folder(subdir))


def _probe(folder: str, node: int) -> str:
    """Node ``node``'s probe file for ``folder``: beside it, not in it (jobs never see it)."""
    return f"{folder}.probe-{node}"


@function
def mark_folder(subdir: str, token: str) -> None:
    """Create ``subdir`` under the agent's folder and write this node's probe beside it,
    holding ``token`` (this probe's, so an old file left by a crash does not count)."""
    folder = os.path.join(os.getcwd(), subdir)
    os.makedirs(folder, exist_ok=True)
    with open(_probe(folder, instance_info().node), "w") as f:
        f.write(token)


@function
def unmark_folder(subdir: str) -> None:
    """Remove this node's probe (:func:`mark_folder`)."""
    folder = os.path.join(os.getcwd(), subdir)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_probe(folder, instance_info().node))


def _shares_folder(folder: str, token: str, node: int) -> bool:
    """Whether another node's probe for ``token`` is in this node's view of ``folder``'s
    parent: that node writes to the same file system."""
    parent, name = os.path.split(folder)
    prefix = f"{name}.probe-"
    for entry in os.listdir(parent):
        if not entry.startswith(prefix) or entry == os.path.basename(_probe(folder, node)):
            continue
        with contextlib.suppress(OSError), open(os.path.join(parent, entry)) as f:
            if f.read() == token:
                return True
    return False


@function
def node_facts(subdir: str = "", token: str = "") -> dict[str, Any]:
    """This node's index, address, host name, working directory for jobs, agent pid,
    GPUs, and its batch-scheduler job and node name (under SLURM). The jobs' directory is
    the agent's own, or ``subdir`` below it (created), or ``subdir/node-K`` when another
    node's probe for ``token`` is there (they share the file system; no token: assumed)."""
    info = instance_info()
    workdir = os.getcwd()
    if subdir:
        workdir = os.path.join(workdir, subdir)
        os.makedirs(workdir, exist_ok=True)
        if not token or _shares_folder(workdir, token, info.node):
            workdir = os.path.join(workdir, f"node-{info.node}")
            os.makedirs(workdir, exist_ok=True)
    return {
        "node": info.node,
        "ip": info.addr,
        "host": socket.gethostname(),
        "workdir": workdir,
        "agent_pid": os.getppid(),  # the executor is the agent's child
        "gpus": gpu_count(),
        "scheduler_job": os.environ.get("SLURM_JOB_ID", ""),
        "scheduler_node": os.environ.get("SLURMD_NODENAME", ""),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0,
        "memory_gb": _memory_gb(),
        "reattach": reattach_argv(),
    }


def reattach_argv() -> list[str]:
    """The command that bridges to this node's agent again (``_node/reattach.py``), run on
    the node; [] when its agent has no re-attach socket (not a cluster's)."""
    address = os.environ.get("FLOTILLA_AGENT_ADDRESS", "")
    if not address:
        return []
    import flotilla

    lib = os.path.dirname(os.path.dirname(os.path.abspath(flotilla.__file__)))
    module = "flotilla._node.reattach"
    return ["env", f"PYTHONPATH={lib}", sys.executable, "-m", module, address]


def _memory_gb() -> float:
    """This machine's memory in GB (MemTotal of /proc/meminfo; 0 when unknown)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1e6, 1)
    return 0.0


JOB_TAG = "\x1e{job}\x1f"
"""What run_script puts before each line (and each ``\\r`` redraw) of a tagged job's
output, so that a cluster running several jobs at once on a node tells their lines apart
(``jobs.untag`` removes it)."""


def _tagged_copy(fd: int, out: int, tag: bytes) -> None:
    """Copy ``fd`` to ``out`` until end of file, ``tag`` before each line and redraw."""
    start = True
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            os.close(fd)
            return
        body = chunk.replace(b"\r", b"\r" + tag).replace(b"\n", b"\n" + tag)
        if body.endswith(b"\n" + tag):
            body = body[: -len(tag)]
        text = (tag if start else b"") + body
        start = chunk.endswith(b"\n")
        with contextlib.suppress(OSError):
            os.write(out, text)


@function
def free_port() -> int:
    """A TCP port free on this node right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
    return port


@function
def run_script(
    script: str,
    env: dict[str, str],
    per_node: dict[int, dict[str, str]],
    hostfile: str | None = None,
    job: int = 0,
    workdirs: dict[int, str] | None = None,
    mesh: str = "",
    tag: bool = False,
) -> int:
    """Run ``bash -c script`` here with ``env`` and this node's ``per_node`` entry, in its
    ``workdirs`` entry (default: the current directory); its exit status (negative: killed
    by that signal). ``hostfile`` is written to a file whose path goes into
    FLOTILLA_HOSTFILE; ``mesh``: the tag of the cluster's node-to-node SSH keys (``mesh``)."""
    node = instance_info().node
    cwd = (workdirs or {}).get(node) or os.getcwd()
    full = dict(os.environ)
    full.pop("COMPUTE_POOL", None)
    if "SLURM_JOB_NODELIST" in env:  # the allocation's view, as in a batch script
        for name in [k for k in full if k in SLURM_STEP_VARS or k.startswith("SLURM_STEP_")]:
            del full[name]
    if mesh:
        full.update(mesh_env(mesh, cwd))
    full.update(env)
    full.update(per_node.get(node, {}))
    status_file = _exit_file(cwd, job)
    with contextlib.suppress(OSError):  # an earlier attempt's
        os.unlink(status_file)
    if hostfile is not None:
        path = os.path.join(cwd, ".flotilla", f"hostfile-{job}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(hostfile)
        full["FLOTILLA_HOSTFILE"] = path
    if not tag:
        proc = subprocess.Popen(["bash", "-c", script], env=full, cwd=cwd, stdin=subprocess.DEVNULL)
    else:  # its lines tagged with the job: the node may run other jobs' at the same time
        import threading

        mark = JOB_TAG.format(job=job).encode()
        pipes = [os.pipe(), os.pipe()]
        try:
            proc = subprocess.Popen(
                ["bash", "-c", script],
                env=full,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=pipes[0][1],
                stderr=pipes[1][1],
            )
        finally:
            os.close(pipes[0][1])
            os.close(pipes[1][1])
        copies = [
            threading.Thread(target=_tagged_copy, args=(r, out, mark), daemon=True)
            for (r, _), out in zip(pipes, (1, 2), strict=True)
        ]
        for t in copies:
            t.start()
    try:
        code = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if tag:  # what it printed last; processes it left behind keep their pipe (and copy)
        for t in copies:
            t.join(2.0)
    with contextlib.suppress(OSError):  # for a daemon that re-attached meanwhile (wait_job)
        os.makedirs(os.path.dirname(status_file), exist_ok=True)
        with open(status_file + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(status_file + ".tmp", status_file)
    return code


def _exit_file(cwd: str, job: int) -> str:
    """Where :func:`run_script` leaves the exit status of ``job``'s script."""
    return os.path.join(cwd, ".flotilla", f"exit-{job}")


_WAIT_GONE = 5.0  # seconds a script's status may take to appear once its processes ended


@function
def wait_job(job: int, token_prefix: str, workdirs: dict[int, str] | None = None) -> int:
    """Wait for ``job``'s script, started here by a cluster daemon that died since (its
    call ran on, see ``_node/reattach.py``), to end; its exit status (as
    :func:`run_script` returns it). Raises RuntimeError when its processes (those whose
    FLOTILLA_RUN_TOKEN starts with ``token_prefix``) are gone without a status."""
    cwd = (workdirs or {}).get(instance_info().node) or os.getcwd()
    status_file = _exit_file(cwd, job)
    wanted = f"{TOKEN_VAR}={token_prefix}".encode()
    gone_since: float | None = None
    while True:
        with contextlib.suppress(OSError, ValueError), open(status_file) as f:
            return int(f.read())
        if any(procs.has_env(pid, wanted) for pid in procs.pids()):
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since > _WAIT_GONE:
            raise RuntimeError(f"job {job}'s script ended without an exit status")
        time.sleep(0.2)


@function
def job_env(token_prefix: str, names: list[str]) -> dict[str, str]:
    """The values of ``names`` in the environment of a process of this machine whose
    FLOTILLA_RUN_TOKEN starts with ``token_prefix`` (a job's, see ``adopt.reveal``);
    empty when none runs."""
    wanted = f"{TOKEN_VAR}={token_prefix}".encode()
    for pid in procs.pids():
        if not procs.has_env(pid, wanted):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        env = dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)
        return {name: env[name] for name in names if name in env}
    return {}


@function
def reap(token_prefix: str) -> int:
    """Kill (SIGKILL) every process on this machine whose environment has a
    FLOTILLA_RUN_TOKEN starting with ``token_prefix``; the number killed."""
    wanted = f"{TOKEN_VAR}={token_prefix}".encode()
    return procs.kill_all(lambda pid: procs.has_env(pid, wanted))


@function
def unpack(
    archive: bytes,
    targets: dict[str, str],
    home_is_workdir: bool,
    workdirs: dict[int, str] | None = None,
) -> int:
    """Unpack a sync archive: member ``workdir/...`` into this node's working directory
    (its ``workdirs`` entry, default: the current directory), member ``<key>[/...]`` to
    ``targets[key]`` (a file mount). Returns the files written.

    On providers whose nodes share this machine (``home_is_workdir``), ``~`` and relative
    node paths are inside the node's working directory, so nodes do not overwrite each
    other; absolute paths are written under a lock, by one node at a time.
    """
    cwd = (workdirs or {}).get(instance_info().node) or os.getcwd()
    written = 0
    now = time.time()  # archives carry one fixed time: a changed file must look changed
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        members = tar.getmembers()
        for key, dest_root in [(WORKDIR_MEMBER, cwd), *targets.items()]:
            if key != WORKDIR_MEMBER:
                dest_root = _node_path(dest_root, cwd, home_is_workdir)
            mine = [m for m in members if m.name == key or m.name.startswith(key + "/")]
            if not mine:
                continue
            shared = not os.path.abspath(dest_root).startswith(cwd + os.sep)
            with locks.named(os.path.abspath(dest_root)) if shared else contextlib.nullcontext():
                for m in mine:
                    if m.name == key:  # the mount's own entry: a file, or the folder itself
                        if m.isdir():
                            os.makedirs(dest_root, exist_ok=True)
                            continue
                        m.name = os.path.basename(dest_root)
                        parent = os.path.dirname(dest_root) or "."
                    else:
                        m.name = m.name[len(key) + 1 :]
                        parent = dest_root
                    os.makedirs(parent, exist_ok=True)
                    m.mtime = now  # (Python's byte-code cache compares times and sizes)
                    untar.extract(tar, parent, [m])
                    written += 1
    return written


def _node_path(target: str, cwd: str, home_is_workdir: bool) -> str:
    if home_is_workdir:
        if target == "~" or target.startswith("~/"):
            return os.path.join(cwd, target[2:])
        if not os.path.isabs(target):
            return os.path.join(cwd, target)
        return target
    return os.path.abspath(os.path.expanduser(target))
