"""The code's shape (issue 35): no class of flotilla over ``MAX_CLASS_LINES`` lines; a class
that grows past it is split along its responsibilities (as ``Compute`` and ``Dispatcher``
were), not cut."""

from __future__ import annotations

import ast
from pathlib import Path

import flotilla

PACKAGE = Path(flotilla.__file__).parent
MAX_CLASS_LINES = 450

OVER_THE_LINE: dict[str, str] = {}
"""The classes still over the line, each with who splits it; an entry goes when its split
lands (the test below fails on an entry no longer over the line)."""


def _class_lengths() -> dict[str, int]:
    """Every class of the package (nested ones too) by dotted name: its lines, from its
    first decorator or ``class`` line to its last."""
    sizes: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("flotilla", *path.relative_to(PACKAGE).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                sizes[f"{module}.{node.name}"] = node.end_lineno - first + 1
    return sizes


def test_no_class_is_over_450_lines() -> None:
    sizes = _class_lengths()
    assert "flotilla._client.compute.Compute" in sizes  # (the walk finds the classes)
    over = {
        name: n for name, n in sizes.items() if n > MAX_CLASS_LINES and name not in OVER_THE_LINE
    }
    assert over == {}, (
        f"classes over {MAX_CLASS_LINES} lines: {over}; split them along their "
        "responsibilities (see docs/internals.md)"
    )


def test_the_list_of_classes_over_the_line_is_current() -> None:
    """An entry of ``OVER_THE_LINE`` whose class was split (or renamed) goes from the list,
    so that the class cannot grow back unnoticed."""
    sizes = _class_lengths()
    stale = [name for name in OVER_THE_LINE if sizes.get(name, 0) <= MAX_CLASS_LINES]
    assert stale == [], f"no longer over {MAX_CLASS_LINES} lines: remove {stale} from OVER_THE_LINE"
