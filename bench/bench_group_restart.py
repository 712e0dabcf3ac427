"""A torch process group restarted after a rank raised, against torchrun's ``--max-restarts``.

    .venv/bin/python bench/bench_group_restart.py [--rounds 5] [--restarts 4] [--before SRC]

Both sides run 2 ranks of gloo on this machine (CPU torch), each round in fresh processes,
the systems one after the other (the order rotating between rounds):

- **flotilla** (``Compute(nodes=2, plugins=[plugins.torch()])``, local provider): once the
  group has formed (a first ``all_reduce``), each restart is a broadcast in which rank 1
  raises while rank 0 waits for it in an ``all_reduce``; the pool restarts both executor
  processes (a fresh group), then an ``all_reduce`` runs on both. Timed: from the call that
  raises to the ``all_reduce`` answered. ``--before SRC`` adds flotilla from another source
  folder (the code before a change) to every round.
- **torchrun** (``--standalone --nproc-per-node 2 --max-restarts N --monitor-interval
  0.1``): each attempt forms the group (on a store of its own: on torchrun's, a restarted
  attempt's gloo group waited for the last attempt's ranks) and all-reduces; in all but the last, rank 1 raises
  while rank 0 waits in an ``all_reduce``, and torchrun restarts both workers. Timed: from
  rank 1's raise (its clock, just before) to the next attempt's ``all_reduce`` done on both.

Progress goes to stderr; stdout gets a markdown table: each system's median restart per
round, the same-round ratio to torchrun, and the load (``/proc/loadavg``) before each round.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ddp_spawn import free_port  # noqa: E402  (the stores' first port)

SRC = HERE.parent / "src"

FLOTILLA = """\
import json, sys, time
import flotilla as sky


@sky.function
def all_reduce():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@sky.function
def rank_1_raises():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("a broken batch")
    dist.all_reduce(torch.ones(1))  # waits for rank 1: only the restart ends it


with sky.Compute(nodes=2, plugins=[sky.plugins.torch()]) as pool:
    assert all_reduce() @ pool == [2.0, 2.0]
    times = []
    for _ in range(int(sys.argv[1])):
        start = time.perf_counter()
        try:
            rank_1_raises() @ pool
        except ValueError:
            pass
        else:
            raise SystemExit("rank 1 did not raise")
        assert all_reduce() @ pool == [2.0, 2.0]
        times.append(time.perf_counter() - start)
print(json.dumps(times))
"""

TORCHRUN = """\
import os, sys, time
import torch
import torch.distributed as dist

out, restarts, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
# a store of the attempt's own: on torchrun's store, a restarted attempt's gloo group
# waited for the addresses of the last attempt's ranks (torch 2.13, --standalone)
store = dist.TCPStore("127.0.0.1", port + attempt, 2, rank == 0)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
t = torch.ones(1)
dist.all_reduce(t)
with open(f"{out}/done-{rank}", "a") as f:
    f.write(f"{attempt} {time.time()}\\n")
if attempt < restarts:
    if rank == 1:
        with open(f"{out}/raised", "a") as f:
            f.write(f"{attempt} {time.time()}\\n")
        raise ValueError("a broken batch")
    dist.all_reduce(t)  # waits for rank 1: only the restart ends it
dist.destroy_process_group()
"""


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def flotilla_restarts(src: Path, restarts: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(src))
    env.pop("COMPUTE_POOL", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-c", FLOTILLA, str(restarts)],
            env=env,
            cwd=tmp,
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
        ).stdout
    times: list[float] = json.loads(out.strip().splitlines()[-1])
    return times


def torchrun_restarts(restarts: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(TORCHRUN)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc-per-node", "2", "--max-restarts", str(restarts)]
        argv += ["--monitor-interval", "0.1", str(script), tmp, str(restarts), str(free_port())]
        subprocess.run(argv, cwd=tmp, check=True, capture_output=True, timeout=600)
        raised = dict(line.split() for line in Path(tmp, "raised").read_text().splitlines())
        done: dict[str, list[float]] = {}
        for rank in (0, 1):
            for line in Path(tmp, f"done-{rank}").read_text().splitlines():
                attempt, when = line.split()
                done.setdefault(attempt, []).append(float(when))
    return [max(done[str(int(a) + 1)]) - float(t) for a, t in sorted(raised.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--restarts", type=int, default=4, help="restarts timed per round")
    parser.add_argument("--before", type=Path, help="flotilla's source folder before a change")
    args = parser.parse_args()
    systems: list[tuple[str, object]] = [("flotilla", SRC)]
    if args.before:
        systems.append(("flotilla before", args.before))
    systems.append(("torchrun", None))
    rows = []
    for r in range(args.rounds):
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        medians: dict[str, float] = {}
        at = load()
        for name, src in order:
            if isinstance(src, Path):
                times = flotilla_restarts(src, args.restarts)
            else:
                times = torchrun_restarts(args.restarts)
            medians[name] = statistics.median(times)
            print(f"round {r + 1} {name}: {[round(t, 3) for t in times]}", file=sys.stderr)
        rows.append((at, medians))
    names = [name for name, _ in systems]
    print("| round | load | " + " | ".join(f"{n} (s)" for n in names) + " | flotilla / torchrun |")
    print("| --- | --- |" + " --- |" * len(names) + " --- |")
    for i, (at, m) in enumerate(rows, 1):
        cells = " | ".join(f"{m[n]:.2f}" for n in names)
        print(f"| {i} | {at} | {cells} | {m['flotilla'] / m['torchrun']:.2f}x |")
    ratios = sorted(m["flotilla"] / m["torchrun"] for _, m in rows)
    flotilla = statistics.median(m["flotilla"] for _, m in rows)
    torchrun = statistics.median(m["torchrun"] for _, m in rows)
    print(
        f"\nMedian over {len(rows)} rounds: flotilla {flotilla:.2f} s, torchrun {torchrun:.2f} s"
        f" per restart; flotilla / torchrun {statistics.median(ratios):.2f}x"
        f" ({ratios[0]:.2f}-{ratios[-1]:.2f})."
    )
    if args.before:
        before = sorted(m["flotilla"] / m["flotilla before"] for _, m in rows)
        print(
            f"flotilla / flotilla before: {statistics.median(before):.2f}x "
            f"({before[0]:.2f}-{before[-1]:.2f})."
        )


if __name__ == "__main__":
    main()
