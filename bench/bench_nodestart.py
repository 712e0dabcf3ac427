"""The CPU a node start costs: every process a start makes, from /proc (issue 42, item 1).

    .venv/bin/python bench/bench_nodestart.py [--reps 5] [--nodes 2] [--before SRC] [--ssh] [--aws]
        [--k8s] [--bare-env]

Each repetition starts a pool in a fresh process, answers one no-op on every node, and then
reads, for every process of each node (Local: the agent and its executors, children of
the measuring process or of its fork server, whose own CPU is shared out among the nodes; SSH, as root: every process of the host's network namespace but its
sshd daemon: the session's sshd, the start shell, the agent, the executors; EC2 lab, as
root: what the instance's sshd daemon started, i.e. the same, but not the lab's own
stand-ins for the instance's boot; Kubernetes lab, as root: every process of the pod's
network namespace, i.e. the pod's holder and what ``kubectl exec`` started there, with, as
roles beside, the client's ``kubectl`` processes and the lab's control plane and kubelet
stand-in over the start, per node), the CPU it
spent: ``/proc/PID/task/*/schedstat`` (ns) for the live ones and the ``cutime + cstime``
of ``/proc/PID/stat`` for the children they reaped (clock ticks: 10 ms). As root, an SSH
host's or EC2 lab instance's start is also counted whole by its sshd daemon's cgroup
(:data:`CPUACCT`, to the nanosecond, ended processes too: the session's pre-authentication
child, the port probe's connection), printed below the table with the floor: an empty SSH
session (``ssh host true``, as any SSH tool pays to run a command there, the options
flotilla's ssh uses) through an SSH lab host's sshd, counted the same way after every
start, and the start beyond it (whole by cgroup minus that floor, same rep: the Kubernetes
lab's counterpart is the pod's processes beside ``kubectl exec``). Prints the CPU per node start (median
over the nodes, the CPU by role, and the client's own CPU for the pool's start) per
repetition on stderr, and the medians as a markdown table with the load
(``/proc/loadavg``) on stdout.

``--bare-env``: SSH and EC2 lab starts also on hosts without this machine's environment,
same run, side by side: ``_sandboxing_egress_ca.pth`` (this sandbox's: every ``python3``
start imports certifi for it) masked in the hosts' own mount namespace (an empty file bound
over it there, see ``Lab.add_host``'s ``hidden``; the machine's file stays as it is). Local
agents and Kubernetes lab pods run the bench's own interpreter (a venv: no such ``.pth``),
so their starts are "bare" already. The table splits every start by process: flotilla's
(the agent, its executors, a cloud node's helper and watchdog, a pod's holder) and the
host's (the session's sshd, the login shell that runs the start command).

``--before [NAME=]SRC`` (repeatable) also measures flotilla from another source folder
(e.g. ``git archive`` of main, extracted): same run, order rotating. ``--warm``: starts
that find the bundle (and the byte code the first start wrote) on the hosts. Otherwise
every start is a *first* start: the bundle folder is removed before each, as on a new host
or a new instance (the EC2 lab's instances share this machine's files: without that, all
but a run's first would find the bundle). The compiled node code
(``_providers.bytecode``) is built before the first repetition (the one-time build's CPU
is printed once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
_TICK = os.sysconf("SC_CLK_TCK")
ENV_PTH = "_sandboxing_egress_ca.pth"
"""This machine's start-up file in its interpreters' site-packages (``--bare-env`` masks it)."""
FLOTILLA = ("agent", "executor", "cloud helper", "watchdog", "holder", "fork server")
"""The processes of a start that run flotilla's code; the others (sshd, the login shell) are
the host's way in."""


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def own_cpu(pid: int) -> float:
    """CPU seconds of a live process's own threads (not of the children it reaped); what
    could be read of a process that is ending."""
    total = 0.0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    return total


def cpu_of(pid: int) -> float:
    """CPU seconds of a live process (all its threads) and of the children it reaped."""
    total = own_cpu(pid)
    try:
        fields = _stat(pid)
    except (OSError, IndexError, ValueError):
        return total
    return total + (int(fields[13]) + int(fields[14])) / _TICK


