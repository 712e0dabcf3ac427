"""Reading a 200 MB object set through a bucket volume on 4 nodes, against an ``aws s3
cp``-style boto3 download on one node, in the same run (issue 25's goal: <= 1.5x per node).

Run: ``.venv/bin/python bench/bench_volumes.py [--mb 200] [--objects 20] [--reps 1]``.
The bucket is served by moto's S3 server (``moto_server``, its own process) on loopback;
the mount rows need root and /dev/fuse (s3fs), else they are skipped. Prints a markdown
table: seconds per node (median over nodes and repetitions) and the ratio to boto3's.

Rows:
* boto3, 1 node: ``download_file`` of every object, one after the other (boto3's transfer
  manager splits large objects into parallel ranged GETs), as ``aws s3 cp --recursive``.
* copy, N nodes: what a ``mode="copy"`` volume does on each node before anything runs
  (``flotilla._node.volumes``: the standard-library SigV4 client), timed on every node at
  once.
* mount (s3fs, rclone), N nodes: reading every file of a ``mode="mount"`` volume, on
  every node at once.

All nodes share one machine and one S3 server, so N nodes at once share its cores and
the server: the N-node rows measure that contention too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import flotilla as sky
from flotilla._volume import node_spec

REGION = "us-east-1"


@sky.function
def boto3_download(endpoint: str, bucket: str, prefix: str) -> float:
    """``aws s3 cp --recursive``: every object with boto3's transfer manager."""
    import boto3

    client = boto3.client("s3", region_name=REGION, endpoint_url=endpoint)
    dest = tempfile.mkdtemp(dir=".")
    t0 = time.perf_counter()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    for key in keys:
        client.download_file(bucket, key, os.path.join(dest, key.replace("/", "_")))
    took = time.perf_counter() - t0
    shutil.rmtree(dest)
    return took


@sky.function
def copy_in(spec: dict[str, Any]) -> float:
    """What a copy-mode volume does on a node before anything runs."""
    from flotilla._node.volumes import Volumes

    dest = os.path.abspath(tempfile.mkdtemp(dir="."))
    t0 = time.perf_counter()
    Volumes(spec)._copy_in(spec["volumes"][0], dest)
    took = time.perf_counter() - t0
    shutil.rmtree(dest)
    return took


@sky.function
def read_all(path: str) -> float:
    t0 = time.perf_counter()
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                while f.read(1 << 20):
                    pass
    return time.perf_counter() - t0


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto_server did not listen") from None
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--objects", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_DEFAULT_REGION=REGION,
        AWS_EC2_METADATA_DISABLED="true",
    )
    for name in ("AWS_CA_BUNDLE", "AWS_PROFILE"):
        os.environ.pop(name, None)
    server, endpoint = start_server()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        import boto3

        client = boto3.client("s3", region_name=REGION, endpoint_url=endpoint)
        bucket = "bench-volumes"
        client.create_bucket(Bucket=bucket)
        size = args.mb * (1 << 20) // args.objects
        blob = os.urandom(size)
        for i in range(args.objects):
            client.put_object(Bucket=bucket, Key=f"set/part-{i:03d}", Body=blob)
        spec, _ = node_spec([sky.Volume(bucket, "x", prefix="set", mode="copy")])
        rows: list[tuple[str, list[float]]] = []
        with sky.Compute(nodes=args.nodes) as pool:
            rows.append(
                (
                    "boto3 download, 1 node",
                    [boto3_download(endpoint, bucket, "set") >> pool for _ in range(args.reps)],
                )
            )
            rows.append(("copy volume, 1 node", [copy_in(spec) >> pool for _ in range(args.reps)]))
            rows.append(
                (
                    f"copy volume, {args.nodes} nodes at once",
                    [t for _ in range(args.reps) for t in copy_in(spec) @ pool],
                )
            )
        fuse = os.geteuid() == 0 and os.path.exists("/dev/fuse")
        vol = sky.Volume(bucket, "mnt", prefix="set")
        for tool in ("s3fs", "rclone") if fuse else ():
            if not shutil.which(tool):
                continue
            os.environ["FLOTILLA_FUSE_TOOL"] = tool  # the local nodes inherit it
            for nodes in (1, args.nodes):
                samples: list[float] = []
                for _ in range(args.reps):  # a new pool each time: nothing cached
                    with sky.Compute(nodes=nodes, volumes=[vol]) as pool:
                        samples += read_all("mnt") @ pool
                rows.append((f"mount volume ({tool}), {nodes} node(s) at once", samples))
        base = statistics.median(rows[0][1])
        print(
            f"{args.mb} MB in {args.objects} objects, moto S3 server on loopback, {os.cpu_count()} CPUs\n"
        )
        print("| what | s per node (median) | MB/s per node | × boto3, 1 node |")
        print("| --- | --- | --- | --- |")
        for what, samples in rows:
            med = statistics.median(samples)
            print(f"| {what} | {med:.2f} | {args.mb / med:.0f} | {med / base:.2f} |")
        if not fuse:
            print("\n(mount rows skipped: they need root and /dev/fuse)")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
