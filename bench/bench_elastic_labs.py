"""Elastic pools on the SLURM lab and the Vast.ai and RunPod stand-ins (issue 37): wake from
zero against a plain start, and a burst against a fixed pool.

Run as root: ``.venv/bin/python bench/bench_elastic_labs.py [--reps 3] [--labs slurm,vast,
runpod]``. Per lab and repetition:

* plain: ``Compute(nodes=1)`` from ``open`` to the first result;
* wake: a ``Nodes(0, max=N, min=0)`` pool (open: nothing rented or submitted) from its
  first call to the result;
* burst: 200 calls of 50 ms (``map``) on a fixed pool of N from ``open`` to the last
  result, against the same on ``Nodes(0, max=N, min=0)`` (starting its nodes included).

N is 3 (the SLURM lab's nodes; the Vast lab gets 3 machines of one cluster, RunPod's one
GPU type room for 3 pods). Prints a markdown table of medians (min-max) and the ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _runpod import RunPodLab
from _slurm import SlurmCluster, cluster_unavailable
from _vast import VastLab, vast_unavailable

import flotilla as sky
from flotilla.providers import Provider

N = 3
CALLS = 200


@sky.function
def node() -> int:
    return sky.instance_info().node


@sky.function
def work(i: int) -> int:
    time.sleep(0.05)
    return i


def one_round(make: Callable[[], Provider]) -> dict[str, float]:
    out: dict[str, float] = {}
    gpu = {"accelerator": "A100"} if isinstance(make(), sky.RunPod) else {}
    t0 = time.monotonic()
    with sky.Compute(provider=make(), nodes=1, **gpu) as p:
        assert node() >> p == 0
        out["plain"] = time.monotonic() - t0
    empty = sky.Nodes(0, max=N, min=0)
    with sky.Compute(provider=make(), nodes=empty, **gpu) as p:
        t0 = time.monotonic()
        assert node() >> p == 0
        out["wake"] = time.monotonic() - t0
    for key, nodes in (("fixed", N), ("elastic", empty)):
        t0 = time.monotonic()
        with sky.Compute(provider=make(), nodes=nodes, **gpu) as p:
            assert p.map(work, range(CALLS)) == list(range(CALLS))
            out[key] = time.monotonic() - t0
    return out


@contextmanager
def slurm_lab() -> Iterator[Callable[[], Provider]]:
    with SlurmCluster(N) as cluster:
        os.environ["SLURM_CONF"] = str(cluster.conf)
        for name in [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del os.environ[name]
        yield lambda: sky.Slurm(time="30:00")


@contextmanager
def vast_lab() -> Iterator[Callable[[], Provider]]:
    with VastLab(boot_delay=2.0) as lab:
        lab.add_machines(N, cluster_id=1)
        yield sky.VastAI


@contextmanager
def runpod_lab() -> Iterator[Callable[[], Provider]]:
    with RunPodLab(boot_delay=2.0) as lab:
        lab.add_gpu("NVIDIA A100 80GB PCIe", "A100 PCIe", 80, stock={"US-TX-3": N})
        yield sky.RunPod


LABS = {
    "slurm": ("SLURM lab (3 slurmd)", slurm_lab),
    "vast": ("Vast stand-in (D = 2 s)", vast_lab),
    "runpod": ("RunPod stand-in (D = 2 s)", runpod_lab),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--labs", default="slurm,vast,runpod", help="of " + ", ".join(LABS))
    args = parser.parse_args()
    chosen = [LABS[k.strip()] for k in args.labs.split(",") if k.strip()]
    for reason in (
        cluster_unavailable() if slurm_lab in dict(chosen).values() else None,
        vast_unavailable(),
    ):
        if reason:
            sys.exit(f"bench_elastic_labs: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the labs down on SIGTERM
    results: dict[str, list[dict[str, float]]] = {}
    for name, lab in chosen:
        with lab() as make:
            one_round(make)  # warm-up
            results[name] = [one_round(make) for _ in range(args.reps)]
    report(results, args.reps)


def report(results: dict[str, list[dict[str, float]]], reps: int) -> None:
    def spread(runs: list[dict[str, float]], key: str) -> str:
        values = [r[key] for r in runs]
        return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"

    def ratio(runs: list[dict[str, float]], a: str, b: str) -> str:
        values = [r[a] / r[b] for r in runs]
        return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    load = os.getloadavg()[0]
    print(f"### Elastic pools on the labs ({N} nodes at most)\n")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {load:.1f} at the end; {reps} repetitions, "
        "medians (min-max).\n"
    )
    print(
        "| lab | plain start to first result | wake from zero to first result | wake / plain "
        f"| {CALLS} x 50 ms, fixed {N} | the same, from zero | from zero / fixed |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        print(
            f"| {name} | {spread(runs, 'plain')} | {spread(runs, 'wake')} | "
            f"{ratio(runs, 'wake', 'plain')} | {spread(runs, 'fixed')} | "
            f"{spread(runs, 'elastic')} | {ratio(runs, 'elastic', 'fixed')} |"
        )


if __name__ == "__main__":
    main()
