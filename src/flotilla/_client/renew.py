"""Replacing lost nodes: the pool keeps its size.

When a node's agent is lost (its stream ended: the process was killed, the host went away,
the SSH connection dropped) the pool asks its allocation for another machine at that rank
with an agent started on it (:meth:`Allocation.renew`: a new process tree, a spare or
reconnected host...; the SSH provider tries its spares in turn until one starts), and
configures it with the same rank and the current peers; once it is ready it takes the
rank's place and the calls that waited for it are sent (see ``dispatch.py``).

In a pool whose processes form one group (``forms_group`` plugins) a group cannot go on
with one member new: every node gets a fresh agent (the survivors on the machines they
have), as torchrun restarts all workers, and every node learns the new peers and head.

A replacement that fails (the host is still down, the provider has nothing now) is tried
again, with a backoff from :data:`RETRY_MIN` to :data:`RETRY_MAX` seconds, until it succeeds
or the pool closes: a host that comes back is taken back, as an elastic pool's are. The calls
pinned to the rank (broadcasts) wait for it up to the pool's start timeout
(``Options(start_timeout=...)``) from the loss; from then on, until it is back, they fail at
once naming the node and the last failure (``Recovery.down``).

A provider that says it cannot replace the machine (a ProvisionError without a cause) is
not asked again: the rank is gone and broadcasts fail naming it.

The console says what happened: ``node k lost (why), replacing``, ``node k could not be
replaced yet (why); trying again ...`` once, then ``node k back after N s``. A failure is
told root cause first, as torchrun reports one (:func:`failure_report`): ``why`` is the
innermost error of the chain, and the lines after it give every error of the chain whole,
the pool's secrets redacted. Everything runs on the client's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from .._errors import FlotillaError, ProvisionError
from .._providers.base import Allocation, MachineState, restart_agents
from .._wire.frames import Kind
from .bringup import Bringup
from .console import redact
from .dispatch import Dispatcher
from .node import Node, NodeState

logger = logging.getLogger("flotilla")
RETRY_MIN = 0.5
RETRY_MAX = 10.0
"""Seconds between two attempts to replace a lost node (doubling from :data:`RETRY_MIN`)."""


class Renewals:
    """The replacements of one pool's lost nodes, under way or done.

    Args:
        dispatcher: the pool's calls and nodes.
        bringup: brings the new nodes up.
        on_back: called with the ranks replaced, once their new nodes serve.

    Attributes:
        allocation: the pool's machines (set once the pool has them).
        replaced: how many nodes were replaced so far (in a group pool: each renewal of
            the group counts the lost node once).
        starting: nodes started in place of lost ones, not in service yet (the pool's
            heartbeats reach them too: an environment build may take a while).
    """

    def __init__(
        self, dispatcher: Dispatcher, bringup: Bringup, on_back: Callable[[list[int]], None]
    ) -> None:
        self.dispatcher = dispatcher
        self.bringup = bringup
        self.on_back = on_back
        self.allocation: Allocation | None = None
        self.replaced = 0
        self.starting: list[Node] = []
        self.gate: Callable[[list[Node]], Awaitable[None]] | None = None
        """Awaited with the new nodes before they serve (raises: not replaced)."""
        self._reported: dict[int, str] = {}  # rank -> what the provider said of its loss
        self._tasks: set[asyncio.Task[None]] = set()

    def begin(self, rank: int, why: str) -> list[int]:
        """Start replacing the node at ``rank``; the ranks that are down meanwhile."""
        why = self._reported.pop(rank, why)
        ranks = list(range(len(self.dispatcher.nodes))) if self.bringup.group else [rank]
        also = ", restarting every process of the pool" if len(ranks) > 1 else ""
        logger.warning("node %d lost (%s), replacing%s", rank, why, also)
        self._spawn(self._renew(rank, ranks, why))
        return ranks

    def provider_lost(self, rank: int, reason: str) -> None:
        """The provider learned that the machine at ``rank`` is gone (a SLURM node down, a
        spot interruption): stop its agent, so that the node is lost and replaced."""
        nodes = self.dispatcher.nodes
        if rank < len(nodes) and nodes[rank].state is NodeState.READY:
            self._reported[rank] = f"the provider reports its machine lost: {reason}"
            self._spawn(_drop(nodes[rank]))

    async def cancel(self) -> None:
        """Stop every replacement under way (the pool closes); their agents are stopped."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _renew(self, lost: int, ranks: list[int], why: str) -> None:
        dispatcher, allocation = self.dispatcher, self.allocation
        assert allocation is not None
        started = time.monotonic()
        old = {r: dispatcher.nodes[r] for r in ranks}
        if len(ranks) > 1:  # a group: the survivors' processes cannot go on with a new member
            dispatcher.generation += 1
            cause = f"node {lost} was lost ({why})"
            for r in ranks:
                if r != lost:
                    dispatcher.recovery.retire(old[r], cause)
                    self._spawn(stop_node(old[r]))
        await old[lost].proc.terminate()  # it may linger (an executor that cannot start)
        allocation.mark(allocation.machines[lost], MachineState.LOST)
        patience = self.bringup.options.start_timeout
        failures: list[str] = []  # the first attempt's failure and the last one's
        expired = False  # the calls waiting for the rank waited long enough

        def failed() -> str:
            first, last = failures[0], failures[-1]
            return first if first == last else f"{first}; last attempt: {last}"

        def give_up_waiting() -> None:
            nonlocal expired
            expired = True
            if failures:
                dispatcher.recovery.down(ranks, failed())

        timer = asyncio.get_running_loop().call_later(patience, give_up_waiting)
        delay = RETRY_MIN
        try:
            while True:
                try:
                    fresh = await self._attempt(lost, ranks, why)
                    break
                except Exception as e:
                    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                    root, report = failure_report(e, dispatcher.secrets)
                    if not _may_pass(e):
                        logger.error("node %d could not be replaced (%s)%s", lost, root, report)
                        dispatcher.recovery.failed(ranks, reason)
                        return
                if not failures:
                    logger.warning(
                        "node %d could not be replaced yet (%s); trying again until it is "
                        "back (every %g s at most); calls for it wait up to %g s%s",
                        lost,
                        root,
                        RETRY_MAX,
                        max(0.0, patience - (time.monotonic() - started)),
                        report,
                    )
                failures[1:] = [reason]
                if expired:
                    dispatcher.recovery.down(ranks, failed())
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX, delay * 2)
        finally:
            timer.cancel()
        self.replaced += 1
        await self._tell_survivors(fresh)
        dispatcher.recovery.back(fresh)
        logger.warning("node %d back after %.1f s", lost, time.monotonic() - started)
        self.on_back(ranks)

    async def _attempt(self, lost: int, ranks: list[int], why: str) -> list[Node]:
        """One attempt to start and bring up the nodes at ``ranks`` (``lost``'s new
        machine, the others' new agents); their nodes, ready. On a failure nothing of it
        is left running and the error is raised."""
        allocation = self.allocation
        assert allocation is not None
        fresh: list[Node] = []
        console = self.bringup.console  # one row per node being replaced, on a terminal
        console.begin(ranks, title="replacing" if len(ranks) == 1 else "restarting")
        try:
            procs = await restart_agents(allocation, lost, ranks, why)
            fresh = self.bringup.nodes(ranks, procs)
            self.starting += fresh
            await self.bringup.bring_up(fresh, self.dispatcher.nodes)
            if self.gate is not None:  # e.g. a health check the new nodes pass first
                await self.gate(fresh)
        except asyncio.CancelledError:
            for node in fresh:
                node.state = NodeState.CLOSED
            raise
        except Exception:
            for node in fresh:
                node.state = NodeState.CLOSED
                self._spawn(node.proc.terminate())
            raise
        finally:
            console.end()
            self.starting = [n for n in self.starting if n not in fresh]
        return fresh

    async def _tell_survivors(self, fresh: list[Node]) -> None:
        """The nodes that went on learn the new peers (a replacement may have another
        address), before the replaced rank takes calls again (MEMBERS, ``bringup.py``)."""
        by_rank = {node.rank: node for node in fresh}
        nodes = [by_rank.get(node.rank, node) for node in self.dispatcher.nodes]
        survivors = [
            node
            for node in self.dispatcher.nodes
            if node.rank not in by_rank and node.state is NodeState.READY
        ]
        await self.bringup.tell(nodes, survivors)


