"""A 4-node local cold start against multiprocessing's, same rounds (issue 42, item 4).

    .venv/bin/python bench/bench_coldstart.py [--rounds 5] [--before [NAME=]SRC ...]

Each round runs ``bench/trial.py cold SYSTEM`` (start -> the first no-op answered on 4
workers, then the teardown; the library imported before the clock) in a fresh process for
flotilla (this checkout's ``src``, and every ``--before`` source folder, e.g. ``git
archive`` of main, extracted) and for multiprocessing (spawn ``Pool(4)`` + ``map``), in
an order that rotates from round to round, after one untimed round. Per trial: the time to
the first result and the CPU of the whole process tree (``wait4``'s rusage: the trial
and every descendant reaped below it, imports and teardown included). Prints each round
on stderr and, on stdout, a markdown table: medians (min-max) and the per-round ratios to
multiprocessing's trial of the same round, with the load (``/proc/loadavg``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
MP = "multiprocessing"


def trial(system: str, src: Path | None) -> dict[str, Any]:
    """One cold trial in a fresh process: its laps and the CPU of its process tree."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    with tempfile.TemporaryDirectory(prefix="flotilla-cold-") as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "trial.py"), "cold", system, str(out)],
            cwd=HERE.parent,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert proc.stderr is not None
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode or not out.exists():
            raise SystemExit(f"bench_coldstart: {system} failed:\n{err.decode()[-3000:]}")
        laps: dict[str, Any] = json.loads(out.read_text())
    return {**laps, "cpu": usage.ru_utime + usage.ru_stime}


def load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", action="append", default=[], metavar="[NAME=]SRC")
    args = parser.parse_args()
    variants: list[tuple[str, str, Path | None]] = [("flotilla", "flotilla", SRC)]
    for before in args.before:
        name, _, src = before.rpartition("=")
        variants.append((f"flotilla {name or 'before'}", "flotilla", Path(src)))
    variants.append((MP, MP, None))
    rounds: list[dict[str, dict[str, Any]]] = []
    loads: list[float] = []
    for round_ in range(args.rounds + 1):
        shift = round_ % len(variants)
        got = {
            name: trial(system, src) for name, system, src in variants[shift:] + variants[:shift]
        }
        if round_ == 0:
            continue  # the page cache, the compiled node code
        rounds.append(got)
        loads.append(load())
        print(
            f"round {round_}: "
            + "; ".join(
                f"{name} {r['first'] * 1e3:.0f} ms ({r['first'] / got[MP]['first']:.2f}x), "
                f"CPU {r['cpu'] * 1e3:.0f} ms"
                for name, r in got.items()
            )
            + f"; load {loads[-1]:.1f}",
            file=sys.stderr,
            flush=True,
        )

    def spread(values: list[float], unit: float = 1e3, fmt: str = ".0f") -> str:
        median = statistics.median(values) * unit
        return f"{median:{fmt}} ({min(values) * unit:{fmt}}-{max(values) * unit:{fmt}})"

    print()
    print(
        "| flotilla | start -> first result, ms | ratio to spawn `Pool(4)`, same round | "
        "CPU of the tree, ms | CPU ratio | load (1 min) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, _, _ in variants:
        firsts = [r[name]["first"] for r in rounds]
        cpus = [r[name]["cpu"] for r in rounds]
        ratios = [r[name]["first"] / r[MP]["first"] for r in rounds]
        cpu_ratios = [r[name]["cpu"] / r[MP]["cpu"] for r in rounds]
        print(
            f"| {name} | {spread(firsts)} | {spread(ratios, 1, '.2f')}x | {spread(cpus)} | "
            f"{spread(cpu_ratios, 1, '.2f')}x | {min(loads):.1f}-{max(loads):.1f} |"
        )


if __name__ == "__main__":
    main()
