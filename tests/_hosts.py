"""Real SSH test hosts on this machine: network namespaces on a bridge, one sshd each.

``Lab`` builds them (root only) and tears everything down, also after failures::

    with Lab() as lab:
        hosts = lab.add_hosts(3)
        provider = lab.provider(hosts)       # flotilla SSH provider with the lab's keys

Each lab has unique names (from the pid) and its own /24 in 10.x that no interface or
route of this machine uses; tests talk only to addresses the lab created. Every host has
its own address, sshd (host key made per lab), hostname, /etc/hosts, ~/.ssh, and (SSH hosts)
its own /root, /tmp and /dev/shm in a mount namespace of its own, as a separate machine has
(``TestHost.path`` reaches its files from here; ``Lab.shared`` is a folder they all see);
the client key, authorized_keys and a known_hosts pinning every host key are made per lab
too.

The pytest fixture ``ssh_lab`` (session scope, 3 hosts) wraps it; test modules import it:
``from _hosts import ssh_lab_fixture  # noqa: F401``.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import pytest
from _lifecycle import Lifecycle

SSHD = "/usr/sbin/sshd"
_SSHD_CONFIG = """\
ListenAddress {addr}
HostKey {hostkey}
PidFile {pidfile}
AuthorizedKeysFile {authorized_keys} .ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
AllowTcpForwarding yes
MaxSessions 64
MaxStartups 64
Subsystem sftp /usr/lib/openssh/sftp-server
"""


SERVE_POLL = 0.05
"""How often a lab's HTTP server (``serve_forever``'s ``poll_interval``) looks whether it
is asked to stop: its shutdown waits for that look, and socketserver's default, 0.5 s, was
most of what closing a stand-in took (one per test for the GPU markets)."""

_labs_made = 0


def next_lab_tag() -> str:
    """A tag no lab of this process had (its pid and letters): labs of every kind (SSH
    hosts, Kubernetes, Vast) name their bridges, namespaces and folders with it."""
    global _labs_made
    _labs_made += 1
    return f"{os.getpid()}{_letters(_labs_made - 1)}"


def _letters(n: int) -> str:
    """``n`` in letters (0: "a", 25: "z", 26: "ba"...): a lab's suffix, never reused in a
    process (a session makes more than 26 labs)."""
    out = chr(ord("a") + n % 26)
    while n >= 26:
        n //= 26
        out = chr(ord("a") + n % 26) + out
    return out


@functools.cache
def _python3_folder() -> str:
    """The folder of this machine's ``python3`` ('' if none), asked once per process: it
    runs pyenv's shim, most of the time a lab's start took (a lab per test for the
    markets)."""
    return subprocess.run(
        ["python3", "-c", "import os, sys; print(os.path.dirname(sys.executable))"],
        capture_output=True,
        text=True,
    ).stdout.strip()


class LabError(RuntimeError):
    """The test hosts cannot be set up on this machine."""


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure raise LabError with its output."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def lab_unavailable() -> str | None:
    """Why no lab can be built here (None: it can)."""
    if os.geteuid() != 0:
        return "SSH test hosts need root (network namespaces, a bridge, sshd)"
    if shutil.which("ip") is None:
        return "SSH test hosts need the `ip` command (iproute2)"
    return None


def ensure_sshd() -> None:
    """Install openssh-server if missing."""
    ensure_package("openssh-server", SSHD, shutil.which("ssh-keygen") or "/usr/bin/ssh-keygen")


def ensure_package(package: str, *paths: str) -> None:
    """Install the Debian ``package`` unless every one of ``paths`` exists (apt-get update
    only when the install fails); LabError when it cannot be installed."""
    if all(os.path.exists(p) for p in paths):
        return
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, capture_output=True, env=env).returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, env=env)
        proc = subprocess.run(install, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise LabError(f"cannot install {package}: {proc.stderr.strip()[-500:]}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_labs() -> None:
    """Remove the namespaces and links of labs whose process is gone (a killed test run)."""
    for line in run("ip", "netns", "list").stdout.splitlines():
        match = re.match(r"(flotilla-(\d+)[a-z]+-h\d+)\b", line)
        if match and not _pid_alive(int(match.group(2))):
            netns = match.group(1)
            for pid in pids_in_netns(netns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            run("ip", "netns", "del", netns, check=False)
    for line in run("ip", "-o", "link", "show").stdout.splitlines():
        match = re.match(r"\d+: (fl[bv](\d+)[a-z]+(x\d+)?)[@:]", line)
        if match and not _pid_alive(int(match.group(2))):
            run("ip", "link", "del", match.group(1), check=False)


def pids_in_netns(netns: str) -> list[int]:
    """Every process whose network namespace is ``/run/netns/{netns}``."""
    try:
        ns = os.stat(f"/run/netns/{netns}")
    except OSError:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (ns.st_dev, ns.st_ino):
            out.append(int(entry))
    return out


def keygen(path: Path, comment: str) -> str:
    """Make an ed25519 key pair at ``path``; return the public key line."""
    run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    return path.with_suffix(".pub").read_text().strip()


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address or a route in."""
    nets = []
    for line in run("ip", "-o", "-4", "addr", "show").stdout.splitlines():
        words = line.split()
        if "inet" in words:
            nets.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    for line in run("ip", "-o", "-4", "route", "show", "table", "all").stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first and first[0].isdigit():
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_network(first, strict=False))
    return nets


