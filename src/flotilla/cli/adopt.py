"""A cluster whose daemon died while its nodes ran: a new daemon re-attaches to them.

A cluster's agents wait ``FLOTILLA_REATTACH_GRACE`` seconds (default
:data:`DEFAULT_GRACE`) for a new client when their daemon is gone
(``Compute.keep_agents``, ``_node/reattach.py``). A new daemon, started by ``flotilla
start NAME``, by a command that needs the daemon and finds the cluster stale
(``clusters.running``), by ``down`` and by ``flotilla server`` as it starts, finds the
recorded nodes through the provider (``_providers/reattach.py``), provisions nothing, and
follows the jobs that were running (:meth:`Runner.adopt`): their scripts ran on, their
output continues in the same logs. A node whose agent is gone is said so (the record's
``error``: which node, why); the others are stopped then, the running jobs fail, the
cluster is FAILED and ``flotilla down`` removes it as usual.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from .._errors import ConfigurationError, ProvisionError
from .._redaction import is_secret
from .jobspec import JobSpec
from .state import ClusterRecord, JobRecord, JobStatus, NodeRecord, Paths, read_json, write_json

if TYPE_CHECKING:  # (the daemon's modules: `flotilla status` asks only `adoptable`)
    from .._client.compute import Compute
    from .._providers.base import Provider
    from .._providers.reattach import Reattach
    from .jobs import Job

GRACE_VAR = "FLOTILLA_REATTACH_GRACE"
DEFAULT_GRACE = 600.0
"""Seconds a cluster's agents wait for a new daemon when theirs is gone."""
_REVEAL_TIMEOUT = 60.0
SPEC_FILE = "spec.json"
"""In a job's folder (private): its JobSpec, for a daemon that re-attaches to it."""


def grace() -> float:
    """How long a cluster's agents wait for a new daemon (``FLOTILLA_REATTACH_GRACE``)."""
    text = os.environ.get(GRACE_VAR, "")
    try:
        value = float(text) if text else DEFAULT_GRACE
    except ValueError:
        raise ConfigurationError(f"{GRACE_VAR}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ConfigurationError(f"{GRACE_VAR} must be positive, got {text}")
    return value


def keeps_agents(provider: Provider) -> bool:
    """Whether a cluster on ``provider`` has its agents wait for a new daemon (the
    providers that can reach them again, see ``_providers/reattach.py``)."""
    from .._providers.reattach import can_reattach

    return can_reattach(provider)


def adoptable(rec: ClusterRecord) -> bool:
    """Whether the record's nodes may still run and can be re-attached to."""
    return bool(rec.reattach_secret and rec.nodes and all(n.reattach for n in rec.nodes))


def take_over(rec: ClusterRecord, adopting: bool) -> list[JobRecord]:
    """A new daemon takes over ``rec``: the jobs the old one left unfinished fail, but
    for the running ones it re-attaches to (``adopting``), returned."""
    kept = []
    for job in rec.jobs:
        if JobStatus(job.status).finished:
            continue
        if adopting and job.status == JobStatus.RUNNING.value and job.nodes:
            kept.append(job)
            continue
        job.status = JobStatus.FAILED.value
        job.error = "the cluster daemon running it exited"
    return kept


def save_spec(job: Job) -> None:
    """Keep the job's spec in its (private) folder for a daemon that re-attaches; its
    secrets' values never go to disk: only their names (:func:`reveal` reads the values
    back from the job's processes)."""
    data = job.spec.to_dict()
    hidden = sorted(data["secrets"]) + sorted(k for k, v in data["envs"].items() if is_secret(k, v))
    data["secrets"] = {k: "" for k in data["secrets"]}
    data["envs"] = {k: "" if k in hidden else v for k, v in data["envs"].items()}
    data["hidden"] = hidden
    write_json(job.dir / SPEC_FILE, data)


def restore(paths: Paths, rec: JobRecord) -> Job:
    """The running job of ``rec``, as its daemon had it (its spec from its folder)."""
    from .jobs import Job

    folder = paths.job_dir(rec.id)
    data = read_json(folder / SPEC_FILE, lambda why: ProvisionError(f"job {rec.id}: {why}"))
    if data is None:
        raise ProvisionError(f"job {rec.id}: its spec was not kept ({folder / SPEC_FILE})")
    job = Job(rec.id, JobSpec.from_dict(data), rec.task_id, folder)
    job.hidden = list(data.get("hidden", []))
    job.held = [] if job.hidden else None  # its lines wait for its secrets' values
    job.status = JobStatus.RUNNING
    job.submitted, job.started, job.nodes = rec.submitted, rec.started, list(rec.nodes)
    return job


def reveal(job: Job, pool: Compute, token: str) -> None:
    """Give a restored job the values of its secrets, read from the environment of its
    processes on its first node (over the pool's channel), and let its lines go on,
    redacted. Lines held meanwhile go on also when the values cannot be read (its
    processes ended): then they are shown as the job printed them."""
    from .node_ops import job_env

    values: dict[str, str] = {}
    if job.hidden:
        call = job_env(f"{token}.{job.id}.", job.hidden)
        try:
            values = pool.submit_broadcast(call, nodes=job.nodes[:1], any_slot=True)[0].result(
                _REVEAL_TIMEOUT
            )
        except Exception as e:  # the job ended meanwhile, the node went away
            print(f"job {job.id}: its secrets could not be read back: {e}", file=sys.stderr)
    job.reveal(list(values.values()))


def provider(base: Provider, nodes: list[NodeRecord], key: str) -> Reattach:
    """The provider that reaches ``nodes``'s agents again; a ProvisionError naming the
    nodes that are gone (the others are stopped then: a cluster goes on whole or not at
    all)."""
    from .._providers.reattach import Node, Reattach, can_reattach

    if not can_reattach(base):
        raise ProvisionError(f"the {base.name} provider cannot re-attach to its nodes")
    found = [
        Node(n.node, n.ip, n.host, n.workdir, tuple(n.reattach), n.scheduler_job, n.scheduler_node)
        for n in nodes
    ]
    reattach = Reattach(base, found, key)
    gone = reattach.probe()
    if not gone:
        return reattach
    alive = [n.node for n in nodes if n.node not in gone]
    reattach.stop(alive)
    reattach.sweep([n for n in found if n.rank in gone])  # the job, pods, containers go whole
    said = "; ".join(f"node {r} ({nodes[r].host}) is gone: {why}" for r, why in gone.items())
    stopped = f"; its other node(s) {alive} were stopped" if alive else ""
    raise ProvisionError(f"{said}{stopped}")
