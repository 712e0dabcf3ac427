"""The typed bodies of ``_wire/bodies.py`` are what a real agent says: its HELLO and its
READY carry the keys declared there (and no other), and it runs from a CONFIG built as
the declared structure."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from flotilla._info import InstanceInfo
from flotilla._wire import bodies
from flotilla._wire.bodies import Config, dump, load_hello, load_ready
from flotilla._wire.frames import FrameReader, Kind, frame

ALWAYS_IN_HELLO = {"pid", "host", "boot_id", "python", "python_version", "port"}


def _declared(name: str) -> set[str]:
    """The keys ``_wire/bodies.py`` declares in its ``TypedDict`` ``name`` (which exists
    for mypy alone: at run time the name is ``dict``)."""
    for node in ast.walk(ast.parse(Path(bodies.__file__).read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    raise LookupError(f"bodies.py declares no {name}")


def _next(proc: subprocess.Popen[bytes], reader: FrameReader, kind: int) -> bytes:
    """The body of the agent's next frame of ``kind`` (others, such as BEAT, are skipped);
    the agent's end of stream fails the test."""
    assert proc.stdout is not None
    while True:
        for k, _ident, body in reader.feed(os.read(proc.stdout.fileno(), 1 << 16) or b""):
            if k == kind:
                return bytes(body)
        assert proc.poll() is None, f"the agent exited before {kind.name}"


def test_a_real_agent_speaks_the_declared_bodies(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent / "src"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "flotilla.agent"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    assert proc.stdin is not None
    try:
        reader = FrameReader()
        hello = load_hello(_next(proc, reader, Kind.HELLO))
        assert set(hello) - _declared("Hello") == set()
        assert set(hello) >= ALWAYS_IN_HELLO and hello["pid"] == proc.pid

        info = InstanceInfo(0, 1, True, "127.0.0.1", hello["port"], 0, (), "bodies-test")
        config: Config = {
            "pool_id": "bodies-test",
            "procs": 2,
            "compute_pool": info.to_json(),
            "env": {},
            "image": None,
            "home": str(tmp_path),
            "heartbeat_timeout": 600.0,
            "shutdown_grace": 3.0,
            "shm_probe": None,
            "group": False,
        }
        data = dump(config)
        for part in frame(Kind.CONFIG, 0, len(data).to_bytes(4, "little"), data, b""):
            proc.stdin.write(bytes(part))
        proc.stdin.flush()
        ready = load_ready(_next(proc, reader, Kind.READY))
        assert "error" not in ready, ready.get("error")
        assert set(ready) - _declared("Ready") == set()
        assert len(ready["pids"]) == 2 and ready["restarts"] == 0 and "shm" in ready
        json.dumps(ready)  # (plain JSON both ways)

        for part in frame(Kind.SHUTDOWN, 0, b""):
            proc.stdin.write(bytes(part))
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
