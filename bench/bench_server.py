"""The server's overhead (issue 39): cluster status through the API against ``flotilla
status``, and 100 clients following one cluster's events at once.

Standalone: ``python bench/bench_server.py [--reps 15] [--clients 100]``. A real server
(``flotilla server start``) and a real 2-node local cluster in a temporary FLOTILLA_HOME;
loopback only, every loop bounded. Prints a Markdown section.

- status: the wall time of ``flotilla status`` (a fresh process, as a user runs it), of
  ``GET /api/v1/clusters`` on a new connection, and on a kept-alive one; medians.
- events: ``--clients`` streams of ``/api/v1/clusters/NAME/events`` open together; a job
  is run, and each client's delay from an event's own time (when the daemon wrote it) to
  its arrival is measured (median, 95th percentile, max over clients), with the server's
  CPU and memory meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx


def flotilla(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flotilla", *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def timed(fn: Any, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def follow(
    url: str, headers: dict[str, str], job: str, arrivals: list[float], opened: threading.Barrier
) -> None:
    """Follow the cluster's events until job ``job`` is RUNNING; the delay of that event."""
    with httpx.Client(headers=headers, timeout=120) as c, c.stream("GET", url) as answer:
        opened.wait(timeout=120)
        event = ""
        for line in answer.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "event":
                data = json.loads(line[6:])
                ours = data.get("type") == "JobState" and data.get("job") == job
                if ours and data.get("state") == "RUNNING":
                    arrivals.append(time.time() - float(data["time"]))
                    return


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--clients", type=int, default=100)
    args = p.parse_args()
    home = Path(tempfile.mkdtemp(prefix="flotilla-bench-server-"))
    env = {**os.environ, "FLOTILLA_HOME": str(home)}
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    flotilla(env, "server", "start", "--port", "0")
    try:
        info = json.loads((home / "server" / "server.json").read_text())
        token = (home / "server" / "token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        url, pid = info["url"], int(info["pid"])
        flotilla(env, "launch", "-c", "b", "--nodes", "2", "echo ready")

        cli = timed(lambda: flotilla(env, "status"), args.reps)
        fresh = timed(lambda: httpx.get(url + "/api/v1/clusters", headers=headers), args.reps)
        with httpx.Client(base_url=url, headers=headers) as c:
            kept = timed(lambda: c.get("/api/v1/clusters").raise_for_status(), args.reps * 4)
            one = timed(lambda: c.get("/api/v1/clusters/b").raise_for_status(), args.reps * 4)

        arrivals: list[float] = []
        opened = threading.Barrier(args.clients + 1)
        threads = [
            threading.Thread(
                target=follow,
                args=(url + "/api/v1/clusters/b/events", headers, "2", arrivals, opened),
                daemon=True,
            )
            for _ in range(args.clients)
        ]
        for t in threads:
            t.start()
        opened.wait(timeout=120)
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        time.sleep(5.0)  # the streams idle: what holding them costs the server
        idle_cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
        memory = rss_mb(pid)
        flotilla(env, "exec", "b", "-d", "echo job")
        for t in threads:
            t.join(timeout=120)
        arrivals.sort()
        print("### The API against the command line (2-node local cluster)\n")
        print("| what | median |")
        print("| --- | --- |")
        print(f"| `flotilla status` (a fresh process) | {cli * 1000:.0f} ms |")
        print(f"| `GET /api/v1/clusters`, new connection | {fresh * 1000:.1f} ms |")
        print(f"| `GET /api/v1/clusters`, kept-alive connection | {kept * 1000:.1f} ms |")
        print(f"| `GET /api/v1/clusters/b` (nodes, metrics), kept alive | {one * 1000:.1f} ms |")
        print(f"\n### {args.clients} clients following one cluster's events\n")
        print("| what | value |")
        print("| --- | --- |")
        print(f"| clients that got the job's RUNNING event | {len(arrivals)} of {args.clients} |")
        if arrivals:
            p95 = arrivals[min(len(arrivals) - 1, int(0.95 * len(arrivals)))]
            print(
                f"| delay from the event's time to a client, median | {statistics.median(arrivals) * 1000:.0f} ms |"
            )
            print(
                f"| the same, 95th percentile / max | {p95 * 1000:.0f} ms / {arrivals[-1] * 1000:.0f} ms |"
            )
        print(f"| server CPU while {args.clients} streams idle | {idle_cpu * 100:.0f}% of a core |")
        print(f"| server memory (RSS) with {args.clients} streams | {memory:.0f} MB |")
    finally:
        subprocess.run(
            [sys.executable, "-m", "flotilla", "down", "b", "-y"], env=env, capture_output=True
        )
        subprocess.run(
            [sys.executable, "-m", "flotilla", "server", "stop"], env=env, capture_output=True
        )
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
