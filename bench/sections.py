"""Rewrite BENCHMARKS.md's sections a run produced, keep every other one (issue 42, item 5).

A markdown report is a preamble and ``## `` sections (each with its ``###`` parts). A run
(``bench/bench.py``, then the other benchmarks ``bench/run.sh`` appends) produces some of
them; the sessions that worked on an issue wrote others by hand (before/after figures,
the load they were taken under). :func:`merge` keeps those: a section of the new text
replaces the old one of the same heading, where it was; an old section the run did not
produce stays, after the section it followed; a new heading goes where the run put it.

A hand-written section can hold a table the run refreshes: a block between the lines
``<!-- bench: NAME -->`` and ``<!-- /bench: NAME -->``. A run that writes a block of that
name (anywhere in its text, markers included) refills it there, and leaves the words
around it as they were; a block the report has no place for is added at its end.

    python bench/sections.py REPORT NEW   # merge the file NEW into REPORT, in place
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_BLOCK = re.compile(
    r"^<!-- bench: (?P<name>[\w.-]+) -->\n(?P<body>.*?)^<!-- /bench: (?P=name) -->\n?",
    re.M | re.S,
)
"""A block a run refills (see the module docstring), its two marker lines included."""


def split(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(preamble, [(heading, section text)]) of a markdown text; a ``## `` line inside a
    fenced code block is not a heading."""
    preamble: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    fenced = False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            sections.append((line[3:].strip(), [line]))
        elif sections:
            sections[-1][1].append(line)
        else:
            preamble.append(line)
    return "".join(preamble), [(head, "".join(lines)) for head, lines in sections]


def merge(old: str, new: str) -> str:
    """``new``'s sections, in its order, with ``old``'s other sections kept (each after
    the section it followed in ``old``); ``new``'s preamble unless it is blank; then
    ``new``'s blocks put in the place of ``old``'s blocks of the same name."""
    blocks = {m["name"]: m[0].rstrip("\n") + "\n" for m in _BLOCK.finditer(new)}
    new = _BLOCK.sub("", new)
    old_pre, old_sections = split(old)
    new_pre, new_sections = split(new)
    produced = {head for head, _ in new_sections}
    out = list(new_sections)
    after: str | None = None  # the old heading the next kept section follows
    for head, text in old_sections:
        if head not in produced:
            at = 0 if after is None else 1 + [h for h, _ in out].index(after)
            out.insert(at, (head, text))
        after = head
    body = "".join(_ended(text) for _, text in out)
    text = (new_pre if new_pre.strip() else old_pre) + body

    def refill(m: re.Match[str]) -> str:
        return blocks.pop(m["name"], m[0])

    text = _BLOCK.sub(refill, text)
    return text + "".join(f"\n{block}" for block in blocks.values())


def _ended(text: str) -> str:
    """A section that ends with a blank line (so that the next heading stands apart)."""
    text = text.rstrip("\n") + "\n"
    return text + "\n"


def merge_file(report: Path, new: str) -> None:
    """Merge ``new`` into the file ``report`` (created when missing)."""
    old = report.read_text() if report.exists() else ""
    report.write_text(merge(old, new).rstrip("\n") + "\n")


if __name__ == "__main__":
    merge_file(Path(sys.argv[1]), Path(sys.argv[2]).read_text())
