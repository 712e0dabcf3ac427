"""``--json`` of every reporting command: one JSON document on stdout carrying the fields
docs/command-line.md lists for it (read from its table, so the docs and the output cannot
drift apart). A real 2-node local cluster, a real managed job; ``show-gpus`` on the Vast
stand-in (root only)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from _vast import VastLab, vast_lab_fixture  # noqa: F401 - the vast_lab fixture
from test_cli import CLI
from test_cli import cli as cli  # the fixture

DOC = Path(__file__).resolve().parents[1] / "docs" / "command-line.md"


def documented() -> dict[str, tuple[str, list[str]]]:
    """The ``--json`` table of docs/command-line.md: each command (its words before the first
    flag or placeholder, e.g. ``jobs queue``) -> (its document's shape, an entry's fields)."""
    text = DOC.read_text()
    table = text.split("## Machine-readable output: `--json`", 1)[1]
    rows: dict[str, tuple[str, list[str]]] = {}
    for line in table.splitlines():
        m = re.match(r"\| `flotilla ([^`]*)` \| ([^|]*) \| ([^|]*) \|$", line)
        if m:
            words: list[str] = []
            for word in m[1].split():  # up to the first flag or placeholder
                if word.startswith(("-", "[")) or word.isupper():
                    break
                words.append(word)
            rows[" ".join(words)] = (m[2].strip(), re.findall(r"`(\w+)`", m[3]))
    return rows


def entries(command: str, document: Any) -> list[dict[str, Any]]:
    """The entries of ``command``'s document (its one list, as the table's shape says)."""
    shape, _ = documented()[command]
    key = re.search(r'"(\w+)": \[', shape)
    assert key is not None, shape
    listed = document[key[1]]
    assert isinstance(listed, list), document
    return listed


def carries(command: str, document: Any) -> list[dict[str, Any]]:
    """Assert every entry of ``document`` has the fields documented for ``command``."""
    _, fields = documented()[command]
    found = entries(command, document)
    assert found, f"{command} --json listed nothing: {document}"
    for entry in found:
        missing = [f for f in fields if f not in entry]
        assert missing == [], f"{command} --json lacks {missing}: {entry}"
    return found


def test_the_docs_list_every_reporting_command() -> None:
    assert set(documented()) == {
        "status",
        "queue",
        "jobs queue",
        "show-gpus",
        "cost-report",
        "check",
        "top",
        "events",
    }


def test_every_reporting_command_prints_its_documented_json(cli: CLI) -> None:
    cli.ok("launch", "-c", "js", "--nodes", "2", "echo hello from $FLOTILLA_NODE_RANK")

    status = carries("status", json.loads(cli.ok("status", "--json").stdout))
    assert [(c["name"], c["state"], c["num_nodes"]) for c in status] == [("js", "UP", 2)]
    named = json.loads(cli.ok("status", "js", "nope", "--json").stdout)["clusters"]
    assert [(c["name"], c["state"]) for c in named] == [("js", "UP"), ("nope", "MISSING")]

    queue = json.loads(cli.ok("queue", "js", "--json").stdout)
    assert queue["cluster"] == "js"
    (job,) = carries("queue", queue)
    assert (job["id"], job["status"], job["exit_code"]) == (1, "SUCCEEDED", 0)

    top = carries("top", json.loads(cli.ok("top", "js", "--json").stdout))
    assert top[0]["cluster"] == "js" and len(top[0]["nodes"]) == 2

    lines = cli.ok("events", "js", "--json").stdout.splitlines()
    events = [json.loads(line) for line in lines]
    _, fields = documented()["events"]
    assert events and all(set(fields) <= set(e) for e in events), events
    assert "NodeReady" in {e["type"] for e in events}

    checked = carries("check", json.loads(cli.ok("check", "--json").stdout))
    local = [p for p in checked if p["provider"] == "local"]
    assert local and local[0]["usable"] is True, checked

    cli.ok("down", "js", "-y")
    costs = json.loads(cli.ok("cost-report", "--json").stdout)
    (run,) = carries("cost-report", costs)
    assert (run["cluster"], run["nodes"], run["finished"]) == ("js", 2, True), run
    assert costs["total"] == 0.0  # the local provider has no price

    task = cli.task("managed.yaml", "name: managed\nrun: echo managed says hi\n")
    cli.ok("jobs", "launch", task, timeout=180)  # waits for its end
    (managed,) = carries("jobs queue", json.loads(cli.ok("jobs", "queue", "--json").stdout))
    assert (managed["id"], managed["name"], managed["state"]) == (1, "managed", "SUCCEEDED")
    assert managed["token"] in ("", "***"), managed  # never the token itself


def test_show_gpus_json_lists_the_offers(cli: CLI, vast_lab: VastLab) -> None:
    vast_lab.add_machines(1, gpu_name="H100 SXM", num_gpus=8, dph_total=20.0, geolocation="SE")
    cli.env.update(vast_lab.env)
    shown = json.loads(cli.ok("show-gpus", "H100:8", "--provider", "vast", "--json").stdout)
    (offer,) = carries("show-gpus", shown)
    assert (offer["provider"], offer["count"], offer["hourly"]) == ("vast", 8, 20.0), offer
    assert offer["region"] == "SE" and offer["accelerator"].startswith("H100")
