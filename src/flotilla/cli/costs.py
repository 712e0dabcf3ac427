"""What clusters cost: a ledger of when each cluster's pool ran and at what price, and
``flotilla cost-report``.

A cluster's daemon appends one line (JSON) to ``~/.flotilla/costs.jsonl`` when its pool is
up (the provider, the node count, the price per hour of the offers it chose, when known)
and one when the pool is closed. The report joins them: each cluster's running time x its
price. A pool still running is counted up to now; a pool whose daemon was killed (no
"down" line) is shown as such.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .state import flotilla_home

LEDGER = "costs.jsonl"


def ledger(home: Path | None = None) -> Path:
    return (home or flotilla_home()) / LEDGER


def record(
    event: str, cluster: str, generation: int, home: Path | None = None, **fields: Any
) -> None:
    """Append one ledger line (best effort: a cost ledger never stops a cluster)."""
    line = {"event": event, "cluster": cluster, "generation": generation, "time": time.time()}
    line.update(fields)
    try:
        path = ledger(home)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    except OSError:
        pass


def runs(home: Path | None = None, now: float | None = None) -> list[dict[str, Any]]:
    """Each pool that ran, oldest first: ``cluster``, ``provider``, ``nodes``, ``hourly``
    ($/hour of the whole pool; None: unknown), ``hours``, ``cost`` (None: unknown) and
    ``finished`` (False: still running, or its daemon was killed)."""
    now = time.time() if now is None else now
    found: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        lines = ledger(home).read_text().splitlines()
    except OSError:
        lines = []
    for text in lines:
        try:
            line = json.loads(text)
            key = (str(line["cluster"]), int(line["generation"]))
        except (ValueError, KeyError, TypeError):
            continue
        if line.get("event") == "up":
            found[key] = dict(line)
        elif line.get("event") == "down" and key in found:
            found[key]["end"] = float(line["time"])
    out = []
    for (cluster, _), run in sorted(found.items(), key=lambda kv: kv[1]["time"]):
        end = run.get("end")
        hours = ((end if end is not None else now) - float(run["time"])) / 3600
        hourly = run.get("hourly")
        if not (isinstance(hourly, int | float) and hourly):
            hourly = None
        out.append(
            {
                "cluster": cluster,
                "provider": str(run.get("provider", "")),
                "nodes": run.get("nodes"),
                "hourly": hourly,
                "hours": hours,
                "cost": hourly * hours if hourly is not None else None,
                "finished": end is not None,
            }
        )
    return out


def report(home: Path | None = None, now: float | None = None) -> list[list[str]]:
    """The report's rows (a header first): cluster, provider, nodes, $/h, hours, cost."""
    rows = [["CLUSTER", "PROVIDER", "NODES", "$/HOUR", "HOURS", "COST", "STATE"]]
    total = 0.0
    for run in runs(home, now):
        hourly, cost = run["hourly"], run["cost"]
        total += cost or 0.0
        rows.append(
            [
                run["cluster"],
                run["provider"],
                "" if run["nodes"] is None else str(run["nodes"]),
                f"{hourly:.4g}" if hourly is not None else "unknown",
                f"{run['hours']:.3f}",
                f"${cost:.2f}" if cost is not None else "unknown",
                "finished" if run["finished"] else "running (or its daemon was killed)",
            ]
        )
    rows.append(["total", "", "", "", "", f"${total:.2f}", ""])
    return rows
