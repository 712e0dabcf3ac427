"""Remote tracebacks as people read them: the user's frames first, flotilla's hidden.

A task's exception is re-raised on the client with the node's traceback as its cause, as
``multiprocessing`` does: Python prints the cause first, so what the user's code did on
the node comes first and the client-side frames (flotilla's dispatch) come last. Frames of
flotilla's own code on the node (the executor, output decorators, plugin wrappers) carry
nothing the user can act on and are left out, with a line saying how many.
"""

from __future__ import annotations

import re

_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line \d+')
_OURS = re.compile(r"[/\\]flotilla[/\\](?:_[a-z_]+|plugins|cli)(?:[/\\][^/\\]+)*\.py$|"
                   r"[/\\]flotilla[/\\]_[a-z_]+\.py$")  # fmt: skip


class RemoteTraceback(Exception):
    """The cause of a re-raised task exception: the node's traceback, as text."""

    def __init__(self, text: str, node: int) -> None:
        super().__init__(text)
        self.text = text
        self.node = node

    def __str__(self) -> str:
        return f'raised on node {self.node}:\n"""\n{self.text.rstrip()}\n"""'


def user_frames(tb: str) -> str:
    """``tb`` without the frames of flotilla's own modules (a line counts them)."""
    out: list[str] = []
    hidden = 0
    skipping = False
    for line in tb.splitlines():
        m = _FRAME.match(line)
        if m is not None:
            skipping = _OURS.search(m.group("file")) is not None
            hidden += skipping
        elif skipping and not line.startswith("    "):
            skipping = False  # the exception line, or a chained traceback's header
        if not skipping:
            out.append(line)
    if hidden:
        out.append(f"({hidden} frame(s) of flotilla's own code hidden)")
    return "\n".join(out) + "\n"
