"""Lambda Cloud provider benchmark on the stand-in (``tests/_lambda.py``), whose instances
boot (run their user data, then sshd) a fixed delay D after they are launched.

Run as root: ``.venv/bin/python bench/bench_lambda.py [--reps 3] [--boot-delay 2]``.
Prints a markdown table (medians over the repetitions, with their range) of a 4-node pool's
start to the first result (goal: <= D + 3 s) against a floor measured in the same run,
alternating: Lambda's documented REST calls (no official Python client exists) registering
an SSH key and launching the same instances in one ``instance-operations/launch``, waiting
until each is ``active``, then ``ssh true`` into each; and the ratio of each repetition to
its floor.
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _hosts import lab_unavailable
from _lambda import API_KEY, LambdaLab
from start_table import print_start_table, ssh_true

import flotilla as sky

TYPE = ("gpu_1x_a10", "A10 (24 GB PCIe)", 1, 75)
REGION = "us-east-1"


@sky.function
def node() -> int:
    return sky.instance_info().node


def one_pool(lab: LambdaLab, nodes: int) -> float:
    t0 = time.monotonic()
    provider = sky.LambdaCloud(ssh_user="root")  # the lab's instances log in as root
    with sky.Compute(provider=provider, accelerator="A10", nodes=nodes) as pool:
        result = node() @ pool
        t1 = time.monotonic()
    assert sorted(result) == list(range(nodes)), result
    assert lab.wait_gone(30) == []
    return t1 - t0


def call(lab: LambdaLab, method: str, path: str, body: object = None) -> Any:
    """One documented REST call, with HTTP Basic auth as Lambda's examples use it."""
    auth = "Basic " + base64.b64encode(f"{API_KEY}:".encode()).decode()
    req = urllib.request.Request(
        lab.url + path,
        data=json.dumps(body).encode() if body is not None else None,
        method=method,
        headers={"Authorization": auth, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["data"]


def floor(lab: LambdaLab, nodes: int, key: Path) -> float:
    """The documented calls launch the instances, wait until they are active, ``ssh true``."""
    t0 = time.monotonic()
    public = key.with_suffix(".pub").read_text().strip()
    ssh_key = call(lab, "POST", "/ssh-keys", {"name": "floor", "public_key": public})
    body = {
        "region_name": REGION,
        "instance_type_name": TYPE[0],
        "ssh_key_names": ["floor"],
        "quantity": nodes,
        "name": "floor",
    }
    ids = call(lab, "POST", "/instance-operations/launch", body)["instance_ids"]
    ips: dict[str, str] = {}
    while len(ips) < nodes:
        for inst in call(lab, "GET", "/instances"):
            if inst["id"] in ids and inst["status"] == "active" and inst["ip"]:
                ips[inst["id"]] = inst["ip"]
        time.sleep(0.05)

    ssh_true(str(key), ((ip, 22) for ip in ips.values()))
    t1 = time.monotonic()
    call(lab, "POST", "/instance-operations/terminate", {"instance_ids": ids})
    call(lab, "DELETE", f"/ssh-keys/{ssh_key['id']}")
    assert lab.wait_gone(30) == []
    return t1 - t0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--boot-delay", type=float, default=2.0)
    parser.add_argument("--nodes", type=int, default=4)
    args = parser.parse_args()
    reason = lab_unavailable()
    if reason:
        print(f"skipped: {reason}")
        return 0
    folder = Path(tempfile.mkdtemp(prefix="flotilla-bench-lambda-"))
    key = folder / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    with LambdaLab(boot_delay=args.boot_delay) as lab:
        lab.add_type(*TYPE, capacity={REGION: 2 * args.nodes * (args.reps + 1)})
        one_pool(lab, args.nodes)  # warm: the bundle is built once per client
        starts, floors = [], []
        for _ in range(args.reps):
            floors.append(floor(lab, args.nodes, key))
            starts.append(one_pool(lab, args.nodes))

    print_start_table(
        f"Lambda Cloud stand-in, {args.nodes} instances",
        "documented REST calls launch, wait, ssh true",
        starts,
        floors,
        args.boot_delay,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
