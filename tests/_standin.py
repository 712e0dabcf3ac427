"""What the stand-ins of the GPU markets' APIs (``_vast``, ``_runpod``, ``_lambda``,
``_gcp``) share: the lab of network namespaces their instances are hosts of, their HTTP
servers on the lab's bridge, the environment a client reads (in ``os.environ`` only
inside a test's fixture: :meth:`StandIn.environment`), bridges of their own, and the ends
of an instance's host.

A stand-in subclasses :class:`StandIn`: its ``start`` calls ``self.lab.start()`` first,
then :meth:`StandIn.serve` and :meth:`StandIn.set_env`; its ``close`` stops its instances
(:meth:`StandIn.stop_host`) and then calls :meth:`StandIn.shut`. Its request handler
subclasses :class:`JsonHandler` and answers in ``_serve``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol, Self
from urllib.parse import parse_qs, urlparse

import pytest
from _hosts import SERVE_POLL, Lab, TestHost, _in_netns, lab_unavailable, run
from _lifecycle import Lifecycle, environment
from _procs import interruptible, signal_a_thread, wait_until

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SSHD_OPTIONS = (
    "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
    "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nUseDNS no\n"
    "MaxSessions 64\nMaxStartups 64\n"
)
"""The end of an instance's sshd_config: root by key only, many sessions at once."""


class StandIn(Lifecycle):
    """A market's stand-in: ``lab`` (its hosts), ``url`` and ``env`` (what a client
    needs), ``requests`` ((method, path) of every request), ``closing`` (set once it is
    shutting down) and the lock of its state."""

    @classmethod
    def running(cls) -> Iterator[Self]:
        """A fresh one for a test (a fixture's body); the test is skipped where the lab
        cannot run."""
        reason = lab_unavailable()
        if reason:
            pytest.skip(reason)
        with cls() as lab:
            yield lab

    def __init__(self, boot_delay: float = 0.5) -> None:
        self.boot_delay = boot_delay
        self.lab = Lab()
        self.url = ""
        self.env: dict[str, str] = {}
        self.requests: list[tuple[str, str]] = []
        self.closing = False
        self._lock = threading.RLock()
        self._clear: tuple[str, ...] = ()
        self._servers: list[ThreadingHTTPServer] = []
        self._own_bridges: list[str] = []

    @property
    def addr(self) -> str:
        """This machine's address on the lab's bridge (where the servers listen)."""
        return f"{self.lab.subnet}.1"

    def serve(self, handler: type[BaseHTTPRequestHandler], name: str, port: int = 0) -> int:
        """Serve ``handler``, which finds this stand-in as its attribute ``name``, on the
        lab's bridge at ``port`` (0: any); the port."""
        bound = type(handler.__name__, (handler,), {name: self})
        server = ThreadingHTTPServer((self.addr, port), bound)
        server.daemon_threads = True
        self._servers.append(server)
        threading.Thread(target=server.serve_forever, args=(SERVE_POLL,), daemon=True).start()
        return server.server_port

    def set_env(self, env: Mapping[str, str], clear: Sequence[str] = ()) -> None:
        """``env``: what a client needs; ``clear``: what it must not find. Both applied to
        ``os.environ`` inside :meth:`environment` only."""
        self.env = dict(env)
        self._clear = tuple(clear)

    def environment(self) -> contextlib.AbstractContextManager[None]:
        return environment(self.env, self._clear)

    def add_bridge(self, name: str) -> str:
        """A bridge of the stand-in's own (a network of its instances), up; deleted at
        :meth:`shut`."""
        run("ip", "link", "add", name, "type", "bridge")
        run("ip", "link", "set", name, "up")
        self._own_bridges.append(name)
        return name

    def plug(self, host: TestHost, bridge: str, veth: str, device: str, address: str) -> None:
        """A network interface ``device`` of ``host`` at ``address`` (/24) on ``bridge``,
        through the veth pair whose end here is ``veth``."""
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", device, "netns", host.netns)
        run("ip", "link", "set", veth, "master", bridge, "up")
        run("ip", "-n", host.netns, "addr", "add", f"{address}/24", "dev", device)
        run("ip", "-n", host.netns, "link", "set", device, "up")

    def run_script(
        self, host: TestHost, script: Path, log: str, env: Mapping[str, str], mounts: str
    ) -> None:
        """Run ``script`` as root on ``host`` (its own hostname, and ``mounts``: shell lines
        ending in ``&&`` that give it the instance's own folders), its output in the
        host's file ``log``; back when it ends or after 30 s."""
        with open(host.folder / log, "ab") as out:
            proc = subprocess.Popen(
                [
                    *_in_netns(host.netns),
                    "unshare",
                    "--uts",
                    "--mount",
                    "sh",
                    "-c",
                    f"hostname {host.hostname} && " + mounts + f"exec /bin/sh {script}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env={"PATH": PATH, "HOME": "/root", **env},
                cwd="/",
            )
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)

    def kill_processes(self, host: TestHost) -> None:
        """Kill every process of ``host`` (for up to 5 s: a process forked while the first
        ones are killed survives one pass)."""
        deadline = time.monotonic() + 5
        while self.lab.pids(host) and time.monotonic() < deadline:
            self.lab.kill_all(host)
            time.sleep(0.02)

    def stop_host(self, host: TestHost | None) -> None:
        """End an instance's host: its processes, then its namespace and folder."""
        if host is None or host not in self.lab.hosts:
            return
        self.kill_processes(host)
        with contextlib.suppress(Exception):
            self.lab.remove_host(host)

    def live(self, which: str = "") -> list[Any]:
        """The instances not deleted (of those ``which`` selects)."""
        raise NotImplementedError

    def wait_gone(self, timeout: float, which: str = "") -> list[Any]:
        """Wait (up to ``timeout`` s) until no instance ``which`` selects is left; those
        still there."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.live(which)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def logs(self, *patterns: str) -> str:
        """The files of the lab's hosts that ``patterns`` match (globs in its folder, in
        order), each after its path."""
        out = []
        for pattern in patterns:
            for path in sorted(self.lab.tmp.glob(pattern)):
                with contextlib.suppress(OSError):
                    out.append(f"{path}: {path.read_text(errors='replace')}")
        return "\n".join(out)

    def shut(self) -> None:
        """Delete its bridges, stop its servers and close the lab (once its instances are
        stopped)."""
        for bridge in self._own_bridges:
            run("ip", "link", "del", bridge, check=False)
        self._own_bridges.clear()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()
        self.lab.close()


class Market(Protocol):
    """A market's stand-in, as the scenarios below use it (``StandIn``, ``VerdaLab``)."""

    boot_delay: float

    def live(self, which: str = "", /) -> list[Any]: ...


