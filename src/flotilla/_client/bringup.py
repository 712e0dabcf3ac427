"""Bringing nodes up: from started agents to nodes that serve. One path for the pool's start
(``compute.py``) and for the nodes that replace lost ones (``renew.py``).

A node comes up in two waits: its agent says hello (the head's says its port), then it is
sent its place in the pool (rank, peers, head, environment, plugins) and says it is ready.
Every node being brought up at once is waited for together, root cause first.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Sequence
from typing import TypeVar

from .._errors import ProvisionError
from .._info import InstanceInfo, Peer
from .._providers.base import AgentProcess, Options
from .._wire.bodies import Config
from .._wire.frames import Kind
from .._wire.serialize import unlink_shm
from . import shm
from .console import Console
from .interpreter import settle
from .node import Node
from .startup import Startup

T = TypeVar("T")


class Bringup:
    """Brings one pool's nodes up.

    Attributes:
        console: the pool's console (a row per node being brought up).
        procs: every agent the pool started.
        head_port: the head node's port, from its hello.
        startup: what every node is configured with (``startup.py``), from :meth:`begin`.
    """

    def __init__(
        self,
        options: Options,
        group: bool,
        make_node: Callable[[int, AgentProcess], Node],
    ) -> None:
        self.options = options
        self.group = group
        self.make_node = make_node
        self.console = Console()
        self.procs: list[AgentProcess] = []
        self.head_port = 0
        self.startup: Startup | None = None
        self.relay_key = secrets.token_hex(32)
        """The pool's key for node-to-node relays (``_node/relay.py``): in CONFIG only."""
        self.reattach: tuple[float, str] | None = None
        """A cluster's pool (``Compute.keep_agents``): how long its agents wait for a new
        client when theirs is gone, and the key that client proves it holds."""

    def begin(self, startup: Startup) -> None:
        """The pool starts: every node brought up from now on (the first ones, new ones,
        replacements) is configured from ``startup``."""
        self.startup = startup

    @property
    def started(self) -> Startup:
        """:attr:`startup`; :meth:`begin` comes before any node is brought up."""
        assert self.startup is not None, "Bringup.begin comes first"
        return self.startup

    def nodes(self, ranks: Sequence[int], procs: Sequence[AgentProcess]) -> list[Node]:
        """The nodes of the agents ``procs`` started for ``ranks`` (in order)."""
        self.procs += procs
        return [self.make_node(rank, proc) for rank, proc in zip(ranks, procs, strict=True)]

    async def bring_up(self, fresh: Sequence[Node], current: Sequence[Node]) -> None:
        """Start ``fresh`` nodes and wait until they serve, configured as members of the
        pool whose node at each rank is ``current``'s, or the fresh one at its rank.
        ProvisionError when one fails or is late."""
        loop = asyncio.get_running_loop()
        for node in fresh:
            node.start(loop)
        timeout = self.options.start_timeout
        await wait_all(fresh, [n.hello for n in fresh], timeout, "start")
        # each must run the client's Python minor version before anything else is sent
        await settle(list(fresh), self.started.python, self.console.say, timeout)
        hellos = [n.hello_info for n in fresh]
        if fresh[0].rank == 0:  # a (new) head: its port
            self.head_port = int(hellos[0]["port"])
        nodes = list(current)
        for node in fresh:
            nodes[node.rank] = node
        probe = shm.write_probe(self.started.shm_prefix)  # only now: it lives as short as it can
        try:
            for node in fresh:
                self.configure(node, nodes, probe)
            await wait_all(fresh, [n.ready for n in fresh], timeout, "initialise")
        finally:
            if probe:
                unlink_shm(probe["name"])

    def info(self, node: Node, nodes: Sequence[Node]) -> InstanceInfo:
        """``node``'s place in the pool whose node at each rank is ``nodes``'s."""
        peers = tuple(Peer(n.rank, n.proc.address, n.proc.host) for n in nodes)
        cluster = self.options.cluster
        start = self.started
        return InstanceInfo(
            node=node.rank,
            total_nodes=len(nodes),
            is_head=node.rank == 0,  # Skyward's: node 0, also without cluster mode
            head_addr=peers[0].addr if cluster else "",
            head_port=self.head_port if cluster else 0,
            accelerators=start.accelerator.count if start.accelerator else 0,
            peers=peers if cluster else (),
            pool_id=start.pool_id,
            addr=node.proc.address,
            cluster=cluster,
            accelerator=start.accelerator.name if start.accelerator else None,
            procs_per_node=start.procs_per_node,
            workers_per_node=start.workers,
        )

    def members(self, nodes: Sequence[Node], to: Sequence[Node], wait: bool) -> list[Node]:
        """Tell the nodes ``to`` their new place in the pool whose node at each rank is
        ``nodes``'s: it grew or shrank (MEMBERS: the calls sent after it see the new
        size and peers). Without ``wait`` only the nodes that need no wait are told; the
        others are returned (with ``wait``: not on the event loop)."""
        left = []
        for node in to:
            body = self.info(node, nodes).to_json().encode()
            if not node.send_control(Kind.MEMBERS, wait=wait, body=body) and not wait:
                left.append(node)
        return left

    async def tell_rest(self, nodes: Sequence[Node], left: Sequence[Node]) -> None:
        """Tell the nodes ``members(..., wait=False)`` left, from a worker thread (their
        sends may wait; the loop never does)."""
        if left:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.members, nodes, left, True)

    async def tell(self, nodes: Sequence[Node], to: Sequence[Node]) -> None:
        """:meth:`members` from the loop: without a wait where it can, the rest after."""
        await self.tell_rest(nodes, self.members(nodes, to, wait=False))

    def configure(self, node: Node, nodes: Sequence[Node], probe: dict[str, str]) -> None:
        """Send ``node`` its place in the pool (``nodes``: the node at each rank)."""
        info = self.info(node, nodes)
        start = self.started
        config: Config = {
            "pool_id": start.pool_id,
            "procs": start.workers,
            "compute_pool": info.to_json(),
            "env": {k: v for k, v in start.env.items() if k not in start.delivered},
            "image": start.build_spec,
            "home": start.home,
            "heartbeat_timeout": self.options.heartbeat_timeout,
            "start_timeout": self.options.start_timeout,
            "shutdown_grace": self.options.shutdown_grace,
            "shm_probe": probe or None,
            "group": self.group,
            "threads": start.threads,
        }
        if start.preload:
            config["preload"] = list(start.preload)
        if self.options.relay:  # the agent opens its relay port (if apart from the client)
            config["relay_key"] = self.relay_key
        if start.volumes is not None:
            config["volumes"] = start.volumes
        if self.reattach is not None:
            config["reattach_grace"], config["reattach_key"] = self.reattach
        config.update(start.observe)
        node.configure(config, start.blob)


async def wait_all(
    nodes: Sequence[Node],
    futures: Sequence[asyncio.Future[T] | None],
    timeout: float,
    what: str,
) -> list[T]:
    """The results of ``futures`` (one per node of ``nodes``, None: nothing to wait for)
    within ``timeout`` s: the first failure in node order, or a ProvisionError naming the
    nodes that did not ``what`` in time."""
    waiting = [f for f in futures if f is not None]
    for f in waiting:  # failures after the first are reported through the first
        f.add_done_callback(lambda f: f.cancelled() or f.exception())
    _done, pending = await asyncio.wait(
        waiting, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION
    )
    for fut in waiting:  # root cause first: the first node that failed
        if fut.done() and fut.exception() is not None:
            raise fut.exception()  # type: ignore[misc]
    if pending:
        late = [n.name for n, f in zip(nodes, futures, strict=True) if f in pending]
        raise ProvisionError(
            f"{', '.join(late)} did not {what} within {timeout:.0f} s "
            f"(Options(start_timeout=...) sets the limit)"
        )
    return [f.result() for f in waiting]
