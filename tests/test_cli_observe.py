"""``flotilla top``, ``flotilla events`` and ``flotilla logs --export`` on a real local
cluster (the CLI as a subprocess with its own FLOTILLA_HOME; ``top`` also in a real
terminal, tmux). Synchronisation by condition (polled with a deadline)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from _tty import Terminal
from test_cli import CLI
from test_cli import cli as cli  # the fixture


def poll(check: Any, what: str, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_top_events_and_export_of_a_cluster(cli: CLI, tmp_path: Path) -> None:
    release = tmp_path / "release"
    burn = (
        'if [ "$FLOTILLA_NODE_RANK" = 1 ]; then '
        f"while [ ! -e {release} ]; do :; done; fi; echo done on $FLOTILLA_NODE_RANK"
    )
    cli.ok("launch", "-c", "obs", "--nodes", "2", "echo hello from $FLOTILLA_NODE_RANK")
    started = cli.ok("exec", "obs", "--detach", burn)
    assert "submitted" in started.stderr

    def busy_top() -> Any:
        snap = json.loads(cli.ok("top", "--json").stdout)
        (cluster,) = snap["clusters"]
        nodes = {n["node"]: n for n in cluster["nodes"]}
        if len(nodes) != 2 or any("cpu" not in n["metrics"] for n in nodes.values()):
            return None
        return nodes if nodes[1]["metrics"]["cpu"] > nodes[0]["metrics"]["cpu"] + 10 else None

    try:
        nodes = poll(busy_top, "node 1 busier than node 0 in `top --json`")
    finally:
        release.touch()
    assert nodes[0]["phase"] == "ready" and nodes[0]["metrics"]["mem_total"] > 0

    env = [f"{k}={cli.env[k]}" for k in ("FLOTILLA_HOME", "PYTHONPATH")]
    argv = ["env", *env, sys.executable, "-m", "flotilla", "top", "obs", "--sort", "cpu"]
    term = Terminal(argv, 120, 20, tmp_path)
    try:
        screen = term.wait_for(
            lambda s: "flotilla top" in s and " obs " in s and "ready" in s, "the live table"
        )
        assert "sorted by cpu" in screen
        rows = [line for line in screen.splitlines() if " obs " in line]
        assert len(rows) == 2
        term.keys("m")  # sorted by memory now
        term.wait_for(lambda s: "sorted by mem" in s, "the rows sorted by memory")
        term.keys("q")
        term.wait_for(lambda s: "[exited]" in s, "top ended by q")
    finally:
        term.close()

    cli.ok("logs", "obs", "2")  # follows the job to its end
    shown = cli.ok("events", "obs").stdout
    assert "pool running" in shown and "node 0 ready" in shown and "node 1 ready" in shown
    assert "job 2 succeeded" in shown
    raw = [json.loads(line) for line in cli.ok("events", "obs", "--json").stdout.splitlines()]
    assert {"PoolPhase", "NodeReady", "JobState", "TaskFinished"} <= {e["type"] for e in raw}

    out = tmp_path / "job2.jsonl"
    cli.ok("logs", "obs", "2", "--export", "jsonl", str(out))
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    lines = [e["line"] for e in exported if e["type"] == "LogLine"]
    assert any("done on 1" in line for line in lines)
    assert any(e["type"] == "JobState" for e in exported)
    md = tmp_path / "job2.md"
    cli.ok("logs", "obs", "2", "--export", "md", str(md))
    text = md.read_text()
    assert text.startswith("# Cluster obs, job 2") and "done on 0" in text and "| time |" in text
    refused = cli("logs", "obs", "--export", "html", str(md))
    assert refused.returncode == 2 and "jsonl and md" in refused.stderr


def _fake_pool(home: Path, pool_id: str, nodes: int) -> None:
    """A running pool's entry (``_client/listing.py``) for ``nodes`` nodes, owned by this
    process (alive: ``top`` keeps it)."""
    import os

    from flotilla._client.listing import folder
    from flotilla._system import procs

    view = {
        "pool": pool_id,
        "phase": "running",
        "time": time.time(),
        "running": nodes,
        "done": 0,
        "failed": 0,
        "functions": {},
        "nodes": [
            {
                "node": i,
                "phase": "ready",
                "address": f"10.0.{i // 250}.{i % 250}",
                "host": f"h{i}",
                "metrics": {"cpu": float(i % 97), "mem_used": 2e9, "mem_total": 8e9},
                "sampled": time.time(),
                "running": 1,
                "done": i,
                "failed": 0,
                "healthy": None,
            }
            for i in range(nodes)
        ],
    }
    entry = {"pid": os.getpid(), "pid_start": procs.start_time(os.getpid()), **view}
    old = os.environ.get("FLOTILLA_HOME")
    os.environ["FLOTILLA_HOME"] = str(home)
    try:
        target = folder()
    finally:
        if old is None:
            del os.environ["FLOTILLA_HOME"]
        else:
            os.environ["FLOTILLA_HOME"] = old
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    (target / f"{os.getpid()}-{pool_id}.json").write_text(json.dumps(entry))


def test_top_in_a_terminal_at_6_and_128_nodes(tmp_path: Path) -> None:
    """``top`` in a real terminal (tmux, 100x30): 6 nodes all shown; 128 nodes shown as
    many as fit, busiest first with ``--sort cpu``, and how many more."""
    src = str(Path(__file__).resolve().parent.parent / "src")
    for nodes, pool_id in ((6, "six"), (128, "big")):
        home = tmp_path / f"home-{nodes}"
        _fake_pool(home, pool_id, nodes)
        argv = ["env", f"FLOTILLA_HOME={home}", f"PYTHONPATH={src}", sys.executable]
        argv += ["-m", "flotilla", "top", "--sort", "cpu"]
        term = Terminal(argv, 100, 30, tmp_path)
        try:
            label = f"pool-{pool_id}"
            screen = term.wait_for(lambda s, label=label: label in s, f"the {nodes} nodes")
        finally:
            term.close()
        rows = [line for line in screen.splitlines() if f"pool-{pool_id}" in line]
        cpus = [int(line.split("│")[5].strip().rstrip("%")) for line in rows]
        assert cpus == sorted(cpus, reverse=True)
        if nodes == 6:
            assert len(rows) == 6 and "more node(s)" not in screen
        else:
            assert 10 <= len(rows) < 30 and cpus[0] == 96
            assert f"{128 - len(rows)} more node(s)" in screen.replace("\n", " ")
