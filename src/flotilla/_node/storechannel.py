"""An executor's way to the distributed collections (standard library only).

The collections live in the client (``_client/store.py``). A task's operation is a STORE
frame on the executor's result pipe; the agent relays it to the client and relays the
client's STORED answer back on the task pipe, where the executor's inbox keeps it for the
thread that asked. One request at a time per executor process: a task's threads take turns
(a blocking operation, such as a lock's acquire, holds the others until it is answered).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from .._wire.frames import Body, Kind, frame, write_all


class Channel:
    """The executor's side of the relay.

    Args:
        wfd: the result pipe to the agent (shared with the executor's RESULT frames).
        write_lock: held for every write on ``wfd``.
        wait: blocks until the answer with the given id arrives; None if the agent is gone.
    """

    def __init__(
        self, wfd: int, write_lock: threading.Lock, wait: Callable[[int], Body | None]
    ) -> None:
        self.wfd = wfd
        self.write_lock = write_lock
        self.wait = wait
        self.turn = threading.Lock()
        self.ids = itertools.count(1)

    def request(self, body: bytes) -> Body:
        """Send one request; its answer's body."""
        with self.turn:
            ident = next(self.ids)
            with self.write_lock:
                write_all(self.wfd, frame(Kind.STORE, ident, body))
            answer = self.wait(ident)
        if answer is None:
            raise ConnectionError("the node's agent is gone: the collections are out of reach")
        return answer


_channel: Channel | None = None
_thread = threading.local()


def install(channel: Channel | None, this_thread: bool = False) -> None:
    """Set this executor's channel (None: its pool is not a cluster); ``this_thread``: a
    thread slot's own (``Worker(executor="thread")``), used by that thread."""
    global _channel
    if this_thread:
        _thread.channel = channel
    else:
        _channel = channel


def channel() -> Channel | None:
    """This executor's channel (this thread slot's), if its pool has collections."""
    return getattr(_thread, "channel", None) or _channel