def failure_report(error: BaseException, secrets: Sequence[str]) -> tuple[str, str]:
    """(root cause, report) of a failed replacement, as torchrun reports a failure: root
    cause first. The root cause is the first line of the innermost exception of
    ``error``'s chain (its ``__cause__``, or the ``__context__`` it was raised in); the
    report, on the lines after the log message's (empty when the root cause says it all),
    is every exception of the chain from the root cause out, each with its whole message.
    ``secrets`` are redacted from both."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and all(e is not seen for seen in chain):
        chain.append(e)
        e = e.__cause__ if e.__cause__ is not None or e.__suppress_context__ else e.__context__
    texts = [redact(_shown(e), list(secrets)).splitlines() or [""] for e in reversed(chain)]
    root = texts[0][0]
    if len(texts) == 1 and len(texts[0]) == 1:
        return root, ""
    lines: list[str] = []
    for n, text in enumerate(texts):
        lines.append(f"  {'root cause' if n == 0 else 'which caused'}: {text[0]}")
        lines += [f"    {line}" for line in text[1:]]
    return root, "\n" + "\n".join(lines)


def _shown(error: BaseException) -> str:
    """``error`` as its report shows it: flotilla's errors by their message, others (an
    OSError, a KeyError) with their type's name first, as a traceback's last line."""
    text = str(error)
    if isinstance(error, FlotillaError) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _may_pass(error: BaseException) -> bool:
    """Whether a failed replacement may work later: any failure but the provider's saying
    it cannot replace the machine (a ProvisionError with no cause anywhere in its chain,
    e.g. "this provider cannot replace machines"): a host down, a start timeout, no
    capacity now."""
    e: BaseException | None = error
    while e is not None:
        if not isinstance(e, ProvisionError) or e.cause is not None:
            return True
        e = e.__cause__
    return False


async def stop_node(node: Node) -> None:
    """Stop a retired or released node's agent: politely (SHUTDOWN), then by force."""
    node.send_control(Kind.SHUTDOWN, wait=False)  # the event loop never waits for a node
    with contextlib.suppress(Exception):
        if await node.proc.wait(1.0) is None:
            await node.proc.terminate()


async def _drop(node: Node) -> None:
    """Stop ``node``'s agent and declare the node gone: once its readers are removed, the
    end of its stream may never be read, so the loss is not left to that."""
    await node.proc.terminate()
    node.gone()
