"""Command-line speed: ``flotilla exec`` on a running cluster, ``flotilla launch`` from nothing.

Standalone: ``python bench/bench_cli.py [--reps 7]``. Every measurement is the wall time of
a real command (a fresh ``python -m flotilla`` process), repeated; the table shows medians
against the goals of issue 5:

- ``flotilla exec`` of a trivial command on a running 4-node local cluster: <= 0.3 s.
- ``flotilla launch`` of a 4-node trivial task from nothing (no setup): <= 2x the same 4
  processes started by a plain shell loop, plus 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TASK = "name: bench\nnum_nodes: 4\nrun: echo hello\n"
SHELL_LOOP = 'for i in 0 1 2 3; do bash -c "echo hello" & done; wait'


def timed(
    fn: Callable[[], None], reps: int, before: Callable[[], None] | None = None
) -> list[float]:
    """Wall times of ``reps`` calls of ``fn`` (``before`` runs untimed before each)."""
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    reps = args.reps

    with tempfile.TemporaryDirectory(prefix="flotilla-bench-cli-") as tmp:
        home = Path(tmp) / "home"
        task = Path(tmp) / "task.yaml"
        task.write_text(TASK)
        env = dict(os.environ, FLOTILLA_HOME=str(home))
        env.pop("COMPUTE_POOL", None)

        def flotilla(*argv: str) -> None:
            subprocess.run(
                [sys.executable, "-m", "flotilla", *argv],
                env=env,
                cwd=tmp,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

        def shell_loop() -> None:
            subprocess.run(["bash", "-c", SHELL_LOOP], check=True, stdout=subprocess.DEVNULL)

        counter = iter(range(1_000_000))
        names: list[str] = []

        def launch_named() -> None:
            name = f"bench{next(counter)}"
            names.append(name)
            flotilla("launch", str(task), "-c", name)

        def down_previous() -> None:
            while names:
                flotilla("down", names.pop())

        results: list[tuple[str, list[float], str, float | None]] = []
        baseline = timed(shell_loop, reps)
        results.append(("4 x `bash -c 'echo hello'` in a shell loop", baseline, "", None))
        launch_goal = 2 * statistics.median(baseline) + 0.5
        down = timed(lambda: flotilla("launch", str(task), "--down"), reps)
        results.append(
            (
                "`flotilla launch` 4 nodes from nothing, `--down`",
                down,
                "<= 2x loop + 0.5 s",
                launch_goal,
            )
        )
        named = timed(launch_named, reps, before=down_previous)
        down_previous()
        results.append(
            (
                "`flotilla launch -c NAME` 4 nodes from nothing",
                named,
                "<= 2x loop + 0.5 s",
                launch_goal,
            )
        )

        flotilla("launch", str(task), "-c", "warm")
        try:
            execs = timed(lambda: flotilla("exec", "warm", "echo hello"), reps)
            results.append(("`flotilla exec` on a running 4-node cluster", execs, "<= 0.3 s", 0.3))
            status = timed(lambda: flotilla("status"), reps)
            results.append(("`flotilla status`", status, "", None))
        finally:
            flotilla("down", "warm")

    cpus = os.cpu_count()
    print(f"Command-line speed ({reps} runs each, wall time of a fresh process; {cpus} CPUs)\n")
    print("| command | median | min | max | goal | met |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for label, times, goal_text, goal in results:
        med = statistics.median(times)
        met = "" if goal is None else ("yes" if med <= goal else "**no**")
        goal_cell = f"{goal_text} ({goal:.2f} s)" if goal is not None else goal_text
        print(
            f"| {label} | {med:.3f} s | {min(times):.3f} s | {max(times):.3f} s "
            f"| {goal_cell} | {met} |"
        )


if __name__ == "__main__":
    main()
