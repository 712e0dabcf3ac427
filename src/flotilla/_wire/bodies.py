"""The JSON bodies of HELLO, CONFIG and READY (see ``frames.Kind``) as typed structures:
every key either side writes or reads, with its type, in one place (mypy checks both
sides' lookups against them). A body is sent with :func:`dump` and read with the
``load_*`` function of its kind.

Standard library only: the agent imports it at start-up. The structures are ``TypedDict``
classes for mypy alone: at run time each name is ``dict`` (what ``json`` gives), so a
node's start neither imports ``typing`` nor makes the classes (their fifty annotations).
"""

from __future__ import annotations

from .._system import fastjson as json
from .frames import Body

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypedDict

    class SwitchedFrom(TypedDict):
        """The interpreter an agent left for one of the client's minor version."""

        python_version: str
        python: str
        installed: bool

    class PythonSearch(TypedDict):
        """Where an agent looked for a Python of the client's minor version, in vain."""

        wanted: str
        looked: list[str]

    class Hello(TypedDict, total=False):
        """HELLO (agent -> client): the agent is up. Every key but the last two is always
        there (the client's record of a node starts empty)."""

        pid: int
        host: str
        boot_id: str  # the machine's boot: a node that came back is told from one that stayed
        python: str  # the agent's interpreter
        python_version: str  # X.Y.Z
        port: int  # the first of a block of free ports (the head's becomes ``head_port``)
        switched_from: SwitchedFrom  # this interpreter replaced another one
        python_search: PythonSearch  # none of the client's minor version was found
        adopted: dict[str, int]  # a re-attached client: the calls left here (id -> local rank)

    class Config(TypedDict, total=False):
        """CONFIG (client -> agent): the pool's settings; the executors' blob follows it.
        The agent adds ``shm_prefix`` and ``image_dir`` for its executors, and each executor
        gets its ``local_rank``."""

        pool_id: str
        procs: int  # the executors (task slots) of the node
        threads: bool  # the slots are threads of one process (``Worker(executor="thread")``)
        compute_pool: str  # the node's InstanceInfo, JSON (``COMPUTE_POOL``)
        env: dict[str, str]
        image: dict[str, Any] | None  # the Image's build spec (``_image.py``)
        home: str
        workdir: str
        heartbeat_timeout: float
        shutdown_grace: float
        shm_probe: dict[str, str] | None  # name, token, prefix: a file the client wrote in its
        # /dev/shm (``_client/shm.py``): an agent that reads it shares the client's memory
        group: bool  # the processes form one group (a plugin's collective)
        preload: list[str]  # modules the agent imports before its first fork (plugins')
        relay_key: str  # hex: the node-to-node relays' key (the agent keeps it to itself)
        volumes: dict[str, Any] | None  # for the volumes helper alone (``_node/volumes.py``)
        reattach_grace: float  # a cluster's agent: seconds it waits for a new client (reattach)
        reattach_key: str  # hex: the key a re-attaching client proves it holds
        shm_prefix: str  # set by the agent: "" when the node does not share the client's
        image_dir: str  # set by the agent: the Image's environment on this node
        local_rank: int  # set per executor
        generation: int  # set per executor: the group's restarts so far (RESTART's ident)
        start_timeout: float  # a replacement executor not READY by then is ended (see READY)
        metrics: list[dict[str, Any]]  # the metrics the agent samples (``_node/metrics.py``)
        metrics_scope: str  # "tree": the node's own processes (nodes share a machine); "host"

    class Ready(TypedDict, total=False):
        """READY: the executors are up (executor -> agent: its ``pid``; agent -> client, once
        the whole node is: ``pids``, ``restarts``, ``shm``, ``relay_port``), or an executor, a
        build or the volumes failed (``error``, with what is known of the failure)."""

        pid: int
        pids: list[int]
        restarts: int
        shm: bool  # the node shares the client's shared memory
        relay_port: int  # the node's relay listens there (a node apart from the client)
        error: str
        local_rank: int
        stderr_tail: str
        build_step: str
        exitcode: int | None
        reason: str

else:
    SwitchedFrom = PythonSearch = Hello = Config = Ready = dict


def dump(body: Hello | Config | Ready) -> bytes:
    return json.dumps(body).encode()


def load_hello(body: Body) -> Hello:
    hello: Hello = json.loads(body)
    return hello


def load_config(body: Body) -> Config:
    config: Config = json.loads(body)
    return config


def load_ready(body: Body) -> Ready:
    ready: Ready = json.loads(body)
    return ready
