"""A package index for test hosts that have no route out, as a company's mirror would be.

The wheels a test needs are downloaded once on this machine, with the interpreter the test
hosts run (``pip download``, through this machine's own package configuration), into a
cache outside the checkout (``/var/cache/flotilla-wheels``, or ``$FLOTILLA_WHEEL_CACHE``):
only a fresh machine pays. :class:`PackageIndex` serves them as a PEP 503 simple index on
the lab's bridge address; hosts point their installer at it with their own configuration
(``UV_INDEX_URL``/``PIP_INDEX_URL`` in their environment), never flotilla's.
"""

from __future__ import annotations

import hashlib
import html
import http.server
import os
import re
import subprocess
import threading
from pathlib import Path

import pytest

HOST_PYTHON = "/usr/bin/python3"
"""The interpreter the engine tests' hosts run (Debian's: none of the engines installed)."""
CACHE = Path(os.environ.get("FLOTILLA_WHEEL_CACHE", "/var/cache/flotilla-wheels"))


def wheels_for(requirements: list[str], python: str = HOST_PYTHON) -> Path:
    """A folder with wheels for ``requirements`` and their dependencies, for ``python``
    (downloaded on first use; skip the test when that cannot be done here)."""
    if not os.path.exists(python):
        pytest.skip(f"{python} is not installed")
    key = hashlib.sha256("\n".join([python, *sorted(requirements)]).encode()).hexdigest()[:12]
    folder = CACHE / key
    stamp = folder / ".complete"
    if stamp.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(folder)]
    done = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot download {requirements}: {done.stderr.strip()[-300:]}")
    stamp.write_text("\n".join(requirements) + "\n")
    return folder


def _project(filename: str) -> str:
    """The normalised project name of a wheel's file name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", filename.split("-", 1)[0]).lower()


class PackageIndex:
    """A PEP 503 simple index of the wheels in ``folders``, served on ``addr`` (a free port)
    until :meth:`close`."""

    def __init__(self, folders: list[Path], addr: str) -> None:
        files = {p.name: p for folder in folders for p in folder.glob("*.whl")}
        projects: dict[str, list[str]] = {}
        for name in sorted(files):
            projects.setdefault(_project(name), []).append(name)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:  # uv asks for a file's headers first
                self.do_GET(body=False)

            def do_GET(self, body: bool = True) -> None:
                self.body = body
                parts = [p for p in self.path.split("?", 1)[0].split("/") if p]
                if parts == ["simple"]:
                    links = "".join(f'<a href="/simple/{p}/">{p}</a>\n' for p in projects)
                    self._send(f"<html><body>\n{links}</body></html>\n".encode(), "text/html")
                elif len(parts) == 2 and parts[0] == "simple" and parts[1] in projects:
                    links = "".join(
                        f'<a href="/files/{html.escape(f)}">{html.escape(f)}</a>\n'
                        for f in projects[parts[1]]
                    )
                    self._send(f"<html><body>\n{links}</body></html>\n".encode(), "text/html")
                elif len(parts) == 2 and parts[0] == "files" and parts[1] in files:
                    self._send(files[parts[1]].read_bytes(), "application/octet-stream")
                else:
                    self.send_error(404)

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.body:
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((addr, 0), Handler)
        self.url = f"http://{addr}:{self.server.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def host_env(self) -> dict[str, str]:
        """What a host's own configuration says to use this index (uv's and pip's)."""
        return {"UV_INDEX_URL": self.url, "PIP_INDEX_URL": self.url}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
