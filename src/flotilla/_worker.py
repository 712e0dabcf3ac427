"""``Worker``: Skyward's task slots per node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ._errors import ConfigurationError, check_number

WorkerExecutor = Literal["auto", "thread", "process"]
EXECUTORS = ("auto", "thread", "process")


@dataclass(frozen=True)
class Worker:
    """How many tasks each node runs at once (Skyward's ``Worker``), given as
    ``Options(worker=...)`` or ``Compute(worker=...)``.

    Attributes:
        concurrency: task slots per node: a node runs up to this many calls at once, and
            ``pool.map``, ``gather`` and the joblib backend fill every slot of every node
            (``nodes * concurrency`` calls in parallel). A broadcast (``@``) still runs
            once per node. Each slot knows itself as ``instance_info().worker``, out of
            ``instance_info().workers_per_node``.
        executor: ``"process"``, ``"thread"`` or ``"auto"`` (``"process"``).
            ``"process"``: every slot is its own process (its own interpreter and GIL; a
            crash ends only that slot's call). ``"thread"``: as Skyward's, the slots are
            threads of one process per node: they share its memory (module globals, a
            model loaded once) and its GIL (pure-Python CPU-bound tasks take turns), and
            a call that dies, is cancelled or times out while running replaces that
            process: the calls the other slots were running end with a WorkerDiedError
            saying so. The distributed collections and streaming work in both.
    """

    concurrency: int = 1
    executor: WorkerExecutor = "auto"

    def __post_init__(self) -> None:
        c = self.concurrency
        check_number(
            c, f"Worker(concurrency=...) must be an int >= 1, got {c!r}", whole=True, at_least=1
        )
        if self.executor not in EXECUTORS:
            raise ConfigurationError(
                f"Worker(executor=...) must be one of {', '.join(map(repr, EXECUTORS))}, "
                f"got {self.executor!r}"
            )

    @property
    def resolved_executor(self) -> Literal["thread", "process"]:
        """The executor ``"auto"`` stands for: ``"process"``."""
        return "thread" if self.executor == "thread" else "process"
