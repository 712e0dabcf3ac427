"""The resource-aware job queue's overhead: a no-op job submitted to a running 2-node local
cluster and followed to its end, through the queue (``--cpus 1``: a job that shares its
nodes), against ``flotilla exec`` as it was before the queue (``--baseline SRC``: another
checkout's ``src``, e.g. ``git archive`` of the commit before), in the same run.

Standalone: ``python bench/bench_queue.py --baseline /tmp/old/src [--reps 15]``. Each
measurement is the wall time of a real command (a fresh ``python -m flotilla`` process);
the clusters of both trees are up at once and their commands alternate, so that the
machine's load falls on both alike. The ratio is of medians: queue / baseline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--baseline", help="the src folder of flotilla before the queue")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="flotilla-bench-queue-") as tmp:
        trees = {"queue": SRC}
        if args.baseline:
            trees["baseline"] = str(Path(args.baseline).resolve())

        def flotilla(tree: str, *argv: str) -> float:
            env = dict(os.environ, FLOTILLA_HOME=str(Path(tmp) / tree), PYTHONPATH=trees[tree])
            env.pop("COMPUTE_POOL", None)
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "flotilla", *argv],
                env=env,
                cwd=tmp,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            return time.perf_counter() - t0

        for tree in trees:
            flotilla(tree, "launch", "true", "-c", "q", "--nodes", "2")
        times: dict[str, list[float]] = {
            "`exec q true` (holds its nodes whole)": [],
            "`exec q --cpus 1 true` (shares its nodes)": [],
        }
        if "baseline" in trees:
            times["baseline `exec q true` (one job at a time)"] = []
        try:
            for _ in range(args.reps):  # alternate: the same load on each
                times["`exec q true` (holds its nodes whole)"].append(
                    flotilla("queue", "exec", "q", "true")
                )
                times["`exec q --cpus 1 true` (shares its nodes)"].append(
                    flotilla("queue", "exec", "q", "--cpus", "1", "true")
                )
                if "baseline" in trees:
                    times["baseline `exec q true` (one job at a time)"].append(
                        flotilla("baseline", "exec", "q", "true")
                    )
        finally:
            for tree in trees:
                flotilla(tree, "down", "q")

    cpus = os.cpu_count()
    print(
        f"No-op job on a running 2-node local cluster ({args.reps} runs each, wall time of "
        f"a fresh process, alternating; {cpus} CPUs)\n"
    )
    print("| command | median | min | max | / baseline |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = times.get("baseline `exec q true` (one job at a time)")
    for label, ts in times.items():
        med = statistics.median(ts)
        ratio = f"{med / statistics.median(base):.2f}" if base else ""
        print(f"| {label} | {med:.3f} s | {min(ts):.3f} s | {max(ts):.3f} s | {ratio} |")


if __name__ == "__main__":
    main()
