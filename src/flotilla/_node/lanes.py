"""Lanes: a local client's lone calls straight to an executor, past its agent (standard
library only).

A Local agent is given one more descriptor by its client: a Unix socket (its number in
``FLOTILLA_LANES``). For each executor process it forks (process slots of a pool that forms
no group), the agent makes a *lane*: two pipes, tasks client -> executor and results
executor -> client, and a *board*, a page of shared memory (a ``memfd``) of four words
(:class:`Board`). It sends the client its ends of both pipes and the board (one message:
the slot and the executor's pid, :data:`MESSAGE`) and closes its own copies: the executor
alone holds its ends, so its death is the end of the client's result pipe.

Who writes what on the board (each word has one writer, so no write is lost):

* ``CLAIMED``: the client, the call's id before it writes a lane task (and 0 again once
  the call ended, or when the write failed).
* ``RUNNING``: the executor, the id of the lane task it runs, and minus that id once its
  RESULT is written (on the lane, or its result pipe): *answered*. A call is *claimed*
  (:func:`claimed`) while ``CLAIMED`` is set and not answered: the agent then gives the
  slot no task of its own (it looks again on a timer; a task it gave at the moment the
  claim came is timed only from the claim's end). When the executor ends or is stopped
  with a claimed call, the agent sends that call's RESULT (DIED, with the exit's
  description: the client's errors and retries are today's); a CANCEL of it stops the
  executor if it runs it (CANCELLED), else the executor skips it.
* ``SEQ``: the agent, odd from the moment it reads the executor's output until what it
  read has left for the client. A lane task's result goes on the lane only when no output
  of the task can still be on its way (its output pipes drained: ``FIONREAD`` 0 on the
  executor's own copies of their ends, wherever the task pointed fds 1 and 2; and ``SEQ``
  the same even number as when the task began, read after that: it only grows); otherwise
  on the executor's result pipe, and the agent forwards it after the output (a RESULT for
  an id it never gave).
* ``CLOSED``, ``SEEN``: the agent, when the executor is gone: ``CLOSED`` set before it
  reads ``CLAIMED`` one last time, then ``SEEN`` what it read (-1: nothing). A client that
  finds ``CLOSED`` set after writing its task (it may have claimed after that last look)
  waits for ``SEEN``: the agent answers for the call if it saw it; else, when the lane
  ends without a result, the client sends the call again (free) if ``RUNNING`` says the
  executor never began it, or ends it DIED.

The executor serves its lane as it serves its task pipe, the task pipe first: a task the
agent gave it (after seeing no claim) runs before a lane task that came at the same time.
"""

from __future__ import annotations

import os

from .._wire.lanes import (
    CLAIMED,
    CLOSED,
    LARGEST,
    MESSAGE,
    RUNNING,
    SEEN,
    SEQ,
    VAR,
    WORD,
    Board,
)

__all__ = [
    "CLAIMED",
    "CLOSED",
    "LANE_POLL",
    "LARGEST",
    "RUNNING",
    "SEEN",
    "SEQ",
    "VAR",
    "WORD",
    "Board",
    "Lane",
    "LaneSocket",
    "claimed",
]


LANE_POLL = (0.001, 0.02)
"""Seconds between two looks at a slot's lane claim while a task of the agent waits for it
to clear: the first, and the longest (doubling in between)."""


def claimed(board: Board) -> bool:
    """Whether a lane call is claimed on ``board`` and not answered yet."""
    ident = board.get(CLAIMED)
    return bool(ident) and board.get(RUNNING) != -ident


class Lane:
    """A lane being made for one executor: the board and both pipes (see the module
    docstring). ``theirs``: the executor's ends (task read, result write); ``client``: the
    client's (task write, result read)."""

    __slots__ = ("board", "client", "theirs")

    def __init__(self) -> None:
        self.board = Board()
        r_task, w_task = os.pipe()
        r_res, w_res = os.pipe()
        self.theirs = (r_task, w_res)
        self.client = (w_task, r_res)

    def close_client(self) -> None:
        for fd in self.client:
            os.close(fd)
        self.client = (-1, -1)

    def close_theirs(self) -> None:
        for fd in self.theirs:
            os.close(fd)
        self.theirs = (-1, -1)


class LaneSocket:
    """The agent's end of its client's lane socket."""

    def __init__(self, fd: int) -> None:
        import socket  # (a Local agent's: an agent without a lane does without it, ~2.5 ms)

        self.sock = socket.socket(fileno=fd)
        self.fd = fd
        self.broken = False

    def give(self, lane: Lane, rank: int, pid: int) -> None:
        """Send the client its ends of ``lane`` (the executor ``pid`` of slot ``rank``)
        and close the agent's copies of every end and the board's descriptor."""
        import socket

        try:
            if not self.broken:
                fds = [*lane.client, lane.board.fd]
                socket.send_fds(self.sock, [MESSAGE.pack(rank, pid)], fds, socket.MSG_DONTWAIT)
        except OSError:  # the client is gone (or its socket full): no more lanes
            self.broken = True
        finally:
            lane.close_client()
            lane.close_theirs()
            lane.board.close()

    def close(self) -> None:
        self.broken = True
        self.sock.close()


def lane_socket() -> LaneSocket | None:
    """The lane socket a Local client gave this agent (:data:`VAR`, taken out of the
    environment: no executor inherits it), or None."""
    value = os.environ.pop(VAR, "")
    if not value.isdigit():
        return None
    try:
        os.fstat(int(value))
    except OSError:
        return None
    return LaneSocket(int(value))
