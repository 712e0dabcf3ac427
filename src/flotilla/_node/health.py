"""What a health check runs on the node (``flotilla.HealthChecker``; standard library
only): the user's predicate in a thread, with its timeout."""

from __future__ import annotations

import threading
from collections.abc import Callable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def probe(fn: Callable[[Any], Any], timeout: float) -> tuple[str, str | None]:
    """``("ok", None)``, or ``("fail", why)``: the predicate's reason, the exception it
    raised (``"ValueError: ..."``), or its timeout (its thread is left to finish)."""
    from .._info import instance_info

    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("value", fn(instance_info())))
        except BaseException as e:
            box.append(("error", f"{type(e).__name__}: {e}"))

    thread = threading.Thread(target=run, name="flotilla-health-check", daemon=True)
    thread.start()
    thread.join(timeout)
    if not box:
        return "fail", f"timeout after {timeout:g} s"
    kind, value = box[0]
    if kind == "error":
        return "fail", str(value)
    if value is True:
        return "ok", None
    if isinstance(value, str) and value:
        return "fail", value
    return "fail", f"the check returned {value!r}"
