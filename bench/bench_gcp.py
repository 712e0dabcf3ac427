"""GCP provider benchmark on the stand-in (``tests/_gcp.py``), whose instances boot (run
their startup script, start sshd, publish their host keys) a fixed delay D after the
insert.

Run as root: ``.venv/bin/python bench/bench_gcp.py [--reps 3] [--boot-delay 2]``. Prints a
markdown table (medians over the repetitions, with their range) of a 4-node pool's start
to the first broadcast result (goal: <= D + 3 s) against a floor measured in the same run,
alternating: the official ``google-cloud-compute`` client inserting the same instances
(``insert_unary``, waited on with a ``ZoneOperationsClient``), waiting until each is RUNNING
with its external address, then ``ssh true`` into each; and the ratio of each repetition
to its floor.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _gcp import PROJECT, GcpLab
from _hosts import lab_unavailable
from start_table import print_start_table, ssh_true

import flotilla as sky

ZONE = "us-central1-a"


@sky.function
def node() -> int:
    return sky.instance_info().node


def one_pool(lab: GcpLab, nodes: int) -> float:
    provider = sky.GCP(zone=ZONE, ssh_user="root", python=sys.executable)
    t0 = time.monotonic()
    with sky.Compute(provider=provider, nodes=nodes) as pool:
        result = node() @ pool
        t1 = time.monotonic()
    assert sorted(result) == list(range(nodes)), result
    assert lab.wait_gone(30) == []
    return t1 - t0


def floor(nodes: int, key: Path, rep: int) -> float:
    """The official client inserts the instances, waits for them, ``ssh true``."""
    from google.cloud import compute_v1 as c

    api = sky.GCP().api
    instances = api.client("InstancesClient")
    ops = api.client("ZoneOperationsClient")
    public = key.with_suffix(".pub").read_text().strip()
    names = [f"floor-{rep}-{i}" for i in range(nodes)]
    t0 = time.monotonic()
    started = []
    for name in names:
        body = c.Instance(
            name=name,
            machine_type=f"zones/{ZONE}/machineTypes/n2-standard-2",
            network_interfaces=[
                c.NetworkInterface(access_configs=[c.AccessConfig(type_="ONE_TO_ONE_NAT")])
            ],
            metadata=c.Metadata(items=[c.Items(key="ssh-keys", value=f"root:{public}")]),
        )
        started.append(instances.insert_unary(project=PROJECT, zone=ZONE, instance_resource=body))
    for op in started:
        ops.wait(project=PROJECT, zone=ZONE, operation=op.name)
    addresses = {}
    while len(addresses) < nodes:
        for name in names:
            got = instances.get(project=PROJECT, zone=ZONE, instance=name)
            nat = got.network_interfaces[0].access_configs[0].nat_i_p
            if got.status == "RUNNING" and nat:
                addresses[name] = nat
        time.sleep(0.05)

    ssh_true(str(key), ((a, 22) for a in addresses.values()))
    t1 = time.monotonic()
    for name in names:
        op = instances.delete_unary(project=PROJECT, zone=ZONE, instance=name)
        ops.wait(project=PROJECT, zone=ZONE, operation=op.name)
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
    folder = Path(tempfile.mkdtemp(prefix="flotilla-bench-gcp-"))
    key = folder / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    with GcpLab(boot_delay=args.boot_delay) as lab:
        one_pool(lab, args.nodes)  # warm: the bundle is built once per client
        starts, floors = [], []
        for rep in range(args.reps):
            floors.append(floor(args.nodes, key, rep))
            starts.append(one_pool(lab, args.nodes))

    print_start_table(
        f"GCP stand-in, {args.nodes} instances",
        "official client inserts, waits, ssh true",
        starts,
        floors,
        args.boot_delay,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
