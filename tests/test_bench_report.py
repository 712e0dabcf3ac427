"""``./dev bench`` rewrites the sections of BENCHMARKS.md its run produces and keeps every
other one: the figures a session wrote for an issue survive a full rerun (issue 42, item 5).

``bench/bench.py`` and ``bench/run.sh`` write the report through ``bench/sections.py``; these
tests give it the committed BENCHMARKS.md and what a run writes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import sections  # noqa: E402

RUN = """# flotilla benchmarks

* Run: tomorrow, a new commit.

## flotilla's goals

| metric | goal | flotilla (median) | result |
| --- | --- | ---: | --- |
| Cold start | <= 0.25 s | 0.199 s | **PASS** |

## Cold start

NEW COLD START TABLE

## How the numbers are taken

NEW METHOD
"""
"""What ``bench/bench.py`` writes: its preamble and its own sections."""

APPENDED = """
## Command line (issue 5)

NEW CLI TABLE

## A benchmark added later (issue 99)

NEW SECTION

<!-- bench: nodestart -->
NEW NODE START TABLE
<!-- /bench: nodestart -->
<!-- bench: wait -->
NEW WAIT TABLE
<!-- /bench: wait -->
"""
"""What ``bench/run.sh`` then writes for the other issues' benchmarks."""


def headings(text: str) -> list[str]:
    return re.findall(r"^## (.*)$", text, flags=re.M)


def test_a_full_rerun_keeps_the_sections_written_for_an_issue(tmp_path: Path) -> None:
    committed = (ROOT / "BENCHMARKS.md").read_text()
    report = tmp_path / "BENCHMARKS.md"
    report.write_text(committed)
    sections.merge_file(report, RUN)
    sections.merge_file(report, APPENDED)
    text = report.read_text()
    before, after = headings(committed), headings(text)
    # every section is still there, once, in its order; the new one comes last
    assert after == [*before, "A benchmark added later (issue 99)"]
    hand_written = [h for h in before if "(issue 42)" in h]
    assert hand_written, "the committed report has a section written by hand for issue 42"
    for head in hand_written:  # kept word for word, but for the blocks the run refilled
        old_words = sections._BLOCK.split(dict(sections.split(committed)[1])[head])
        new_words = sections._BLOCK.split(dict(sections.split(text)[1])[head])
        assert old_words[::3] == new_words[::3] and len(old_words) > 1
    issue = dict(sections.split(text)[1])["Lighter nodes (issue 42)"]
    assert "NEW NODE START TABLE" in issue and "NEW WAIT TABLE" in issue
    assert text.count("NEW WAIT TABLE") == 1
    # what the run produced replaced the old text, and nothing else did
    produced = dict(sections.split(text)[1])
    assert produced["Cold start"].strip() == "## Cold start\n\nNEW COLD START TABLE"
    cli = produced["Command line (issue 5)"]
    assert cli.strip() == "## Command line (issue 5)\n\nNEW CLI TABLE"
    assert text.startswith("# flotilla benchmarks\n\n* Run: tomorrow")


def test_a_heading_inside_a_code_block_is_not_a_section() -> None:
    text = "intro\n\n## A\n\n```\n## not a heading\n```\n\n## B\n\nb\n"
    pre, parts = sections.split(text)
    assert pre == "intro\n\n" and [h for h, _ in parts] == ["A", "B"]
    assert sections.merge(text, "## B\n\nnew b\n") == (
        "intro\n\n## A\n\n```\n## not a heading\n```\n\n## B\n\nnew b\n\n"
    )


def test_a_run_refills_the_blocks_inside_a_hand_written_section() -> None:
    old = (
        "# report\n\n## Lighter nodes (issue 42)\n\nWords written by hand.\n\n"
        "<!-- bench: wait -->\nTHE OLD TABLE\n<!-- /bench: wait -->\n\nMore words.\n\n"
        "## Cold start\n\nOLD COLD START\n"
    )
    new = (
        "## Cold start\n\nNEW COLD START\n\n"
        "<!-- bench: wait -->\nTHE NEW TABLE\n<!-- /bench: wait -->\n"
        "<!-- bench: later -->\nA BLOCK WITH NO PLACE YET\n<!-- /bench: later -->\n"
    )
    merged = sections.merge(old, new)
    pre, parts = sections.split(merged)
    assert pre == "# report\n\n"  # a run's blocks are not its preamble
    issue = dict(parts)["Lighter nodes (issue 42)"]
    assert issue == (
        "## Lighter nodes (issue 42)\n\nWords written by hand.\n\n"
        "<!-- bench: wait -->\nTHE NEW TABLE\n<!-- /bench: wait -->\n\nMore words.\n\n"
    )
    assert "THE OLD TABLE" not in merged and merged.count("THE NEW TABLE") == 1
    assert "NEW COLD START" in dict(parts)["Cold start"]
    # a block the report has no markers for is kept, markers and all, at its end
    assert merged.endswith(
        "<!-- bench: later -->\nA BLOCK WITH NO PLACE YET\n<!-- /bench: later -->\n"
    )
    # and the next run finds it there
    again = sections.merge(merged, "<!-- bench: later -->\nNEWER\n<!-- /bench: later -->\n")
    assert "A BLOCK WITH NO PLACE YET" not in again and again.count("NEWER") == 1