def free_subnet(seed: int) -> str:
    """A 10.x.y.0/24 (as "10.x.y") that no address or route of this machine overlaps."""
    used = _used_networks()
    for step in range(4096):
        n = seed + step * 7919
        prefix = f"10.{100 + (n >> 8) % 100}.{n % 256}"
        net = ipaddress.ip_network(f"{prefix}.0/24")
        if not any(net.overlaps(u) for u in used):
            return prefix
    raise LabError("no free 10.x.y.0/24 subnet for the test hosts")


@dataclass
class TestHost:
    """One test host: a network namespace with an address and an sshd."""

    index: int
    netns: str
    veth: str
    addr: str
    hostname: str
    folder: Path
    pubkey: str = ""
    env: dict[str, str] = field(default_factory=dict)  # set by its ~/.bashrc (else the lab's)
    hidden: tuple[str, ...] = ()  # files and folders of this machine the host cannot see
    sshd: subprocess.Popen[bytes] | None = None
    _log: Any = field(default=None, repr=False)

    __test__ = False  # not a test class, whatever pytest thinks of the name

    @property
    def home(self) -> Path:
        """The host's own /root, as this machine sees it (SSH hosts: see Lab.start_sshd)."""
        return self.folder / "home"

    def path(self, path: str | Path) -> Path:
        """``path`` as the host sees it, reached from this machine (through its daemon's
        root: /proc/PID/root), e.g. a file its sessions wrote in their own /tmp."""
        assert self.sshd is not None, "the host runs no daemon"
        return Path(f"/proc/{self.sshd.pid}/root") / Path(path).relative_to("/")


def add_bridge(name: str) -> None:
    """A new bridge ``name`` (down) with a MAC address of its own: a bridge without one takes
    its ports' lowest, which changes when a host's veth is deleted; the other hosts' ARP
    entries for the bridge's address then point nowhere until they expire, and their
    connections to this machine time out for ~40 s."""
    mac = "02:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(5))  # locally administered
    run("ip", "link", "add", name, "address", mac, "type", "bridge")


