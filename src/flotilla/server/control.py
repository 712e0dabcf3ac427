"""``flotilla server start|stop|status``: the local HTTP server's lifecycle and its token.

Standard library only: the command line imports this without the ``server`` extra. The
server's files live in ``<FLOTILLA_HOME>/server/`` (a private folder, mode 0700)::

    token         the API's bearer token (mode 0600), made at the first start, kept after
    server.json   the running server: pid, pid_start, host, port, url (written once it
                  listens, removed when it stops)
    server.log    the daemon's output

Every request needs the token: ``Authorization: Bearer <token>``, or the ``flotilla_token``
cookie the dashboard gets when its URL (``server start`` prints it, ``?token=...``) is
opened once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .._system import procs
from .._system.private import flotilla_home, open_private_file, private_dir
from ..cli.console import CLIError, say
from ..cli.conventions import EXIT_USAGE

DEFAULT_PORT = 7587
"""The port ``server start`` listens on unless ``--port`` says otherwise (0: any free one)."""
START_TIMEOUT = 60.0  # seconds ``server start`` waits for the daemon to answer
STOP_TIMEOUT = 30.0  # seconds ``server stop`` waits for it to end before SIGKILL
COOKIE = "flotilla_token"
"""The cookie (HttpOnly, SameSite=Strict) the dashboard keeps the token in."""
APP_MODULE = "flotilla.server.app"
"""What ``python -m`` runs as the server's daemon."""


def folder() -> Path:
    return flotilla_home() / "server"


def token_path() -> Path:
    return folder() / "token"


def token(create: bool = True) -> str:
    """The API's token: read from ``<home>/server/token`` (0600, in a private folder),
    made when there is none and ``create``; '' when there is none."""
    path = token_path()
    private_dir(flotilla_home())
    private_dir(folder())
    if os.path.lexists(path):  # refused when a symlink, not a file, or not ours
        with os.fdopen(open_private_file(path, os.O_RDONLY)) as f:
            value = f.read().strip()
        if value:
            return value
    if not create:
        return ""
    value = secrets.token_urlsafe(32)
    fd = open_private_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def info() -> dict[str, Any] | None:
    """The running server's `server.json` (pid, host, port, url), or None when no server
    of this home runs (a file left by a killed one is removed)."""
    path = folder() / "server.json"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not procs.alive(
        int(data.get("pid", 0)), int(data.get("pid_start", 0))
    ):
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    return data


def write_info(host: str, port: int) -> None:
    """Record this process as the running server (called once it listens)."""
    data = {
        "pid": os.getpid(),
        "pid_start": procs.start_time(os.getpid()),
        "host": host,
        "port": port,
        "url": url(host, port),
        "started": time.time(),
    }
    path = folder() / "server.json"
    tmp = folder() / f".server.{os.getpid()}.tmp"
    fd = open_private_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def clear_info() -> None:
    """Remove `server.json` if it is this process's."""
    path = folder() / "server.json"
    with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as f:
        if json.load(f).get("pid") == os.getpid():
            os.unlink(path)


def _missing_extra() -> str | None:
    """What the server needs and this environment lacks (the ``server`` extra), or None."""
    missing = []
    for module in ("starlette", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        return (
            f"flotilla server needs {' and '.join(missing)}: pip install 'flotilla[server]' "
            "(the rest of the command line works without them)"
        )
    return None


def add_parser(sub: Any) -> None:
    q = sub.add_parser("server", help="the local HTTP API and web dashboard (start|stop|status)")
    actions = q.add_subparsers(dest="server_command", required=True, metavar="ACTION")
    s = actions.add_parser("start", help="start the server (a daemon unless --foreground)")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; reach it from "
        "elsewhere through SSH port forwarding)",
    )
    s.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"(default {DEFAULT_PORT}; 0: any free)"
    )
    s.add_argument("--foreground", action="store_true", help="run here until Ctrl-C")
    s.set_defaults(func=cmd_server)
    s = actions.add_parser("stop", help="stop the server")
    s.set_defaults(func=cmd_server)
    s = actions.add_parser("status", help="whether the server runs, and where")
    s.set_defaults(func=cmd_server)


def cmd_server(args: argparse.Namespace) -> int:
    if args.server_command == "start":
        return _start(args.host, args.port, args.foreground)
    if args.server_command == "stop":
        return _stop()
    return _status()


def _start(host: str, port: int, foreground: bool) -> int:
    if not 0 <= port < 65536:
        raise CLIError(f"--port {port}: give a port from 1 to 65535 (0: any free)", EXIT_USAGE)
    problem = _missing_extra()
    if problem:
        raise CLIError(problem, EXIT_USAGE)
    running = info()
    if running is not None:
        raise CLIError(
            f"a flotilla server already runs at {running['url']} (pid {running['pid']}); "
            "`flotilla server stop` stops it"
        )
    secret = token()
    if foreground:  # this process becomes the server (Ctrl-C stops it)
        sys.stdout.flush()
        command = [sys.executable, "-m", APP_MODULE, "--host", host, "--port", str(port)]
        os.execv(sys.executable, [*command, "--announce"])
    log = open_private_file(folder() / "server.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", APP_MODULE, "--host", host, "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(log)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise CLIError(f"the server exited with {child.returncode}: {_log_tail()}")
        running = info()
        if running is not None and running.get("pid") == child.pid and _answers(running):
            announce(running["url"], secret)
            return 0
        time.sleep(0.05)
    child.kill()
    child.wait()
    raise CLIError(f"the server did not answer within {START_TIMEOUT:.0f} s: {_log_tail()}")


def _answers(running: dict[str, Any]) -> bool:
    request = urllib.request.Request(
        running["url"] + "/api/v1/health",
        headers={"Authorization": f"Bearer {token(create=False)}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status) == 200
    except (OSError, urllib.error.URLError):
        return False


def _log_tail() -> str:
    try:
        with open(folder() / "server.log", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()[-5:]
    except OSError:
        return "(no log)"
    return " | ".join(lines) or "(nothing in its log)"


def announce(where: str, secret: str) -> None:
    """Print where the server runs and the dashboard's URL (with the token, once)."""
    print(f"flotilla server running at {where}")
    print(
        f"dashboard (opens once with the token, then keeps it as a cookie): {where}/?token={secret}"
    )
    print(f"API: Authorization: Bearer $(cat {token_path()})")
    sys.stdout.flush()


def _stop() -> int:
    running = info()
    if running is None:
        say("no flotilla server is running")
        return 0
    pid, start = int(running["pid"]), int(running.get("pid_start", 0))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not procs.wait_gone(pid, start, STOP_TIMEOUT):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        procs.wait_gone(pid, start, STOP_TIMEOUT)
    with contextlib.suppress(OSError):
        os.unlink(folder() / "server.json")
    say(f"stopped the server (pid {pid})")
    return 0


def _status() -> int:
    running = info()
    if running is None:
        print("no flotilla server is running (`flotilla server start` starts one)")
        return 1
    print(f"flotilla server running at {running['url']} (pid {running['pid']})")
    print(f"token: {token_path()} (the dashboard: {running['url']}/?token=<token>)")
    return 0
