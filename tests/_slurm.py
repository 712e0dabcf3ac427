"""A real SLURM cluster on this machine: munged, slurmctld and 3 slurmd test hosts.

``SlurmCluster`` builds it (root only) and tears everything down, also after failures::

    with SlurmCluster() as cluster:
        cluster.env          # os.environ + SLURM_CONF: every SLURM command talks to this cluster
        cluster.nodes        # [TestHost n1, n2, n3] with their addresses

The hosts are ``_hosts.Lab`` network namespaces on a bridge (unique names, a free /24), each
with its own hostname (``n1``...) and /etc/hosts, running one ``slurmd``; ``slurmctld`` and
``munged`` run in this machine's namespace and listen on the bridge's address. Everything
is private to the cluster: its own munge key and socket, ports, ``ClusterName``, state,
spool, pid and log files under one temporary folder, and a ``slurm.conf`` that the commands
find through the ``SLURM_CONF`` environment variable (so a system-wide SLURM, if any, is
never touched).

The pytest fixture ``slurm_cluster`` (session scope) wraps it; test modules import it:
``from _slurm import slurm_cluster_fixture  # noqa: F401``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _hosts import Lab, LabError, SharedLab, TestHost, _in_netns, lab_unavailable
from _lifecycle import Lifecycle

NODES = 3
CPUS = 2
MEMORY_MB = 2000
PARTITION = "debug"
"""The default partition: every node, no time limit (MaxTime=INFINITE, no DefaultTime)."""
SHORT_PARTITION = "short"
"""A second partition: nodes n1-n2, DefaultTime 10 minutes, MaxTime 1 hour."""

_SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost={ctl_host}({ctl_addr})
SlurmctldPort={ctl_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MinJobAge=10
KillWait=2
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool-%n
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd-%n.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd-%n.log
{nodes}
PartitionName={partition} Nodes={all_nodes} Default=YES MaxTime=INFINITE State=UP
PartitionName={short} Nodes={short_nodes} DefaultTime=00:10:00 MaxTime=01:00:00 State=UP
"""


class SlurmUnavailable(LabError):
    """No SLURM test cluster can be built on this machine."""


def cluster_unavailable() -> str | None:
    """Why no cluster can be built here (None: it can)."""
    reason = lab_unavailable()
    if reason:
        return reason.replace("SSH test hosts", "SLURM test hosts")
    if shutil.which("nsenter") is None or shutil.which("unshare") is None:
        return "SLURM test hosts need nsenter and unshare (util-linux)"
    return None


