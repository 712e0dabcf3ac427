"""Ray cluster start: a pool with ``plugins.ray()`` against ``ray up``-style manual starts.

Run as root: ``.venv/bin/python bench/bench_engines.py [--reps 3]``. Three SSH test hosts
(network namespaces) get Ray from a wheel index on the lab's bridge (tests/_wheels.py); a
first pool builds the environment and is not counted. Then, in alternating repetitions on
the same hosts, so that both see the same load:

* flotilla: ``sky.Compute(SSH(hosts), nodes=3, plugins=[ray(...)]).open()``: agents started
  over SSH, Ray's head on node 0 and a worker node on the others, until every node is alive
  in the cluster;
* manual: what ``ray up`` does over SSH with the same environment: ``ray start --head`` on
  the first host, then ``ray start --address=...`` on the others in parallel, then a
  driver on the head waits until the cluster has 3 alive nodes.

Both use one CPU per node, an 80 MiB object store and no dashboard. Prints a markdown table
of medians (with min-max) and the ratio of the medians (flotilla / manual).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _hosts import Lab, lab_unavailable
from _wheels import HOST_PYTHON, PackageIndex, wheels_for

import flotilla as sky
from flotilla._system.procs import has_env, kill_all
from flotilla.plugins._daemons import wait_none_left

RAY = "2.60.0"
NODES = 3
MARK = "FLOTILLA_BENCH_RAY=1"
SMALL = ["--num-cpus=1", f"--object-store-memory={80 * 1024 * 1024}", "--disable-usage-stats"]
WAIT = (
    "import ray, sys, time; ray.init(address=sys.argv[1], logging_level='ERROR', "
    "log_to_driver=False)\n"
    "while sum(n['Alive'] for n in ray.nodes()) < int(sys.argv[2]): time.sleep(0.1)\n"
)


def plugin() -> Any:
    return sky.plugins.ray(version=RAY, num_cpus=1, object_store_memory=80 * 1024 * 1024)


def flotilla_start(lab: Lab) -> float:
    pool = sky.Compute(lab.provider(python=HOST_PYTHON), nodes=NODES, plugins=[plugin()])
    t0 = time.perf_counter()
    try:
        pool.open()
        return time.perf_counter() - t0
    finally:
        pool.close()


def ssh(lab: Lab, host: str, command: str) -> list[str]:
    return [
        "ssh",
        "-i",
        str(lab.client_key),
        "-o",
        f"UserKnownHostsFile={lab.known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        f"root@{host}",
        command,
    ]


def manual_start(lab: Lab, site: str, rep: int) -> float:
    """``ray up``'s way: ray start over SSH on the head, then the workers, then wait."""
    hosts = [h.addr for h in lab.hosts[:NODES]]
    env = f"env {MARK} PYTHONPATH={site} RAY_USAGE_STATS_ENABLED=0"
    # not /tmp/ray (other Rays may run), and one per host: the test hosts share this
    # machine's /tmp, where separate machines have their own
    temp = f"/tmp/flotilla-bench-ray-{os.getpid()}-{rep}"
    ray = f"{env} {HOST_PYTHON} -m ray.scripts.scripts start {' '.join(SMALL)}"
    port = 46379 + rep
    log = f"{temp}.log"
    quiet = f"</dev/null >>{log} 2>&1"  # Ray's daemons must not hold the SSH session open
    head = f"{ray} --temp-dir={temp}-0 --head --port={port} --include-dashboard=false"
    head += f" --node-ip-address={hosts[0]}"
    head += f" {quiet}"
    t0 = time.perf_counter()
    try:
        subprocess.run(ssh(lab, hosts[0], head), check=True, capture_output=True)
        workers = [
            subprocess.Popen(
                ssh(
                    lab,
                    h,
                    f"{ray} --temp-dir={temp}-{i} --address={hosts[0]}:{port} "
                    f"--node-ip-address={h} {quiet}",
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for i, h in enumerate(hosts[1:], 1)
        ]
        for w in workers:
            if w.wait() != 0:
                raise RuntimeError(f"a manual ray start failed: {Path(log).read_text()[-2000:]}")
        wait = f'{env} {HOST_PYTHON} -c "{WAIT}" {hosts[0]}:{port} {NODES}'
        subprocess.run(ssh(lab, hosts[0], wait), check=True, capture_output=True)
        return time.perf_counter() - t0
    finally:
        kill_all(lambda pid: has_env(pid, MARK.encode()))  # never `ray stop`: it kills all
        wait_none_left(MARK.encode(), 10.0)
        for i in range(NODES):
            shutil.rmtree(f"{temp}-{i}", ignore_errors=True)
        Path(log).unlink(missing_ok=True)


def built_site(lab: Lab) -> str:
    """The environment the warm-up pool built (the hosts share this machine's disk)."""
    for site in sorted((lab.tmp / "workdir").glob("envs/*/site")):
        if (site / "ray").is_dir():
            return str(site)
    raise RuntimeError("no environment with Ray was built")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    reason = lab_unavailable()
    if reason:
        sys.exit(f"skipped: {reason}")
    wheels = wheels_for([f"ray=={RAY}"])
    with Lab() as lab:
        index = PackageIndex([wheels], f"{lab.subnet}.1")
        try:
            env = {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
            for _ in range(NODES):
                lab.add_host(env={**env, **index.host_env()})
            flotilla_start(lab)  # builds the environment: not counted
            site = built_site(lab)
            ours, theirs = [], []
            failed = 0
            for rep in range(args.reps):
                ours.append(flotilla_start(lab))
                for attempt in range(3):  # Ray's 30 s for a raylet to register, under load
                    try:
                        theirs.append(manual_start(lab, site, rep * 3 + attempt))
                        break
                    except RuntimeError as e:
                        failed += 1
                        print(f"manual start failed, again: {str(e)[-300:]}", file=sys.stderr)
        finally:
            index.close()
    mo, mt = statistics.median(ours), statistics.median(theirs)
    print(f"## Ray cluster start on {NODES} SSH hosts (issue 41), {args.reps} alternating reps\n")
    print("| start | median s | min-max s |")
    print("| --- | --- | --- |")
    print(
        f"| pool with plugins.ray() (agents + Ray) | {mo:.2f} | {min(ours):.2f}-{max(ours):.2f} |"
    )
    print(
        f"| manual `ray start` over SSH (ray up's way) | {mt:.2f} | "
        f"{min(theirs):.2f}-{max(theirs):.2f} |"
    )
    print(f"\nratio of medians flotilla / manual: {mo / mt:.2f}x")
    print(f"flotilla: {[round(x, 2) for x in ours]}, manual: {[round(x, 2) for x in theirs]}")
    print(
        f"manual starts that failed (Ray's raylet registration timeout) and were run again: {failed}"
    )


if __name__ == "__main__":
    main()