BOOT_DELAY = 2.0
"""Seconds an EC2 lab instance takes to boot (its sshd to start) after its launch."""
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
"""cgroup v1's CPU accounting (root only): an SSH lab host's sshd daemon is moved into a
cgroup of its own, so every process it starts, those that ended too, is counted to the
nanosecond. ``/proc`` counts a reaped child only in 10 ms clock ticks (sshd's
pre-authentication child), which the per-process figures undercount."""


def cgroup_cpu(path: str) -> float:
    """CPU seconds of every process that was in the cgroup at ``path``."""
    with open(os.path.join(path, "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


def can_count() -> bool:
    """Whether this process may make cgroups to count hosts' CPU in."""
    return os.geteuid() == 0 and os.access(CPUACCT, os.W_OK)


def cgroup_of(netns: str) -> str:
    """The cgroup counting the host (network namespace) ``netns``'s sshd daemon."""
    return str(CPUACCT / f"flotilla-bench-{netns}")


def host_cgroups(daemons: dict[str, int]) -> dict[str, str]:
    """netns -> a new cgroup holding that host's sshd daemon (:func:`cgroup_of`; none
    where this process cannot make them, :func:`can_count`)."""
    if not can_count():
        return {}
    made = {}
    for netns, daemon in daemons.items():
        path = Path(cgroup_of(netns))
        path.mkdir()
        (path / "cgroup.procs").write_text(str(daemon))
        made[netns] = str(path)
    return made


def settled(path: str) -> None:
    """Wait until the cgroup holds its daemon alone (the last start's sessions ended)."""
    deadline = time.monotonic() + 30
    while len(Path(path, "cgroup.procs").read_text().split()) > 1:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_nodestart: the last start's sessions are still in {path}")
        time.sleep(0.02)


FLOOR_SESSIONS = 3
"""Empty sessions per floor measurement (their mean is the floor of that rep)."""


def floor(addr: str, daemon: int, path: str, key: str, known_hosts: str) -> float:
    """CPU seconds of an empty SSH session (``true``) through the sshd daemon ``daemon``,
    counted by its cgroup ``path`` without the daemon's own (accepting, forking): what any
    SSH tool's command costs the host, with the options flotilla's ssh uses
    (``ssh_shell.SSHShell.ssh_argv``). The mean of :data:`FLOOR_SESSIONS`, one after the
    other."""
    from flotilla._providers.ssh_shell import SSHShell, Target

    target = Target(addr, "root", 22)
    shell = SSHShell(
        lambda _: target,
        key=key,
        known_hosts=known_hosts,
        accept_new_host_keys=False,
        connect_timeout=60,
    )
    argv = shell.ssh_argv(target, "true")
    settled(path)
    used, own = cgroup_cpu(path), own_cpu(daemon)
    for _ in range(FLOOR_SESSIONS):
        subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=True,
            timeout=60,
        )
    settled(path)
    return (cgroup_cpu(path) - used - (own_cpu(daemon) - own)) / FLOOR_SESSIONS


def drop_cgroups(paths: list[str]) -> None:
    """Move the cgroups' processes back to the root cgroup and remove them."""
    for path in paths:
        for pid in Path(path, "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPUACCT / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            os.rmdir(path)


def children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out.setdefault(int(_stat(int(entry))[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def tree(pid: int, kids: dict[int, list[int]]) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def load() -> str:
    with open("/proc/loadavg") as f:
        one, _, _, running, _ = f.read().split()
    return f"{one} ({running.split('/')[0]} runnable)"


# -- the child: one pool start --------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    import flotilla as sky

    @sky.function
    def noop() -> int:
        return os.getpid()

    mine = time.process_time()
    spec: dict[str, Any] = json.loads(args.ssh_spec) if args.ssh_spec else {}
    if args.ssh_spec:
        if spec.get("aws"):
            from flotilla._providers.aws import AWS

            provider: Any = AWS(**spec["options"])
        elif spec.get("k8s"):
            from flotilla._providers.k8s import Kubernetes

            provider = Kubernetes(
                kubeconfig=spec["kubeconfig"], kubectl=spec["kubectl"], python=sys.executable
            )
        else:
            from flotilla._providers.ssh import SSH

            provider = SSH(spec["hosts"], **spec["options"])
    else:
        provider = sky.Local()
    lab0 = {name: cpu_of(pid) for name, pid in (spec.get("lab") or {}).items()}
    cgroups: list[str] = spec.get("cgroups") or []
    exact0 = [cgroup_cpu(g) for g in cgroups]
    reaped0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with sky.Compute(provider=provider, nodes=args.nodes) as pool:
        pids = noop() @ pool
        took = time.perf_counter() - t0
        client = time.process_time() - mine
        exact = [cgroup_cpu(g) - c for g, c in zip(cgroups, exact0, strict=True)]
        kids = children_map()
        per_node: list[float] = []
        roles: dict[str, float] = {}
        if spec.get("k8s"):  # the pods' processes; the client's kubectl, the lab's
            per_node = kubernetes_start(spec, kids, lab0, reaped0, roles, args.nodes)
        elif args.ssh_spec:
            sys.path.insert(0, str(HERE.parent / "tests"))
            from _hosts import pids_in_netns

            for netns, daemon in spec.get("netns") or instances(spec["prefix"], kids):
                named: dict[int, str] = {}
                if spec.get("aws"):  # what the sshd started, not the lab's boot stand-ins
                    session = [p for p in tree(daemon, kids) if p != daemon]
                    if os.path.isdir(cgroup_of(netns)):  # all it started, but its own boot
                        exact.append(cgroup_cpu(cgroup_of(netns)) - own_cpu(daemon))
                    # and the watchdog: a daemon forked from the agent (its command line)
                    agents = {cmdline(p) for p in session if role(p) == "agent"}
                    for p in pids_in_netns(netns):
                        if p not in session and cmdline(p) in agents:
                            session.append(p)
                            named[p] = "watchdog"
                else:
                    session = [p for p in pids_in_netns(netns) if p != daemon]
                per_node.append(sum(cpu_of(p) for p in session))
                for p in session:
                    name = named.get(p) or role(p)
                    roles[name] = roles.get(name, 0.0) + cpu_of(p) / args.nodes
        else:
            agents, servers = [], []
            for p in kids.get(os.getpid(), []):
                if is_fork_server(p):  # its agents' shared start: a share for each node
                    servers.append(p)
                    agents.extend(kids.get(p, []))
                else:
                    agents.append(p)
            shared = sum(cpu_of(p) for p in servers) / args.nodes
            if servers:
                roles["fork server"] = shared
            for agent in agents:
                per_node.append(shared + sum(cpu_of(p) for p in tree(agent, kids)))
                for p in tree(agent, kids):
                    name = "agent" if p == agent else "executor"
                    roles[name] = roles.get(name, 0.0) + cpu_of(p) / args.nodes
        assert len(set(pids)) == args.nodes, pids
    got = {"per_node": per_node, "client": client, "took": took, "roles": roles}
    print(json.dumps(got | ({"exact": exact} if exact else {})))


def kubernetes_start(
    spec: dict[str, Any],
    kids: dict[int, list[int]],
    lab0: dict[str, float],
    reaped0: resource.struct_rusage,
    roles: dict[str, float],
    nodes: int,
) -> list[float]:
    """A Kubernetes lab start: per pod, the CPU of every process of its network namespace
    (the holder, and the start shell, agent and executors ``kubectl exec`` started);
    beside it, per node (in ``roles``): the client's ``kubectl`` processes (live and
    reaped) and each lab process's CPU since ``lab0`` (the API server, etcd, the scheduler,
    the kubelet stand-in: this machine's stand-ins for the cluster)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from _hosts import pids_in_netns

    per_node = []
    for netns in sorted(os.listdir("/run/netns")):
        pids = pids_in_netns(netns) if netns.startswith(spec["prefix"]) else []
        if pids:
            per_node.append(sum(cpu_of(p) for p in pids))
            for p in pids:
                name = "holder" if is_holder(p) or is_holder(parent(p)) else role(p)
                roles[name] = roles.get(name, 0.0) + cpu_of(p) / nodes
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = sum(cpu_of(p) for p in kids.get(os.getpid(), []) if comm(p) == "kubectl")
    spent = reaped.ru_utime + reaped.ru_stime - reaped0.ru_utime - reaped0.ru_stime
    roles["kubectl (client)"] = (live + spent) / nodes
    for name, pid in spec["lab"].items():
        roles[f"lab {name}"] = (cpu_of(pid) - lab0[name]) / nodes
    return per_node


def is_holder(pid: int) -> bool:
    """A pod's holder: the shell one (its ``flock`` and ``sleep`` are its children) or the
    Python one (``PYTHON_HOLDER``, where the image has no ``flock``)."""
    line = cmdline(pid)
    return b"flotilla-holder" in line or b"free_since" in line


def parent(pid: int) -> int:
    try:
        return int(_stat(pid)[1])
    except (OSError, IndexError, ValueError):
        return 0


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def instances(prefix: str, kids: dict[int, list[int]]) -> list[tuple[str, int]]:
    """(network namespace, sshd daemon) of each EC2 lab instance running now: the lab's
    namespaces named ``{prefix}N``; the daemon, the sshd there whose parent is no sshd
    (an instance whose daemon runs no session is another pool's, ending)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from _hosts import pids_in_netns

    out = []
    for netns in sorted(os.listdir("/run/netns")):
        if not netns.startswith(prefix):
            continue
        for p in pids_in_netns(netns):
            try:
                parent = int(_stat(p)[1])
            except (OSError, IndexError, ValueError):
                continue
            daemon = comm(p).startswith("sshd") and not comm(parent).startswith("sshd")
            if daemon and len(tree(p, kids)) > 1:  # a session: an instance of this pool
                out.append((netns, p))
    return out


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def is_fork_server(pid: int) -> bool:
    """A local pool's fork server (its agents are its children)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"flotilla._node.forkserver" in f.read().split(b"\0")
    except OSError:
        return False


def role(pid: int) -> str:
    """An SSH host's process: sshd, the start shell, the agent, an executor (a fork of the
    agent with a process group of its own) or a cloud node's helper (a fork that has not)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            name = f.read().strip()
        fields = _stat(pid)
        parent, group = int(fields[1]), int(fields[2])
        with open(f"/proc/{parent}/comm") as f:
            parent_name = f.read().strip()
    except (OSError, IndexError, ValueError):
        return "gone"
    if name.startswith("python"):
        if not parent_name.startswith("python"):
            return "agent"
        return "executor" if group == pid else "cloud helper"
    return "sshd" if "sshd" in name else name


def masked_files(python: str) -> list[str]:
    """``--bare-env``: the file(s) to mask on the hosts, ``ENV_PTH`` in ``python``'s
    site-packages (the machine's ``python3`` when ``python`` is ''); none where it has no
    such file (another machine: its hosts are bare already)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from _hosts import _python3_folder

    python = python or os.path.join(_python3_folder(), "python3")
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    done = subprocess.run([python, "-S", "-c", code], capture_output=True, text=True)
    found = Path(done.stdout.strip()) / ENV_PTH
    if done.returncode or not found.is_file():
        print(f"--bare-env: {python} has no {ENV_PTH}: hosts as they are only", file=sys.stderr)
        return []
    return [str(found)]


def run_child(src: Path, args: argparse.Namespace, ssh_spec: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, __file__, "--child", "--nodes", str(args.nodes)]
    if ssh_spec:
        cmd += ["--ssh-spec", ssh_spec]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"bench_nodestart: a start failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_once() -> float:
    """Build the compiled node code (if missing): its CPU seconds in a fresh process."""
    code = (
        "import time; t = time.process_time()\n"
        "from flotilla._providers import bootstrap, bytecode\n"
        "bytecode.compiled(bootstrap._package_dirs()); print(time.process_time() - t)"
    )
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return float(out.stdout.strip() or "nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument(
        "--before",
        action="append",
        default=[],
        metavar="[NAME=]SRC",
        help="also flotilla from this src folder (repeatable)",
    )
    parser.add_argument("--ssh", action="store_true", help="SSH test hosts (root) too")
    parser.add_argument("--aws", action="store_true", help="EC2 lab instances (root) too")
    parser.add_argument("--k8s", action="store_true", help="Kubernetes lab pods (root) too")
    parser.add_argument("--no-local", action="store_true", help="SSH hosts only")
    parser.add_argument("--warm", action="store_true", help="SSH: keep the hosts' bundle")
    parser.add_argument("--ssh-python", default="", help="SSH: the hosts' interpreter")
    parser.add_argument(
        "--bare-env",
        action="store_true",
        help=f"SSH/EC2 lab: also starts with {ENV_PTH} masked on the hosts, side by side",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ssh-spec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(
        f"The compiled node code took {build_once():.3f} CPU-s to find or build (a client"
        " process's import and source hash alone: ~0.08 s)."
    )
    variants = [("after", SRC)]
    for before in args.before:
        name, _, src = before.rpartition("=")
        variants.append((name or "before", Path(src)))
    providers = ([] if args.no_local else ["local"]) + (["ssh"] if args.ssh else [])
    providers += ["aws"] if args.aws else []
    providers += ["k8s"] if args.k8s else []
    rows: list[tuple[str, str, int, str, dict[str, Any]]] = []
    lab = aws = k8s = None
    cgroups: dict[str, str] = {}  # netns -> the cgroup counting its sshd daemon
    aws_prefix = ""
    masked = masked_files(args.ssh_python) if args.bare_env else []
    try:
        spec = aws_spec = k8s_spec = bare_spec = ""
        if args.k8s:
            sys.path.insert(0, str(HERE.parent / "tests"))
            from _k8s import K8sLab

            k8s = K8sLab()
            k8s.start()
            k8s_spec = json.dumps(
                {
                    "k8s": True,
                    "kubeconfig": str(k8s.kubeconfig),
                    "kubectl": k8s.kubectl_path,
                    "prefix": f"flotilla-{k8s.tag}-h",
                    "lab": {comm(p.pid): p.pid for p in k8s.procs},
                }
            )
        if args.aws:
            sys.path.insert(0, str(HERE.parent / "tests"))
            from _aws import AwsLab

            # booting as a real instance does: its network answers (refuses) before its
            # sshd listens. Booting at once, the port probes in flight while the lab's ARP
            # resolved the new address all connected together, each an sshd (~9 ms) the
            # start paid, as a real instance's start does not
            aws = AwsLab(boot_delay=BOOT_DELAY)
            aws.start()
            aws_prefix = f"flotilla-{aws.lab.tag}-h"
            os.environ.update(aws.env)  # (the lab no longer sets it: its clients here need it)
            if can_count():
                aws.sshd_started = lambda host: cgroups.update(
                    host_cgroups({host.netns: host.sshd.pid})
                )
            aws_spec = json.dumps(
                {
                    "aws": True,
                    "options": aws.provider_options(),
                    "prefix": aws_prefix,
                }
            )
        if args.ssh:
            sys.path.insert(0, str(HERE.parent / "tests"))
            from _hosts import Lab

            lab = Lab()
            lab.start()
            hosts = lab.add_hosts(args.nodes)
            bare = [lab.add_host(hidden=tuple(masked)) for _ in range(args.nodes if masked else 0)]
            options = {
                "user": "root",
                "key": str(lab.client_key),
                "known_hosts": str(lab.known_hosts),
                "workdir": str(lab.tmp / "workdir"),
                "connect_timeout": 10.0,
            }
            if args.ssh_python:
                options["python"] = args.ssh_python
            assert all(h.sshd is not None for h in hosts + bare)

            cgroups.update(host_cgroups({h.netns: h.sshd.pid for h in hosts + bare if h.sshd}))

            def ssh_spec(hosts: list[Any]) -> str:
                netns = [(h.netns, h.sshd.pid) for h in hosts if h.sshd is not None]
                exact = [cgroups[n] for n, _ in netns if n in cgroups]
                return json.dumps(
                    {
                        "hosts": [h.addr for h in hosts],
                        "options": options,
                        "netns": netns,
                        "cgroups": exact if len(exact) == len(netns) else [],
                    }
                )

            spec, bare_spec = ssh_spec(hosts), ssh_spec(bare) if bare else ""
        floor_host = None  # an SSH lab host whose sshd gives each rep's floor
        if (args.ssh or args.aws) and can_count():
            if lab is None:  # (the EC2 lab's instances run the same sshd and configuration)
                sys.path.insert(0, str(HERE.parent / "tests"))
                from _hosts import Lab

                lab = Lab()
                lab.start()
            floor_host = lab.hosts[0] if lab.hosts else lab.add_host()
            assert floor_host.sshd is not None
            if floor_host.netns not in cgroups:
                cgroups.update(host_cgroups({floor_host.netns: floor_host.sshd.pid}))
        starts = [
            (name, src, env) for name, src in variants for env in ("", "bare")[: 1 + bool(masked)]
        ]
        for rep in range(args.reps):
            shift = rep % len(starts)
            order = starts[shift:] + starts[:shift]
            for provider in providers:
                for name, src, env in order:
                    if env and provider not in ("ssh", "aws"):
                        continue  # Local and the Kubernetes pods: the bench's own interpreter
                    label = f"{name}, {env}" if env else name
                    if provider == "ssh" and lab is not None and not args.warm:  # first starts
                        for h in lab.hosts:
                            shutil.rmtree(h.path(lab.tmp / "workdir" / "lib"), ignore_errors=True)
                        shutil.rmtree(lab.tmp / "workdir" / "lib", ignore_errors=True)
                        for path in cgroups.values():
                            settled(path)
                    if provider == "k8s" and k8s is not None:  # the last start's pods gone
                        managed = "app.kubernetes.io/managed-by=flotilla"
                        while k8s.pods(selector=managed) or k8s.running_pod_processes():
                            time.sleep(0.2)
                    if aws is not None:  # the instances this start boots
                        aws.hidden = tuple(masked) if env else ()
                        if provider == "aws" and not args.warm:  # new instances: first starts
                            # (the lab's instances share this machine's files, the bundle too)
                            shutil.rmtree(aws.lab.tmp / "workdir" / "lib", ignore_errors=True)
                    specs = {"ssh": bare_spec if env else spec, "aws": aws_spec, "k8s": k8s_spec}
                    got = run_child(src, args, specs.get(provider, ""))
                    if provider in ("ssh", "aws") and floor_host is not None and lab is not None:
                        assert floor_host.sshd is not None
                        got["floor"] = floor(
                            floor_host.addr,
                            floor_host.sshd.pid,
                            cgroups[floor_host.netns],
                            str(lab.client_key),
                            str(lab.known_hosts),
                        )
                    if provider == "aws":  # its instances are gone: so are their daemons
                        for netns in [n for n in cgroups if n.startswith(aws_prefix)]:
                            drop_cgroups([cgroups.pop(netns)])
                    rows.append((provider, label, rep, load(), got))
                    node = statistics.median(got["per_node"])
                    print(
                        f"rep {rep} {provider} {label}: {node * 1e3:.0f} ms CPU per node "
                        f"({', '.join(f'{c * 1e3:.0f}' for c in got['per_node'])}), client "
                        f"{got['client'] * 1e3:.0f} ms, {got['took']:.2f} s; load {load()}"
                        + "".join(f"; {k} {v * 1e3:.0f}" for k, v in sorted(got["roles"].items())),
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        if lab is not None:
            lab.close()
        drop_cgroups(list(cgroups.values()))
        if aws is not None:
            aws.close()
        if k8s is not None:
            k8s.close()
    print()
    print(report(rows, providers, [label for label, _ in variants], args.reps, bool(masked)))


def report(
    rows: list[tuple[str, str, int, str, dict[str, Any]]],
    providers: list[str],
    names: list[str],
    reps: int,
    bare: bool,
) -> str:
    """The markdown table: per provider and flotilla (and host environment), the CPU per
    node start, flotilla's processes and the host's (sshd, shell) apart, each process."""
    lines = [
        f"| provider | flotilla | CPU per node start, median (min-max), {reps} reps | "
        "flotilla's processes | sshd + shell | by process | client CPU | load (1 min) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def ms(values: list[float]) -> str:
        return (
            f"{statistics.median(values) * 1e3:.0f} ms "
            f"({min(values) * 1e3:.0f}-{max(values) * 1e3:.0f})"
        )

    labels = [n for name in names for n in ((name, f"{name}, bare") if bare else (name,))]
    for provider in providers:
        for label in labels:
            mine = [r for r in rows if r[0] == provider and r[1] == label]
            if not mine:
                continue
            nodes = [statistics.median(r[4]["per_node"]) for r in mine]
            client = [r[4]["client"] for r in mine]
            loads = [float(r[3].split()[0]) for r in mine]
            ours = [sum(v for k, v in r[4]["roles"].items() if k in FLOTILLA) for r in mine]
            host = [r[4]["roles"].get("sshd", 0.0) + shell(r[4]["roles"]) for r in mine]
            names_seen = sorted({k for r in mine for k in r[4]["roles"]})
            each = ", ".join(
                f"{k} {statistics.median(r[4]['roles'].get(k, 0.0) for r in mine) * 1e3:.0f}"
                for k in names_seen
            )
            lines.append(
                f"| {provider} | {label.replace(', bare', ', host bare')} | {ms(nodes)} | "
                f"{ms(ours)} | {ms(host) if any(host) else '-'} | {each} | "
                f"{statistics.median(client) * 1e3:.0f} ms | {min(loads):.1f}-{max(loads):.1f} |"
            )
    lines.append("")
    for provider in providers:
        for label in labels:
            mine = [r for r in rows if r[0] == provider and r[1] == label and r[4].get("exact")]
            if mine:
                exact = [statistics.median(r[4]["exact"]) for r in mine]
                counted = [statistics.median(r[4]["per_node"]) for r in mine]
                lines.append(
                    f"* {provider}, {label}: every process the host's sshd daemon started, "
                    f"counted by its cgroup (to the ns, ended ones too): {ms(exact)}; the "
                    f"same starts from /proc: {ms(counted)}"
                )
                floors = [r[4]["floor"] for r in mine if "floor" in r[4]]
                if len(floors) == len(mine):
                    beyond = [e - f for e, f in zip(exact, floors, strict=True)]
                    lines.append(
                        f"  * the floor, an empty SSH session (`true`) through a lab host's "
                        f"sshd: {ms(floors)}; the start beyond it, per rep: **{ms(beyond)}**"
                    )
    pairs = [(f"{n}, bare", n) for n in names] if bare else []
    pairs += [(f"{names[0]}{e}", f"{n}{e}") for n in names[1:] for e in ("", ", bare")[: 1 + bare]]
    lines.append("")
    for provider in providers:
        for top, bottom in pairs:
            ratios = paired(rows, provider, top, bottom)
            if ratios:
                lines.append(
                    f"* {provider}: {top} / {bottom}, per rep: whole start "
                    + ", flotilla's processes ".join(
                        f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})" for r in ratios
                    )
                )
    return "\n".join(lines)


def paired(
    rows: list[tuple[str, str, int, str, dict[str, Any]]], provider: str, top: str, bottom: str
) -> tuple[list[float], list[float]] | None:
    """Per repetition, ``top``'s start over ``bottom``'s: the whole start, and flotilla's
    processes alone (None when the run has no such pair)."""
    by = {(r[1], r[2]): r[4] for r in rows if r[0] == provider}
    whole, ours = [], []
    for (label, rep), got in by.items():
        other = by.get((bottom, rep))
        if label != top or other is None:
            continue
        whole.append(statistics.median(got["per_node"]) / statistics.median(other["per_node"]))
        mine, theirs = (
            sum(v for k, v in g["roles"].items() if k in FLOTILLA) for g in (got, other)
        )
        ours.append(mine / theirs if theirs else float("nan"))
    return (whole, ours) if whole else None


def shell(roles: dict[str, float]) -> float:
    """The CPU of a start's login shell(s) (bash, dash, sh)."""
    return sum(v for k, v in roles.items() if k in ("bash", "sh", "dash"))


if __name__ == "__main__":
    main()
