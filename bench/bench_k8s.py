"""Kubernetes provider benchmark on the test lab (a real kube-apiserver, kube-scheduler and
etcd; the kubelets stood in by the tests' node agent, see ``tests/_k8s.py``).

Run as root: ``.venv/bin/python bench/bench_k8s.py [--reps 3]``. Prints a markdown table
(medians over the repetitions, with their spread), each side measured in alternating
repetitions so that both see the same load:

* pool start to the first broadcast result (``noop() @ pool``) on 3 and on 8 pods, against
  the floor: creating the same pods with one ``kubectl create`` (the same spec, holder
  command included), waiting until every one runs, then ``kubectl exec POD -- true`` into
  each at once (goal: <= 1.5x the floor + 0.5 s);
* how the start grows from 3 to 8 pods (goal: 8 pods <= 1.3x 3 pods);
* the CPU seconds each start costs the whole lab (load changes wall time far more).

Pods run the client's interpreter (``sys.executable``): the lab's pods are processes of
this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _k8s import K8sLab, lab_unavailable

import flotilla as sky
from flotilla._providers.base import Options, PoolSpec
from flotilla._providers.k8s import Kubernetes


@sky.function
def noop() -> None:
    return None


def provider(lab: K8sLab) -> Kubernetes:
    return Kubernetes(
        kubeconfig=str(lab.kubeconfig), kubectl=lab.kubectl_path, python=sys.executable
    )


def wait_gone(lab: K8sLab) -> None:
    """Until no pod of any pool is left (between repetitions)."""
    while lab.pods(selector="app.kubernetes.io/managed-by=flotilla"):
        time.sleep(0.1)


def floor(lab: K8sLab, nodes: int, rep: int) -> float:
    """Seconds to create ``nodes`` pods (one call), see them all run, and exec ``true``
    into each (at once)."""
    pool_id = f"floor{rep}n{nodes}"
    spec = PoolSpec(pool_id, nodes, None, None, (), Options())
    prov = provider(lab)
    pods = [prov.pod(spec, r, f"flotilla-{pool_id}-{r}") for r in range(nodes)]
    doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": pods})
    kubectl = [lab.kubectl_path, f"--kubeconfig={lab.kubeconfig}"]
    t0 = time.perf_counter()
    subprocess.run(
        [*kubectl, "create", "-f", "-"], input=doc, text=True, check=True, capture_output=True
    )
    while True:
        items = lab.pods(selector=f"flotilla/pool={pool_id}")
        if len(items) == nodes and all(
            p["status"].get("phase") == "Running" and p["status"].get("podIP") for p in items
        ):
            break
        time.sleep(0.05)
    execs = [
        subprocess.Popen([*kubectl, "exec", p["metadata"]["name"], "--", "true"]) for p in pods
    ]
    assert all(e.wait() == 0 for e in execs)
    took = time.perf_counter() - t0
    subprocess.run(
        [*kubectl, "delete", "pods", "-l", f"flotilla/pool={pool_id}", "--wait=true"],
        check=True,
        capture_output=True,
    )
    return took


def first_result(lab: K8sLab, nodes: int) -> float:
    """Seconds from pool start to the first broadcast result."""
    t0 = time.perf_counter()
    pool = sky.Compute(provider=provider(lab), nodes=nodes)
    try:
        pool.open()
        noop() @ pool
        took = time.perf_counter() - t0
    finally:
        pool.close()
    return took


def cpu_seconds(lab: K8sLab) -> float:
    """CPU seconds used so far by the lab (etcd, the API server, the scheduler, the node
    stand-in and the pods it ran) and by this process and its children (kubectl)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for proc in lab.procs:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15]) / tick  # own and reaped children's
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def measured(lab: K8sLab, run: Callable[[], float]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of ``run``; the CPU until its pods are gone."""
    before = cpu_seconds(lab)
    took = run()
    wait_gone(lab)
    time.sleep(0.5)  # the stand-in reaps the pods' processes
    return took, cpu_seconds(lab) - before


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    why = lab_unavailable()
    if why:
        print(f"(skipped: {why})")
        return
    results: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    loads = [os.getloadavg()[0]]
    with K8sLab() as lab:
        first_result(lab, 1)  # warm: the client builds its bundle once (each pod is new)
        wait_gone(lab)
        for rep in range(args.reps):
            for nodes in (3, 8):
                runs: list[tuple[str, Callable[[], float]]] = [
                    ("floor", lambda n=nodes, r=rep: floor(lab, n, r)),
                    ("flotilla", lambda n=nodes: first_result(lab, n)),
                ]
                if rep % 2:
                    runs.reverse()
                for name, run in runs:
                    took, used = measured(lab, run)
                    results.setdefault((name, nodes), []).append(took)
                    cpu.setdefault((name, nodes), []).append(used)
                loads.append(os.getloadavg()[0])
    rows = []
    for nodes in (3, 8):
        f = statistics.median(results[("floor", nodes)])
        s = statistics.median(results[("flotilla", nodes)])
        goal = 1.5 * f + 0.5
        paired = [  # each repetition's own: both sides saw the same load
            a / b
            for a, b in zip(results[("flotilla", nodes)], results[("floor", nodes)], strict=True)
        ]
        rows.append(
            f"| {nodes} pods | {med(results[('flotilla', nodes)])} | "
            f"{med(results[('floor', nodes)])} | {s / f:.2f}x | "
            f"{statistics.median(paired):.2f}x | <= {goal:.2f} s | "
            f"{'met' if s <= goal else 'MISSED'} |"
        )
    s3 = statistics.median(results[("flotilla", 3)])
    s8 = statistics.median(results[("flotilla", 8)])
    f3 = statistics.median(results[("floor", 3)])
    f8 = statistics.median(results[("floor", 8)])
    print(
        "### Kubernetes provider (real kube-apiserver and kube-scheduler v1.20; kubelets "
        "stood in by the tests' node agent)"
    )
    print()
    print(
        f"CPython {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{statistics.median(loads):.1f} ({min(loads):.1f}-{max(loads):.1f} over the run); "
        f"{args.reps} alternating repetitions, medians (min-max)."
    )
    print()
    print(
        "| pool | start to first result | floor (create, all Running, exec true "
        "into each) | ratio | ratio per repetition (median) | goal (1.5x floor + 0.5 s) | |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print(
        "CPU seconds per start (every lab process, the pods' and kubectl's included; "
        "unlike wall time, load does not change it much): "
        + "; ".join(
            f"{nodes} pods: {statistics.median(cpu[('flotilla', nodes)]):.2f} "
            f"against the floor's {statistics.median(cpu[('floor', nodes)]):.2f}"
            for nodes in (3, 8)
        )
    )
    print()
    print(
        f"8 pods / 3 pods: {s8 / s3:.2f}x (goal <= 1.3x: {'met' if s8 <= 1.3 * s3 else 'MISSED'}); "
        f"the floor's: {f8 / f3:.2f}x"
    )
    print()
    print(
        "Every pool's pods are new containers: each pod gets one `kubectl exec` as soon as it "
        "runs, receives the client's flotilla over it and starts one Python process (it "
        "checks the interpreter, unpacks the bundle and becomes the agent), which forks the "
        "executor; the floor starts none. On 2 CPUs shared by 8 pods and the control plane, "
        "that work adds up."
    )


if __name__ == "__main__":
    main()
