"""A lane's shared words and message, for both its ends: the agent and its executor
(``_node/lanes.py``, whose docstring says what a lane is and who writes what) and the
Local client (``_client/lanes.py``) (standard library only)."""

from __future__ import annotations

import mmap
import os
import struct

VAR = "FLOTILLA_LANES"
"""The environment variable that gives a Local agent its lane socket's descriptor."""
CLAIMED, RUNNING, SEQ, CLOSED, SEEN = 0, 8, 16, 24, 32
"""The board's words (offsets): see ``_node/lanes.py``."""
WORD = struct.Struct("<q")
"""A board's word: the executor and the client read and write it with ``WORD``'s own
methods per call (no Python frame per look: ``_node/executor.py``, ``_client/lanes.py``)."""
MESSAGE = struct.Struct("<Hi")
"""A lane's message on the socket: the slot (local rank) and the executor's pid; its
descriptors are the client's task end, result end and the board, in that order."""
LARGEST = 60000
"""Bytes of a lane's frame at most, a task or a result: it must fit an empty pipe (64 KiB)
whole, so that its write never waits (the other end may be gone)."""
_SIZE = 64


class Board:
    """One executor's shared words (a ``memfd`` page; see ``_node/lanes.py``)."""

    __slots__ = ("fd", "mem")

    def __init__(self, fd: int = -1) -> None:
        if fd < 0:
            fd = os.memfd_create("flotilla-lane", os.MFD_CLOEXEC)
            os.ftruncate(fd, _SIZE)
        self.fd = fd
        self.mem = mmap.mmap(fd, _SIZE)

    def get(self, word: int) -> int:
        return int(WORD.unpack_from(self.mem, word)[0])

    def set(self, word: int, value: int) -> None:
        WORD.pack_into(self.mem, word, value)

    def close(self) -> None:
        """Close the descriptor (the mapping stays, e.g. in a forked executor)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
