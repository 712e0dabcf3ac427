"""RunPod provider benchmark on the stand-in (``tests/_runpod.py``), whose pods boot (run
their start command, then sshd) a fixed delay D after they are created.

Run as root: ``.venv/bin/python bench/bench_runpod.py [--reps 3] [--boot-delay 2]``.
Prints a markdown table (medians over the repetitions, with their range) of a 4-pod pool's
start to the first broadcast result (goal: <= D + 3 s) against a floor measured in the same
run, alternating: the official ``runpod`` client creating the same pods (GraphQL
``podFindAndDeployOnDemand``), waiting until each reports its public SSH port, then
``ssh true`` into each; and the ratio of each repetition to its floor.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _hosts import lab_unavailable
from _runpod import API_KEY, RunPodLab
from start_table import print_start_table, ssh_true

import flotilla as sky

GPU = ("NVIDIA A100 80GB PCIe", "A100 PCIe", 80)


@sky.function
def node() -> int:
    return sky.instance_info().node


def one_pool(lab: RunPodLab, nodes: int) -> float:
    t0 = time.monotonic()
    with sky.Compute(provider=sky.RunPod(), accelerator="A100", nodes=nodes) as pool:
        result = node() @ pool
        t1 = time.monotonic()
    assert sorted(result) == list(range(nodes)), result
    assert lab.wait_gone(30) == []
    return t1 - t0


def floor(lab: RunPodLab, nodes: int, key: Path) -> float:
    """The official client creates the pods, waits for their SSH ports, ``ssh true``."""
    import runpod

    runpod.api_key = API_KEY
    public = key.with_suffix(".pub").read_text().strip()
    t0 = time.monotonic()
    ids = [
        runpod.create_pod(f"floor-{i}", "runpod/base", GPU[0], env={"PUBLIC_KEY": public})["id"]
        for i in range(nodes)
    ]
    ports: dict[str, Any] = {}
    while len(ports) < nodes:
        for i in ids:
            runtime = runpod.get_pod(i)["runtime"]
            if i not in ports and runtime and runtime["ports"]:
                ports[i] = runtime["ports"][0]
        time.sleep(0.05)

    ssh_true(str(key), ((p["ip"], int(p["publicPort"])) for p in ports.values()))
    t1 = time.monotonic()
    for i in ids:
        runpod.terminate_pod(i)
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
    folder = Path(tempfile.mkdtemp(prefix="flotilla-bench-runpod-"))
    key = folder / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    with RunPodLab(boot_delay=args.boot_delay) as lab:
        lab.add_gpu(*GPU, stock={"EU-RO-1": 2 * args.nodes})
        one_pool(lab, args.nodes)  # warm: the bundle is built once per client
        starts, floors = [], []
        for _ in range(args.reps):
            floors.append(floor(lab, args.nodes, key))
            starts.append(one_pool(lab, args.nodes))

    print_start_table(
        f"RunPod stand-in, {args.nodes} pods",
        "official client creates, waits, ssh true",
        starts,
        floors,
        args.boot_delay,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