def ensure_slurm() -> None:
    """Install slurm-wlm and munge if missing (apt-get update only when the install fails)."""
    if all(shutil.which(c) for c in ("slurmctld", "slurmd", "munged", "salloc", "srun")):
        return
    install = ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, capture_output=True, env=env).returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, env=env)
        proc = subprocess.run(install, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"cannot install slurm-wlm: {proc.stderr.strip()[-500:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class SlurmLab(Lab):
    """A ``Lab`` whose hosts run slurmd (named ``n1``, ``n2``...) instead of sshd."""

    def __init__(self, cluster: SlurmCluster) -> None:
        super().__init__()
        self.cluster = cluster

    def start_sshd(
        self, host: TestHost, authorized_keys: Path | None = None, wait: bool = True
    ) -> None:  # the hook that starts a host's daemon: slurmd
        host.hostname = f"n{host.index}"
        self.start_daemon(
            host,
            f"exec slurmd -D -N {host.hostname} -f {self.cluster.conf}",
            "slurmd.out",
            hosts_text=self.cluster.hosts_text(),
            env=self.cluster.env,
        )


class SlurmCluster(Lifecycle):
    """munged + slurmctld here, one slurmd per test host; a context manager."""

    def __init__(self, nodes: int = NODES) -> None:
        self.count = nodes
        self.lab = SlurmLab(self)
        self.tmp = self.lab.tmp
        self.conf = self.tmp / "slurm.conf"
        self.name = f"fl{self.lab.tag}"[:30]
        self.env: dict[str, str] = {}
        self.nodes: list[TestHost] = []
        self.munged: subprocess.Popen[bytes] | None = None
        self.slurmctld: subprocess.Popen[bytes] | None = None
        self._logs: list[object] = []

    @property
    def ctl_addr(self) -> str:
        return f"{self.lab.subnet}.1"

    def node_addr(self, index: int) -> str:
        """The address of node ``n{index}`` (the lab gives host i the address .i+1)."""
        return f"{self.lab.subnet}.{index + 1}"

    def hosts_text(self) -> str:
        lines = ["127.0.0.1 localhost", f"{self.ctl_addr} {socket.gethostname()}"]
        lines += [f"{self.node_addr(i)} n{i}" for i in range(1, self.count + 1)]
        return "\n".join(lines) + "\n"

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        reason = cluster_unavailable()
        if reason:
            raise SlurmUnavailable(reason)
        ensure_slurm()
        self.lab.start()
        for name in ("state", "munge"):
            (self.tmp / name).mkdir(mode=0o700)
        self._start_munged()
        self._write_conf()
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
            "SLURM_CONF": str(self.conf),
        }
        self._start_slurmctld()
        self.nodes = self.lab.add_hosts(self.count)
        self.wait_idle()

    def _start_munged(self) -> None:
        munge = self.tmp / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        log = open(self.tmp / "munged.out", "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        self.munged = subprocess.Popen(
            [
                "munged",
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={munge / 'socket'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'seed'}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        self._wait(lambda: (munge / "socket").exists(), self.munged, "munged", 10.0)

    def _write_conf(self) -> None:
        nodes = "\n".join(
            f"NodeName=n{i} NodeAddr={self.node_addr(i)} NodeHostname=n{i} "
            f"CPUs={CPUS} RealMemory={MEMORY_MB} State=UNKNOWN"
            for i in range(1, self.count + 1)
        )
        self.conf.write_text(
            _SLURM_CONF.format(
                cluster=self.name,
                ctl_host=socket.gethostname().split(".")[0],
                ctl_addr=self.ctl_addr,
                ctl_port=_free_port(),
                slurmd_port=_free_port(),
                munge_socket=self.tmp / "munge" / "socket",
                tmp=self.tmp,
                nodes=nodes,
                partition=PARTITION,
                all_nodes=f"n[1-{self.count}]",
                short=SHORT_PARTITION,
                short_nodes=f"n[1-{min(2, self.count)}]",
            )
        )
        self.conf.chmod(0o644)

    def _start_slurmctld(self) -> None:
        log = open(self.tmp / "slurmctld.out", "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        self.slurmctld = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=self.env,
        )
        self._wait(
            lambda: self.slurm("sinfo", "-h", check=False).returncode == 0,
            self.slurmctld,
            "slurmctld",
            15.0,
        )

    def _wait(
        self,
        ready: object,
        proc: subprocess.Popen[bytes],
        what: str,
        timeout: float,
    ) -> None:
        assert callable(ready)
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{what} exited ({proc.returncode}): {self.logs()}")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"{what} not ready after {timeout:g} s: {self.logs()}")
            time.sleep(0.05)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Poll sinfo until every node is idle (ready for jobs)."""
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            states = self.slurm("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
            idle = [line for line in states.splitlines() if line.split()[-1:] == ["idle"]]
            if len({line.split()[0] for line in idle}) == self.count:
                return
            for host in self.nodes:
                if host.sshd is not None and host.sshd.poll() is not None:
                    raise SlurmUnavailable(f"slurmd of {host.hostname} exited: {self.logs()}")
            time.sleep(0.05)
        raise SlurmUnavailable(f"nodes not idle after {timeout:g} s ({states!r}): {self.logs()}")

    def logs(self) -> str:
        out = []
        for path in sorted(self.tmp.glob("*.log")) + sorted(self.tmp.glob("*.out")):
            text = path.read_text(errors="replace").strip()
            if text:
                out.append(f"--- {path.name} ---\n{text[-1500:]}")
        return "\n".join(out)

    def kill_clients(self) -> int:
        """SIGKILL this cluster's client commands still running on this machine (salloc,
        srun: their environment names its slurm.conf); how many. A salloc outliving its
        killed client and then its cluster spins on the CPU for ever (seen after
        test_kill_9_releases_the_job_within_30_s; see the issue notes)."""
        from flotilla._system import procs

        marker = f"SLURM_CONF={self.conf}".encode()
        return procs.kill_all(lambda pid: procs.has_env(pid, marker))

    def close(self) -> None:
        """Stop the daemons, every process on the hosts, the cluster's client commands
        left running, and remove everything. Idempotent."""
        if self.slurmctld is not None and self.slurmctld.poll() is None:
            self.slurm("scontrol", "shutdown", check=False)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.slurmctld.wait(10)
        for host in self.nodes:
            if host.sshd is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.sshd.wait(5)
        self.lab.close()  # kills what is left on the hosts, removes namespaces and bridge
        for proc in (self.slurmctld, self.munged):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        for log in self._logs:
            with contextlib.suppress(Exception):
                log.close()  # type: ignore[attr-defined]
        self._logs.clear()
        self.nodes = []
        self.slurmctld = self.munged = None
        self.kill_clients()  # the daemons are gone: what still names the cluster is a client

    # -- queries ---------------------------------------------------------------------
    def slurm(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a SLURM command against this cluster."""
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=30)
        if check and proc.returncode != 0:
            raise LabError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def jobs(self) -> list[str]:
        """Every job in the queue, as "id name state reason" lines."""
        out = self.slurm("squeue", "-h", "-o", "%i %j %T %r").stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def wait_queue_empty(self, timeout: float = 30.0, name: str = "") -> list[str]:
        """Poll squeue until no job (named ``name``..., if given) is left; what is left."""
        deadline = time.monotonic() + timeout
        while True:
            left = [j for j in self.jobs() if j.split()[1].startswith(name)]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)


def _started_cluster() -> SlurmCluster:
    cluster = SlurmCluster()
    try:
        cluster.start()
    except BaseException:
        cluster.close()
        raise
    return cluster


_SLURM = SharedLab(_started_cluster)


@pytest.fixture(scope="session", name="slurm_cluster")
def slurm_cluster_fixture() -> Iterator[SlurmCluster]:
    """Three idle SLURM nodes for the whole session (skips when they cannot be built),
    one cluster shared by every module that imports this fixture (:class:`SharedLab`)."""
    reason = cluster_unavailable()
    if reason:
        pytest.skip(reason)
    with _SLURM.use() as cluster:
        yield cluster


def in_netns_of(host: TestHost) -> list[str]:
    """Command prefix that runs in ``host``'s network namespace."""
    return _in_netns(host.netns)


def scratch(cluster: SlurmCluster, name: str) -> Path:
    """A fresh folder under the cluster's temporary folder (every node sees it)."""
    path = cluster.tmp / name
    path.mkdir(exist_ok=True)
    return path
