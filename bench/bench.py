"""flotilla against Ray, Dask, multiprocessing and raw pipes, in one run.

Run it as ``./dev bench`` (bench/run.sh installs the peers into .venv-bench first). Every
trial runs in a fresh child process (``bench/trial.py``); this script orders the trials,
keeps the raw results as JSON and rewrites its sections of BENCHMARKS.md (``sections``:
the others stay).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import report
import sections

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TRIAL = BENCH / "trial.py"

COLD = ("flotilla", "Ray", "Dask", "multiprocessing", "torchrun")
WARM = (
    "raw pipes (floor)",
    "raw pipes, pinned to 2 CPUs",
    "raw pipes, relayed like flotilla",
    "flotilla",
    "multiprocessing",
)
WARM_PEERS = ("Dask", "Ray")  # the heavy ones last, so that they cannot slow the others
LIBRARIES = ("flotilla", "ray", "dask", "distributed", "numpy", "cloudpickle", "torch")
TIMEOUT = {"cold": 120.0, "warm": 300.0}  # seconds a child may take


def main() -> None:
    args = _parse()
    started = time.monotonic()
    meta = _meta()
    meta["quick"] = args.quick
    cold_systems = [name for name in COLD if name in args.systems]
    if "torchrun" in cold_systems and not _torch_available():
        cold_systems.remove("torchrun")
        meta["skipped"] = {"torchrun": "not measured (torch not installed)"}
    cpu_before = _cpu_seconds()
    results: dict[str, Any] = {"meta": meta}
    results["cold"] = run_cold(cold_systems, args.trials, args.quick)
    warm_systems = [name for name in (*WARM, *WARM_PEERS) if name in args.systems]
    results["warm"] = {name: run_child("warm", name, args.quick) for name in warm_systems}
    meta["duration"] = time.monotonic() - started
    meta["other_cpu"] = _other_cpu_share(cpu_before, _cpu_seconds(), meta["duration"])
    _save(results, args.results)
    text = report.render(results)
    if args.markdown is not None:  # its sections, and the ones this run does not produce
        sections.merge_file(args.markdown, text)
        _log(f"wrote {args.markdown}")
    else:
        print(text)


def run_cold(systems: list[str], trials: int, quick: bool) -> dict[str, Any]:
    """``trials`` cold starts per system, interleaved, after one untimed start each."""
    out: dict[str, Any] = {name: {"trials": [], "errors": []} for name in systems}
    for round_ in range(trials + 1):
        for name in systems:
            result = run_child("cold", name, quick)
            if "error" in result:
                out[name]["errors"].append(result)
            elif round_ > 0:  # round 0 fills the page cache
                out[name]["trials"].append(result)
    return out


def run_child(mode: str, system: str, quick: bool) -> dict[str, Any]:
    """Run one trial in a fresh process; its JSON result, or {"error": ...}."""
    _log(f"{mode} {system}")
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(TRIAL), mode, system, str(out)]
        try:
            proc = subprocess.run(
                [*command, *(["--quick"] if quick else [])],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=TIMEOUT[mode],
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {TIMEOUT[mode]:.0f} s"}
        if proc.returncode != 0 or not out.exists():
            tail = proc.stderr.decode(errors="replace").strip().splitlines()[-3:]
            _log(f"  failed ({proc.returncode}): " + " / ".join(tail))
            return {"error": tail[-1] if tail else f"exit status {proc.returncode}"}
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _torch_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    check = [sys.executable, "-c", "import torch.distributed"]
    return subprocess.run(check, capture_output=True, check=False).returncode == 0


def _meta() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        "tree": " (with uncommitted changes in src/)"
        if _git("status", "--porcelain", "src")
        else "",
        "load": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": _versions(),
    }


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process tree)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle, iowait
    machine = (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    return machine, own


def _other_cpu_share(before: tuple[float, float], after: tuple[float, float], wall: float) -> float:
    """Share of the machine's CPU time that processes outside the benchmark used."""
    other = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, other / (wall * (os.cpu_count() or 1)))


def _versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _save(results: dict[str, Any], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = folder / f"bench-{stamp}.json"
    path.write_text(json.dumps(results, indent=1))
    (folder / "latest.json").write_text(path.read_text())
    _log(f"wrote {path}")


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--markdown", type=Path, help="write the report here (default: print)")
    parser.add_argument("--results", type=Path, default=BENCH / "results", help="raw JSON folder")
    parser.add_argument("--trials", type=int, help="cold starts per system (default 7, quick 2)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="few samples, a smoke run; its report goes to the results folder instead",
    )
    names = sorted({*COLD, *WARM, *WARM_PEERS})
    parser.add_argument(
        "--systems", nargs="+", default=names, choices=names, help="only these systems"
    )
    args = parser.parse_args()
    if args.trials is None:
        args.trials = 2 if args.quick else 7
    if args.quick and args.markdown is not None:
        args.markdown = args.results / "BENCHMARKS-quick.md"
    return args


if __name__ == "__main__":
    main()
