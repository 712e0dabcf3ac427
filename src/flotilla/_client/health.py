"""The health checks of a pool's nodes (``Options(health_checker=HealthChecker(...))``):
a thread that sends each node its check every ``interval``, counts failures in a row, and
has a node replaced at ``consecutive_failures`` (see ``flotilla/_health.py``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .._errors import FlotillaError, ProvisionError, TaskTimeoutError
from .._health import HealthChecker
from .._node.health import probe
from .._redaction import redact
from ..events import NodeHealthFailed
from .function import function
from .node import Node, NodeState

logger = logging.getLogger("flotilla")
_TICK = 0.05


@dataclass(slots=True)
class _Watch:
    node: Node
    due: float
    failures: int = 0
    passed: bool = False
    future: Future[Any] | None = None


class HealthLoop:
    """Checks every node of ``pool`` with ``checker`` until :meth:`stop`."""

    def __init__(self, pool: Any, checker: HealthChecker) -> None:
        """``pool``: the ``Compute`` (its nodes, observer, console, submit_broadcast)."""
        self.pool = pool
        self.checker = checker
        self.watches: dict[int, _Watch] = {}
        self.check = function(timeout=checker.timeout + 10.0)(probe)
        """The call a check is: ``probe(fn, timeout)`` on the node (which keeps to the
        timeout itself; the call's own is for a node that does not answer)."""
        self.stopped = threading.Event()
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="flotilla-health", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(5.0)

    def wait_healthy(self, timeout: float) -> None:
        """Wait until every node's check passed once; ProvisionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                nodes = self.pool._nodes
                pending = [
                    n.rank
                    for n in nodes
                    if not (w := self.watches.get(n.rank)) or w.node is not n or not w.passed
                ]
                if not pending:
                    return
                left = deadline - time.monotonic()
                if left <= 0 or self.stopped.is_set():
                    raise ProvisionError(
                        f"node(s) {', '.join(map(str, pending))} did not pass their health "
                        f"check within {timeout:g} s (Options.start_timeout)"
                    )
                self.changed.wait(min(left, 0.5))

    def _run(self) -> None:
        while not self.stopped.wait(_TICK):
            try:
                self._tick(time.monotonic())
            except Exception as e:  # the checks stop; the pool goes on
                logger.warning("the health checks stopped: %s: %s", type(e).__name__, e)
                return

    def _tick(self, now: float) -> None:
        pool = self.pool
        for node in list(pool._nodes):
            w = self.watches.get(node.rank)
            if w is None or w.node is not node:  # a new node (or a replacement): from zero
                w = self.watches[node.rank] = _Watch(node, now + self.checker.initial_delay)
            if node.state is not NodeState.READY:
                continue
            if w.future is None:
                if now >= w.due:
                    self._send(w)
                continue
            if not w.future.done():
                continue
            fut, w.future = w.future, None
            w.due = time.monotonic() + self.checker.interval
            try:
                verdict, why = fut.result()
            except TaskTimeoutError:
                verdict, why = "fail", f"timeout after {self.checker.timeout:g} s"
            except FlotillaError as e:  # the node was lost, the pool closes...: not the check's
                if node.state is NodeState.READY and pool._state.value == "running":
                    verdict, why = "fail", f"{type(e).__name__}: {e}".splitlines()[0]
                else:
                    continue
            except Exception as e:
                verdict, why = "fail", f"{type(e).__name__}: {e}".splitlines()[0]
            if verdict == "ok":
                w.failures = 0
                if not w.passed:
                    w.passed = True
                    with self.changed:
                        self.changed.notify_all()
                continue
            self._failed(w, str(why))

    async def gate(self, fresh: list[Node]) -> None:
        """A replacement's nodes pass their check before they serve (``Renewals.gate``):
        checked every ``interval`` until it passes; ``consecutive_failures`` failures in a
        row raise ProvisionError (the rank is then not replaced)."""
        for node in fresh:
            failures = 0
            await asyncio.sleep(self.checker.initial_delay)
            while True:
                why = await self._check_alone(node)
                if why is None:
                    break
                failures += 1
                self._report(node, why, failures)
                if failures >= self.checker.consecutive_failures:
                    raise ProvisionError(
                        f"node {node.rank}'s replacement failed its health check "
                        f"{failures} times in a row: {why}"
                    )
                await asyncio.sleep(self.checker.interval)

    async def _check_alone(self, node: Node) -> str | None:
        """Run the check on ``node``, not in service yet (sent to it alone): None when it
        passes, else why not."""
        d = self.pool._dispatcher
        call = self.check(self.checker.fn, self.checker.timeout)
        sub = d.encoder.prepare([call], d.encoder.encode([call]))[0]
        sub.pinned = True
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, node.send, [sub])
            verdict, why = await asyncio.wrap_future(sub.future)
        except TaskTimeoutError:
            return f"timeout after {self.checker.timeout:g} s"
        except Exception as e:
            return f"{type(e).__name__}: {e}".splitlines()[0]
        return None if verdict == "ok" else str(why)

    def _send(self, w: _Watch) -> None:
        call = self.check(self.checker.fn, self.checker.timeout)
        try:
            w.future = self.pool.submit_broadcast(call, nodes=[w.node.rank])[0]
        except FlotillaError:
            w.due = time.monotonic() + self.checker.interval

    def _report(self, node: Node, why: str, failures: int) -> str:
        """Say a failed check (console and event); ``why`` redacted."""
        pool = self.pool
        why = redact(why, pool._secrets)
        limit = self.checker.consecutive_failures
        pool._observer.emit(
            NodeHealthFailed(pool=pool.pool_id, node=node.rank, why=why, failures=failures)
        )
        pool._console.say(f"node {node.rank} failed its health check ({failures}/{limit}): {why}")
        return why

    def _failed(self, w: _Watch, why: str) -> None:
        node = w.node
        w.failures += 1
        why = self._report(node, why, w.failures)
        if w.failures < self.checker.consecutive_failures or node.loop is None:
            return
        loss = f"failed its health check {w.failures} times in a row: {why}"
        node.loop.call_soon_threadsafe(node.gone, loss)