class Lab(Lifecycle):
    """A bridge with test hosts; a context manager that removes everything it made."""

    def __init__(self) -> None:
        self.tag = next_lab_tag()  # unique in this process
        self.bridge = f"flb{self.tag}"[:15]
        self.tmp = Path(tempfile.mkdtemp(prefix=f"flotilla-lab-{self.tag}-"))
        self.tmp.chmod(0o755)
        self.subnet = ""
        self.hosts: list[TestHost] = []
        self.client_key = self.tmp / "client_key"
        self.authorized_keys = self.tmp / "authorized_keys"
        self.known_hosts = self.tmp / "known_hosts"
        self.bashrc = self.tmp / "bashrc"
        self.shared = self.tmp / "shared"
        """A folder every SSH host sees at the same path (as a cluster's shared network file
        system): for tests whose nodes and client coordinate through files."""
        self._next = 0
        self._seed = os.getpid()

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        """Install sshd if needed, make the client key and the bridge."""
        reason = lab_unavailable()
        if reason:
            raise LabError(reason)
        ensure_sshd()
        remove_stale_labs()
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.authorized_keys.write_text(keygen(self.client_key, "flotilla-lab-client") + "\n")
        self.known_hosts.write_text("")
        self.shared.mkdir()
        self._write_bashrc()
        self.subnet = free_subnet(self._seed)
        add_bridge(self.bridge)
        run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")

    def _write_bashrc(self) -> None:
        """The hosts' ~/.bashrc, as on a fresh machine: this machine's ``python3`` first on
        PATH and nothing else. (bash reads ~/.bashrc for every command run over SSH; this
        machine's runs ``pyenv init``, ~100 processes per command, which a real host does
        not, and which would be counted against every SSH start.)"""
        found = _python3_folder()
        path = f"export PATH={found}:$PATH\n" if found else ""
        self.bashrc.write_text(f"# a test host's ~/.bashrc (tests/_hosts.py)\n{path}")

    def close(self) -> None:
        """Stop every host and remove the bridge and files. Safe to call twice."""
        for host in list(self.hosts):
            with contextlib.suppress(Exception):
                self.remove_host(host)
        if self.subnet:
            run("ip", "link", "del", self.bridge, check=False)
            self.subnet = ""
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- hosts -----------------------------------------------------------------------
    def add_hosts(self, count: int) -> list[TestHost]:
        return [self.add_host() for _ in range(count)]

    def add_host(self, env: dict[str, str] | None = None, hidden: tuple[str, ...] = ()) -> TestHost:
        """A new host with its own address, hostname and running sshd; ``env``: what its
        ~/.bashrc exports (default: the lab's ~/.bashrc), ``hidden``: files or folders of
        this machine it lacks (each is an empty file or folder there; e.g. an interpreter)."""
        self._next += 1
        i = self._next
        host = self.new_host(i, f"{self.subnet}.{i + 1}", f"flhost{i}")
        host.env, host.hidden = dict(env or {}), hidden
        host.pubkey = keygen(host.folder / "hostkey", host.hostname)
        with open(self.known_hosts, "a") as f:
            f.write(f"{host.addr} {' '.join(host.pubkey.split()[:2])}\n")
        self.start_sshd(host)
        return host

    def new_host(
        self, index: int, addr: str, hostname: str, local_addrs: tuple[str, ...] = ()
    ) -> TestHost:
        """A network namespace on the bridge with ``addr`` (and ``local_addrs`` on its
        loopback), folder ``h{index}``; no daemon runs in it yet."""
        host = TestHost(
            index=index,
            netns=f"flotilla-{self.tag}-h{index}",
            veth=f"flv{self.tag}x{index}"[-15:],
            addr=addr,
            hostname=hostname,
            folder=self.tmp / f"h{index}",
        )
        host.folder.mkdir()
        self.hosts.append(host)
        netns = host.netns
        run("ip", "netns", "add", netns)
        run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        run("ip", "link", "set", host.veth, "master", self.bridge, "up")
        run("ip", "-n", netns, "addr", "add", f"{addr}/24", "dev", "eth0")
        run("ip", "-n", netns, "link", "set", "eth0", "up")
        run("ip", "-n", netns, "link", "set", "lo", "up")
        for local in local_addrs:
            run("ip", "-n", netns, "addr", "add", f"{local}/32", "dev", "lo")
        return host

    def start_sshd(
        self,
        host: TestHost,
        authorized_keys: Path | None = None,
        wait: bool = True,
        own_files: bool = True,
    ) -> None:
        """Start the host's sshd (host key ``{folder}/hostkey``; ``authorized_keys``: the
        lab's by default) and, with ``wait``, wait until it listens.

        The host gets its own hostname, /etc/hosts, /root, /tmp and /dev/shm, as a separate
        machine has (see ``start_daemon``'s ``own_files``): what its sessions write there is
        its own, and code that assumes the client's paths exist on the node fails here.
        Only ``Lab.shared`` is seen by all. ``own_files=False``: the rest of this machine's
        file system is shared (but for its ~/.ssh and ~/.bashrc).
        """
        config = host.folder / "sshd_config"
        config.write_text(
            _SSHD_CONFIG.format(
                addr=host.addr,
                hostkey=host.folder / "hostkey",
                pidfile=host.folder / "sshd.pid",
                authorized_keys=authorized_keys or self.authorized_keys,
            )
        )
        keep = [authorized_keys or self.authorized_keys, self.shared] if own_files else None
        self.start_daemon(host, f"exec {SSHD} -D -e -f {config}", "sshd.log", own_files=keep)
        if wait:
            self._wait_listening(host)

    def start_daemon(
        self,
        host: TestHost,
        command: str,
        log: str,
        hosts_text: str = "",
        env: dict[str, str] | None = None,
        own_files: list[Path] | None = None,
    ) -> None:
        """Run the shell ``command`` (which ``exec``s the host's daemon) in the host: its
        own hostname, /etc/hosts (``hosts_text``, default: localhost and the host), ~/.ssh
        and ~/.bashrc (see ``_write_bashrc``), output to ``{folder}/{log}``. ``host.sshd`` is
        the process.

        With ``own_files`` (a list: the lab's files the daemon itself reads, besides the
        host's folder), the host also gets a file system view of its own, as a separate
        machine has: its own /root (``host.home``: a fresh folder with that ~/.bashrc and
        ~/.ssh, plus this machine's ~/.pyenv and pip configuration read-only, as a machine
        image would have its interpreters), /tmp (empty but for the host's folder and
        ``own_files``, at their paths) and /dev/shm (no shared-memory shortcut with the
        client). Without it the rest of the file system is this machine's.
        """
        hosts_file = host.folder / "hosts"
        hosts_file.write_text(hosts_text or f"127.0.0.1 localhost\n{host.addr} {host.hostname}\n")
        inner = f"hostname {host.hostname} && mount --bind {hosts_file} /etc/hosts && "
        rc = self.bashrc
        if host.env:
            rc = host.folder / "bashrc"
            rc.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in host.env.items()))
        # ~/.ssh of its own, as a separate machine has (empty: nothing trusted, no config)
        own_ssh = host.folder / "dot-ssh"
        own_ssh.mkdir(mode=0o700, exist_ok=True)
        if own_files is None:
            home_rc = Path.home() / ".bashrc"
            if home_rc.is_file() and rc.is_file():
                inner += f"mount --bind {rc} {home_rc} && "
            dot_ssh = Path.home() / ".ssh"
            dot_ssh.mkdir(mode=0o700, exist_ok=True)
            inner += f"mount --bind {own_ssh} {dot_ssh} && "
        else:
            inner += self._own_home(host, rc, own_ssh)
        for hidden in host.hidden:
            empty = "-t tmpfs tmpfs" if os.path.isdir(hidden) else "--bind /dev/null"
            inner += f"mount {empty} {hidden} && "
        if own_files is not None:
            inner += self._own_tmp(host, own_files)
        inner += "mount -t tmpfs -o size=512m,mode=1777 tmpfs /dev/shm && " + command
        host._log = open(host.folder / log, "ab")  # noqa: SIM115 - closed in remove_host
        host.sshd = subprocess.Popen(
            [*_in_netns(host.netns), "unshare", "--uts", "--mount", "sh", "-c", inner],
            stdin=subprocess.DEVNULL,
            stdout=host._log,
            stderr=host._log,
            env=env,
        )

    def _own_home(self, host: TestHost, rc: Path, own_ssh: Path) -> str:
        """Shell lines (run in the host's mount namespace) that put ``host.home`` at /root:
        ``rc`` as its ~/.bashrc, ``own_ssh`` as its ~/.ssh, and this machine's interpreters
        (~/.pyenv) and pip configuration read-only."""
        home = host.home
        home.mkdir(mode=0o700, exist_ok=True)
        if rc.is_file():
            shutil.copyfile(rc, home / ".bashrc")
        (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
        lines = f"mount --bind {own_ssh} {home / '.ssh'} && "
        real = Path.home()
        for part in (".pyenv", ".config/pip"):
            if (real / part).is_dir():
                (home / part).mkdir(parents=True, exist_ok=True)
                lines += (
                    f"mount --bind {real / part} {home / part} && "
                    f"mount -o remount,bind,ro {home / part} && "
                )
        return lines + f"mount --rbind {home} {real} && "

    def _own_tmp(self, host: TestHost, keep: list[Path]) -> str:
        """Shell lines (run in the host's mount namespace) that give it an empty /tmp of
        its own, where only the host's folder and ``keep`` are, at their paths (the old
        /tmp is reached through the working directory once the new one hides it)."""
        root = Path(tempfile.gettempdir())
        lines = f"cd {root} && mount -t tmpfs -o mode=1777 tmpfs {root} && "
        for path in [host.folder, *keep]:
            if path.is_relative_to(host.folder) and path != host.folder:
                continue  # inside the host's folder: already there
            relative = path.relative_to(root)  # the lab's files all lie under /tmp
            make = f"mkdir -p {path}" if path.is_dir() else f"mkdir -p {path.parent} && : >{path}"
            lines += f"{make} && mount --no-canonicalize --bind ./{relative} {path} && "
        return lines + f"chmod 755 {self.tmp} && cd / && "

    def _wait_listening(self, host: TestHost, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert host.sshd is not None
            if host.sshd.poll() is not None:
                log = (host.folder / "sshd.log").read_text(errors="replace")
                raise LabError(f"sshd of {host.addr} exited ({host.sshd.returncode}): {log}")
            with contextlib.suppress(OSError), socket.create_connection((host.addr, 22), 0.2):
                return
            time.sleep(0.01)
        raise LabError(f"sshd of {host.addr} does not listen after {timeout:g} s")

    def remove_host(self, host: TestHost) -> None:
        """Kill everything running in the host, then delete its veth and namespace."""
        self.kill_all(host)
        if host.sshd is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                host.sshd.wait(5)
        if host._log is not None:
            host._log.close()
        run("ip", "link", "del", host.veth, check=False)
        run("ip", "netns", "del", host.netns, check=False)
        self.hosts.remove(host)

    def unused_addr(self) -> str:
        """An address in the lab's subnet where no host is (and none will be)."""
        return f"{self.subnet}.250"

    # -- faults ----------------------------------------------------------------------
    def link_down(self, host: TestHost) -> None:
        """Cut the host off the network (its processes keep running)."""
        run("ip", "link", "set", host.veth, "down")

    def link_up(self, host: TestHost) -> None:
        run("ip", "link", "set", host.veth, "up")

    def kill_all(self, host: TestHost, timeout: float = 30.0) -> None:
        """SIGKILL every process in the host (its sshd, sessions and agents), until none is
        left: a process forking while it is killed (a boot guard's ``sh`` starting its
        ``sleep``) has a child the listing before the kill did not hold, which a single pass
        would leave running, an orphan outliving the host. A killed process forks no more,
        so the passes end. LabError when processes are still there after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while pids := self.pids(host):
            if time.monotonic() > deadline:
                raise LabError(f"{host.addr}: processes {pids} survive SIGKILL")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)  # until the killed ones are gone from /proc

    # -- processes -------------------------------------------------------------------
    def pids(self, host: TestHost) -> list[int]:
        """Every process whose network namespace is the host's."""
        return pids_in_netns(host.netns)

    def agent_pids(self, hosts: list[TestHost] | None = None) -> dict[str, list[int]]:
        """Host address -> live processes whose command line mentions flotilla.agent."""
        out: dict[str, list[int]] = {}
        for host in self.hosts if hosts is None else hosts:
            found = [pid for pid in self.pids(host) if _is_agent(pid)]
            if found:
                out[host.addr] = found
        return out

    def wait_no_agents(
        self, hosts: list[TestHost] | None = None, timeout: float = 5.0
    ) -> dict[str, list[int]]:
        """Wait until no agent runs on ``hosts``; what is still running (empty: none)."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.agent_pids(hosts)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.02)

    # -- the provider ----------------------------------------------------------------
    def provider(self, hosts: list[TestHost] | None = None, **kwargs: Any) -> Any:
        """A flotilla SSH provider for ``hosts`` (default: all), with the lab's keys."""
        from flotilla._providers.ssh import SSH

        options: dict[str, Any] = {
            "user": "root",
            "key": str(self.client_key),
            "known_hosts": str(self.known_hosts),
            "workdir": str(self.tmp / "workdir"),
            "connect_timeout": 5.0,
        }
        options.update(kwargs)
        return SSH([h.addr for h in (self.hosts if hosts is None else hosts)], **options)


def _in_netns(netns: str) -> list[str]:
    """Command prefix that runs in a namespace (nsenter keeps /sys, unlike ip netns exec)."""
    return ["nsenter", f"--net=/run/netns/{netns}"]


def _is_agent(pid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) flotilla agent or executor."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return b"flotilla.agent" in cmdline and stat[stat.rindex(")") + 2] != "Z"


@contextlib.contextmanager
def lab_with_hosts(count: int) -> Iterator[Lab]:
    """A lab with ``count`` hosts, torn down on exit."""
    with Lab() as lab:
        lab.add_hosts(count)
        yield lab


class _Closable(Protocol):
    def close(self) -> None: ...


L = TypeVar("L", bound=_Closable)


class SharedLab(Generic[L]):
    """One lab per process for a session-scoped fixture: pytest makes such a fixture
    once per module that imports it (each import is a definition), so without this every
    module would get a lab of its own. The first user makes it (``make``), the last one
    closes it."""

    def __init__(self, make: Callable[[], L]) -> None:
        self.make = make
        self.lab: L | None = None
        self.users = 0

    @contextlib.contextmanager
    def use(self) -> Iterator[L]:
        if self.lab is None:
            self.lab = self.make()
        lab = self.lab
        self.users += 1
        try:
            yield lab
        finally:
            self.users -= 1
            if self.users == 0:
                self.lab = None
                lab.close()


def _three_hosts() -> Lab:
    lab = Lab()
    try:
        lab.start()
        lab.add_hosts(3)
    except BaseException:
        lab.close()
        raise
    return lab


_SSH_LAB = SharedLab(_three_hosts)


@pytest.fixture(scope="session", name="ssh_lab")
def ssh_lab_fixture() -> Iterator[Lab]:
    """Three SSH test hosts for the whole session (skips when they cannot be built),
    one lab shared by every module that imports this fixture (:class:`SharedLab`)."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    with _SSH_LAB.use() as lab:
        yield lab
