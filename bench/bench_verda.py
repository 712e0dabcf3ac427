"""Verda provider benchmark on the stand-in (``tests/_verda.py``), whose instances boot
(run their startup script, then sshd) a fixed delay D after they are created.

Run as root: ``.venv/bin/python bench/bench_verda.py [--reps 1] [--boot-delay 2]``.
Prints a markdown table (medians over the repetitions, with their range) of a 4-node pool's
start to the first broadcast result (goal: <= D + 3 s) against a floor measured in the same
run, alternating: the official ``verda`` client creating the same instances (with an SSH
key registered), waiting until each is ``running``, then ``ssh true`` into each; and the
ratio of each repetition to its floor.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _hosts import lab_unavailable
from _verda import CLIENT_ID, CLIENT_SECRET, VerdaLab
from start_table import print_start_table, ssh_true

import flotilla as sky

TYPE = ("1A100.22V", "A100 SXM4 80GB", 1, 1.29)


@sky.function
def node() -> int:
    return sky.instance_info().node


def one_pool(lab: VerdaLab, nodes: int) -> float:
    t0 = time.monotonic()
    with sky.Compute(provider=sky.Verda(), accelerator="A100", nodes=nodes) as pool:
        result = node() @ pool
        t1 = time.monotonic()
    assert sorted(result) == list(range(nodes)), result
    assert lab.wait_gone(30) == []
    return t1 - t0


def floor(lab: VerdaLab, nodes: int, key: Path) -> float:
    """The official client creates the instances, waits until they run, ``ssh true``."""
    from verda import VerdaClient

    t0 = time.monotonic()
    client = VerdaClient(CLIENT_ID, CLIENT_SECRET, base_url=lab.url)
    ssh_key = client.ssh_keys.create("floor", key.with_suffix(".pub").read_text().strip())
    ids = [
        client.instances.create(
            TYPE[0], "ubuntu-24.04", f"floor-{i}", "floor", [ssh_key.id], "FIN-01"
        ).id
        for i in range(nodes)
    ]
    ips: dict[str, str] = {}
    while len(ips) < nodes:
        for inst in client.instances.get():
            if inst.id in ids and inst.status == "running" and inst.ip:
                ips[inst.id] = inst.ip
        time.sleep(0.05)

    ssh_true(str(key), ((ip, 22) for ip in ips.values()))
    t1 = time.monotonic()
    client.instances.action(ids, "delete")
    client.ssh_keys.delete_by_id(ssh_key.id)
    assert lab.wait_gone(30) == []
    return t1 - t0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--boot-delay", type=float, default=2.0)
    parser.add_argument("--nodes", type=int, default=4)
    args = parser.parse_args()
    reason = lab_unavailable()
    if reason:
        print(f"skipped: {reason}")
        return 0
    folder = Path(tempfile.mkdtemp(prefix="flotilla-bench-verda-"))
    key = folder / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    with VerdaLab(boot_delay=args.boot_delay) as lab:
        lab.add_type(*TYPE, capacity={"FIN-01": 2 * args.nodes})
        one_pool(lab, args.nodes)  # warm: the bundle is built once per client
        starts, floors = [], []
        for _ in range(args.reps):
            floors.append(floor(lab, args.nodes, key))
            starts.append(one_pool(lab, args.nodes))

    print_start_table(
        f"Verda stand-in, {args.nodes} instances",
        "official client creates, waits, ssh true",
        starts,
        floors,
        args.boot_delay,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