def interrupted_while_booting(
    lab: Market,
    client: str,
    signum: int = signal.SIGINT,
    wait: float = 120.0,
    booting: Callable[[], object] = lambda: None,
) -> tuple[str, str]:
    """Run the Python ``client`` (a 2-node pool on ``lab``) with its instances never
    booting; once both exist (then ``booting()``: a test's own checks) send ``signum`` to
    one of its threads other than the main one, as Linux may deliver a Ctrl-C
    (``_procs.signal_a_thread``: the main thread, blocked in a wait, is not woken by it).
    Its stdout and stderr, once it has exited."""
    lab.boot_delay = 3600.0
    proc = start_client(client)
    try:
        if not wait_until(lambda: len(lab.live()) == 2 or proc.poll() is not None, wait):
            proc.kill()
            said = proc.communicate()[1][-3000:]
            pytest.fail(f"the client did not create its two instances: {said}")
        assert proc.poll() is None, proc.communicate()
        booting()
        signal_a_thread(proc.pid, signum)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_client(client: str, **kwargs: Any) -> subprocess.Popen[str]:
    """The Python ``client`` run in a process (and session) of its own, its output read
    as text."""
    return subprocess.Popen(
        [sys.executable, "-c", client],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )


def killed_client(lab: Market, client: str, which: str = "flotilla:{}:") -> tuple[str, list[Any]]:
    """Run the Python ``client`` that prints its pool's id once the pool's 2 instances on
    ``lab`` run (those ``which``, with the id, selects), then kill it with SIGKILL: the
    pool's id and its instances."""
    proc = start_client(client, preexec_fn=interruptible)
    try:
        assert proc.stdout is not None
        pool_id = proc.stdout.readline().strip()
        assert pool_id, proc.stderr.read() if proc.stderr else ""
        mine = lab.live(which.format(pool_id))
        assert len(mine) == 2
        return pool_id, mine
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def key_folders(clients: Sequence[str]) -> list[str]:
    """This machine's cloud pool folders (a pool's keys, ``cloud.identity.pool_folder``)
    whose ``client`` file names one of ``clients`` (``host:pid:start``; or ``host:pid:``, a
    killed client's whose start is no longer known)."""
    found = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "flotilla-*", "client")):
        with contextlib.suppress(OSError):
            if Path(path).read_text().strip().startswith(tuple(clients)):
                found.append(os.path.dirname(path))
    return found


def nvidia_smi(folder: Path, names: Sequence[str], ident: str) -> Path:
    """A folder (in ``folder``) with an ``nvidia-smi`` whose ``-L`` lists GPUs ``names``
    (ids from ``ident``), as the GPU driver's does; the folder, for PATH."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)  # a host booted again (a stopped pod started)
    listing = "".join(f"GPU {i}: {n} (UUID: GPU-{ident}-{i})\n" for i, n in enumerate(names))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] || exit 2\nprintf '%s' {shlex.quote(listing)}\n")
    smi.chmod(0o755)
    return bin_dir


class JsonHandler(BaseHTTPRequestHandler):
    """A stand-in API's request handler: every method goes to ``_serve(method)``; answers
    are JSON (``_send``); nothing is logged."""

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _raw(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _bearer(self) -> str | None:
        """The key of an ``Authorization: Bearer`` header; None without one."""
        auth = self.headers.get("Authorization", "")
        return auth[7:] if auth.startswith("Bearer ") else None

    def _key(self) -> str:
        """The key of the request: ``Authorization: Bearer``, else ``?api_key=``."""
        bearer = self._bearer()
        if bearer is not None:
            return bearer
        return parse_qs(urlparse(self.path).query).get("api_key", [""])[0]

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        raise NotImplementedError


__all__ = ["PATH", "SSHD_OPTIONS", "JsonHandler", "StandIn", "nvidia_smi"]
