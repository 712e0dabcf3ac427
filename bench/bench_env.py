"""Issue 4's benchmarks: DDP under flotilla against torchrun, and Image start-up costs.

Run: ``.venv/bin/python bench/bench_env.py [--reps 5]`` (torch must be installed in the
project venv: ``./dev test`` installs it). Prints markdown tables; medians over the reps.

* DDP, 2 local nodes x 1 process, small MLP, 100 steps: steady-state step time (median of
  the step intervals after 10 warm-up steps) and launch to first training step (from just
  before entering ``Compute`` / spawning torchrun to the end of the first step), flotilla
  with ``plugins.torch()`` against ``torchrun --nproc-per-node=2`` in the same run.
* Image: pool start (4 nodes, until ready) with no Image and with an Image already built
  on the nodes; and the first build of an Image with one small pure-Python package
  (``humanize``) in a fresh flotilla home with a fresh uv cache (downloads included).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp_loop import train
from stats import Summary

import flotilla as sky

HERE = Path(__file__).resolve().parent


def step_stats(stamps: list[float], launch: float) -> tuple[float, float]:
    """(steady step seconds, seconds from launch to the end of the first step)."""
    steps = [b - a for a, b in itertools.pairwise(stamps[10:])]
    return statistics.median(steps), stamps[0] - launch


def ddp_flotilla() -> tuple[float, float]:
    remote = sky.function(train)
    launch = time.time()
    with sky.Compute(nodes=2, plugins=[sky.plugins.torch()]) as pool:
        results = remote(100) @ pool
    return step_stats(results[0]["stamps"], launch)


def ddp_torchrun() -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        torchrun = Path(sys.executable).parent / "torchrun"
        cmd = [str(torchrun), "--nproc-per-node=2", str(HERE / "ddp_loop.py"), str(out)]
        launch = time.time()
        subprocess.run(
            cmd, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1")
        )
        return step_stats(json.loads(out.read_text())["stamps"], launch)


def pool_start(image: sky.Image | None) -> float:
    pool = sky.Compute(nodes=4, image=image)
    t0 = time.perf_counter()
    pool.open()
    took = time.perf_counter() - t0
    pool.close()
    return took


def first_build() -> float:
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as cache:
        os.environ["FLOTILLA_HOME"], os.environ["UV_CACHE_DIR"] = home, cache
        try:
            return pool_start(sky.Image(pip=["humanize"]))
        finally:
            del os.environ["FLOTILLA_HOME"], os.environ["UV_CACHE_DIR"]


def row(
    name: str, what: str, s: Summary, unit: str, base: float, goal: str, ok: bool | None
) -> str:
    scale, fmt = (1e3, "{:.2f} ms") if unit == "ms" else (1, "{:.3f} s")
    cells = [fmt.format(v * scale) for v in (s.median, s.p10, s.p90)]
    verdict = "" if ok is None else ("**PASS**" if ok else "**FAIL**")
    ratio = f"{s.median / base:.2f}×"
    return f"| {name} | {what} | {' | '.join(cells)} | {s.n} | {ratio} | {goal} | {verdict} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    reps = parser.parse_args().reps
    head = "| system | what | median | p10 | p90 | n | ÷ torchrun | goal | result |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"

    fl: list[tuple[float, float]] = []
    tr: list[tuple[float, float]] = []
    for _ in range(reps):  # interleaved, so both see the same load
        fl.append(ddp_flotilla())
        tr.append(ddp_torchrun())
    fl_step, tr_step = Summary.of([a for a, _ in fl]), Summary.of([a for a, _ in tr])
    fl_launch, tr_launch = Summary.of([b for _, b in fl]), Summary.of([b for _, b in tr])
    print("## DDP on 2 local nodes (small MLP, 100 steps, gloo)\n")
    print(head)
    ratio = fl_step.median / tr_step.median
    print(
        row(
            "flotilla",
            "steady step",
            fl_step,
            "ms",
            tr_step.median,
            "≤ 1.05× torchrun",
            ratio <= 1.05,
        )
    )
    print(row("torchrun", "steady step", tr_step, "ms", tr_step.median, "", None))
    print(
        row(
            "flotilla",
            "launch → first step",
            fl_launch,
            "s",
            tr_launch.median,
            "≤ 1.9 s",
            fl_launch.median <= 1.9,
        )
    )
    print(row("torchrun", "launch → first step", tr_launch, "s", tr_launch.median, "", None))

    image = sky.Image(env={"BENCH": "1"}, setup=["true"])
    pool_start(image)  # build it once
    plain, cached = [], []
    for _ in range(max(reps, 7)):
        plain.append(pool_start(None))
        cached.append(pool_start(image))
    p, c = Summary.of(plain), Summary.of(cached)
    build = Summary.of([first_build() for _ in range(3)])
    print("\n## Image start-up (4 local nodes)\n")
    print(
        "| what | median | p10 | p90 | n | goal | result |\n| --- | ---: | ---: | ---: | ---: | --- | --- |"
    )
    print(
        f"| pool start, no Image | {p.median:.3f} s | {p.p10:.3f} s | {p.p90:.3f} s | {p.n} |  |  |"
    )
    extra = c.median - p.median
    verdict = "**PASS**" if extra <= 0.1 else "**FAIL**"
    print(
        f"| pool start, Image already built | {c.median:.3f} s | {c.p10:.3f} s | {c.p90:.3f} s | {c.n} | ≤ +0.1 s (here {extra:+.3f} s) | {verdict} |"
    )
    verdict = "**PASS**" if build.median <= 3 else "**FAIL**"
    print(
        f"| pool start + first build of `Image(pip=['humanize'])` (fresh uv cache) | {build.median:.3f} s | {build.p10:.3f} s | {build.p90:.3f} s | {build.n} | ≤ 3 s | {verdict} |"
    )


if __name__ == "__main__":
    main()
