"""A pool's nodes by rank and the bookkeeping of the calls waiting for them: what the
:class:`Dispatcher` and its collaborators (``placement.py``, ``recovery.py``,
``membership.py``) share. ``lock`` guards it and is never held while writing to a node."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from .._errors import PoolClosedError
from .node import Node, Submission

Replacer = Callable[[int, str], list[int]]
"""Starts replacing the lost node at a rank (with a reason); returns every rank it takes
down meanwhile (the lost one, or all of them in a group pool)."""


class Ranks(ABC):
    """A pool's nodes and its calls' bookkeeping (the :class:`Dispatcher` is one).

    Attributes:
        nodes: the current node at each rank (a replacement takes its rank's place).
        group: the pool's processes form one group (restarted together).
        procs: processes per node.
        generation: group restarts so far; a break is acted on once per generation.
        restarts: generation -> the cause of the restart that began it.
        replacer: starts the replacement of a lost node; None when lost nodes are not
            replaced (``Options(replace_lost_nodes=False)``).
        running: whether the pool takes calls (RUNNING).
        secrets: the pool's: redacted from every error it settles.
        most: an elastic pool's ``max`` (0: a pool of fixed size); see :attr:`hold`.
        backlog: single calls waiting for a free process (see :attr:`hold`).
        lock: guards what follows (and ``nodes``).
        by_future: the cancellable calls, by ``id(future)``.
        waiting: down ranks: the calls waiting for them.
        replacing: ranks whose replacement runs.
        unplaced: single calls waiting for any ready node.
        gone: ranks that fail their calls (see ``Recovery.down``): why.
        held: group failures waiting for their siblings.
        gated: a group pool changes size: new calls wait (see ``Membership.gate``), in
            ``gated_calls`` (a batch's: ranks None; a broadcast's: its ranks).
        placing: broadcasts and batches being sent.
        opened: notified when the gate opens.
        closed: the pool closed.
    """

    def __init__(
        self,
        group: bool,
        procs: int,
        running: Callable[[], bool],
        replacer: Replacer | None = None,
    ) -> None:
        self.nodes: list[Node] = []
        self.group = group
        self.procs = procs
        self.generation = 0
        self.restarts: dict[int, str] = {}
        self.replacer = replacer
        self.running = running
        self.secrets: list[str] = []
        self.most = 0
        self.backlog: list[Submission] = []
        self.lock = threading.Lock()
        self.by_future: dict[int, Submission] = {}
        self.waiting: dict[int, list[Submission]] = {}
        self.replacing: set[int] = set()
        self.unplaced: list[Submission] = []
        self.gone: dict[int, str] = {}
        self.held: set[Submission] = set()
        self.gated = False
        self.gated_calls: list[tuple[list[Submission], list[int] | None]] = []
        self.placing = 0
        self.opened = threading.Condition(self.lock)
        self.closed = False

    @property
    def hold(self) -> bool:
        """An elastic pool below its ``max``: a single call that finds every process busy
        waits in :attr:`backlog` (which grows the pool, see ``elastic.py``) instead of
        queueing behind another call on a node; the next process free takes it. At
        ``max``, calls queue on the nodes again (no round trip between two calls of a
        process)."""
        return len(self.nodes) < self.most

    def all_lost(self) -> PoolClosedError:
        return PoolClosedError("no node of this pool can take calls: every node was lost")

    # -- what the collaborators ask of the dispatcher -----------------------------------
    @abstractmethod
    def retry(self, sub: Submission, err: BaseException, free: bool = False) -> bool:
        """Send ``sub`` again after ``err`` if it may be; whether it was."""

    @abstractmethod
    def settle(
        self, sub: Submission, *, value: Any = None, exc: BaseException | None = None
    ) -> None:
        """End ``sub`` with ``value`` or ``exc``."""

    @abstractmethod
    def pump(self) -> None:
        """Send backlogged calls to the processes that are free."""
