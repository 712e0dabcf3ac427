"""A cluster whose daemon died while its nodes ran: a new daemon re-attaches to them.

A cluster's agents wait ``FLOTILLA_REATTACH_GRACE`` seconds (default
:data:`DEFAULT_GRACE`) for a new client when their daemon is gone
(``Compute.keep_agents``, ``_node/reattach.py``). A new daemon, started by ``flotilla
start NAME``, by a command that needs the daemon and finds the cluster stale
(``clusters.running``), by ``down`` and by ``flotilla server`` as it starts, finds the
recorded nodes through the provider (``_providers/reattach.py``), provisions nothing, and
follows the jobs that were running (:meth:`Runner.adopt`): their scripts ran on, their
output continues in the same logs. A node whose agent is gone is said so (the record's
``error``: which node, why); the others are stopped then (on a cloud their instances are
released: :func:`abandon`), the running jobs fail, the cluster is FAILED and ``flotilla
down`` removes it as usual.

On a cloud (AWS and the cloud kit's rented clouds) the daemon is also the client its
instances are labelled with, and each instance's watchdog ends it when its client stops
talking to it. So the daemon holds :class:`Leases` on the cluster's client identities
(``cloud.identity``: no orphan cleanup takes its instances while it runs, nor for the
grace after it died), its agents hold their instances' watchdogs for the grace while no
client is there (``_node/cloud.py``: the instances end by themselves as the grace ends),
and a daemon that re-attaches takes the leases over and, as it closes, releases the
instances itself (:func:`release`: the re-attach provider made none of them).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import ConfigurationError, ProvisionError
from .._redaction import is_secret
from .jobspec import JobSpec
from .state import ClusterRecord, JobRecord, JobStatus, NodeRecord, Paths, read_json, write_json

if TYPE_CHECKING:  # (the daemon's modules: `flotilla status` asks only `adoptable`)
    from .._client.compute import Compute
    from .._providers.base import Provider
    from .._providers.reattach import Reattach
    from .backends.base import Backend, ProviderSpec
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


def take_over(
    rec: ClusterRecord, adopting: bool, paths: Paths | None = None
) -> tuple[list[JobRecord], list[JobRecord]]:
    """A new daemon takes over ``rec``: the jobs the old one left unfinished fail, but for
    the running ones it re-attaches to (``adopting``) and those it queues again (queued
    or in ``sync``/``setup``: :func:`requeue`), returned. A job whose secrets held values
    cannot run again (they are never kept on disk): it fails, saying so."""
    kept, again = [], []
    for job in rec.jobs:
        if JobStatus(job.status).finished:
            continue
        if adopting and job.status == JobStatus.RUNNING.value and job.nodes:
            kept.append(job)
            continue
        why = _cannot_requeue(paths, job) if adopting and paths is not None else "-"
        if not why:
            job.status, job.started, job.nodes = JobStatus.PENDING.value, 0.0, []
            again.append(job)
            continue
        job.status = JobStatus.FAILED.value
        job.error = "the cluster daemon running it exited" + (why if why != "-" else "")
    return kept, again


def _cannot_requeue(paths: Paths, job: JobRecord) -> str:
    """Why ``job`` (queued or in setup) cannot be queued again ('' when it can)."""
    if job.status not in (JobStatus.PENDING.value, JobStatus.SETTING_UP.value):
        return "-"
    data = read_json(paths.job_dir(job.id) / SPEC_FILE, ConfigurationError)
    if data is None:
        return "; its spec was not kept"
    if data.get("hidden"):
        return "; it cannot run again: its secrets' values are never kept on disk"
    return ""


def requeue(paths: Paths, rec: JobRecord) -> Job:
    """A job the dead daemon had queued, or was syncing or setting up, as it was submitted
    (its spec from its folder): it runs again from its start (``sync``, ``setup``)."""
    job = restore(paths, rec)
    job.status, job.started, job.nodes, job.held = JobStatus.PENDING, 0.0, [], None
    job.phase(f"job {rec.id}: its cluster's daemon died; queued again by the new one")
    return job


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


def provider(
    base: Provider,
    nodes: list[NodeRecord],
    key: str,
    login: Callable[[int], list[str]] | None = None,
) -> Reattach:
    """The provider that reaches ``nodes``'s agents again (a cloud's over ``login(rank)``,
    the pool's ssh login to the node); a ProvisionError naming the nodes that are gone
    (the others are stopped then: a cluster goes on whole or not at all)."""
    from .._providers.reattach import Node, Reattach, can_reattach, reattaches_over_ssh

    if not can_reattach(base):
        raise ProvisionError(f"the {base.name} provider cannot re-attach to its nodes")
    found, unreachable = [], {}
    for n in nodes:
        how: list[str] = []
        if login is not None and reattaches_over_ssh(base):
            try:
                how = login(n.node)
            except (ConfigurationError, OSError) as e:  # its pool's folder is gone
                unreachable[n.node] = f"its pool's login is gone: {e}"
        job, scheduler_node = n.scheduler_job, n.scheduler_node
        argv, where = tuple(n.reattach), (n.node, n.ip, n.host, n.workdir)
        found.append(Node(*where, argv, job, scheduler_node, tuple(how)))
    reattach = Reattach(base, found, key)
    gone = {**reattach.probe(), **unreachable}
    if not gone:
        return reattach
    alive = [n.node for n in nodes if n.node not in gone]
    reattach.stop(alive)
    reattach.sweep([n for n in found if n.rank in gone])  # the job, pods, containers go whole
    said = "; ".join(f"node {r} ({nodes[r].host}) is gone: {why}" for r, why in gone.items())
    stopped = f"; its other node(s) {alive} were stopped" if alive else ""
    raise ProvisionError(f"{said}{stopped}")


LOGINS = "logins.json"
"""In a cloud cluster's private ``login`` folder: each node's ssh login (:func:`keep_login`)."""


def pool_login(
    backend: Backend[Any], spec: ProviderSpec, paths: Paths, nodes: list[NodeRecord], rank: int
) -> list[str]:
    """How a cloud cluster's node is logged in to as its pool does: ``ssh`` options (the
    pool's key and pinned host keys, in its private folder: what ``flotilla ssh`` uses),
    then ``USER@HOST``."""
    by_address = getattr(backend, "pool_login", None)  # the rented clouds'
    if by_address is not None:
        return list(by_address(nodes[rank].ip))
    return backend.ssh_login(paths, spec, nodes, rank)


def keep_login(
    backend: Backend[Any], spec: ProviderSpec, paths: Paths, nodes: list[NodeRecord]
) -> None:
    """Copy each node's login (:func:`pool_login`: the key and known_hosts files it names)
    into the cluster's private ``login`` folder: the pool's own folder goes with its
    client (an orphan cleanup removes it once the grace is over), and a daemon that
    re-attaches must not depend on it."""
    from .._system.private import private_dir

    logins: dict[str, list[str]] = {}
    try:
        folder = private_dir(paths.dir / "login")
        for node in nodes:
            argv = pool_login(backend, spec, paths, nodes, node.node)
            kept: list[str] = []
            for i, word in enumerate(argv):
                if i > 0 and argv[i - 1] == "-i":
                    word = _copy(folder, word, i)
                elif word.startswith(_KNOWN_HOSTS):
                    word = _KNOWN_HOSTS + _copy(folder, word[len(_KNOWN_HOSTS) :], i)
                kept.append(word)
            logins[str(node.node)] = kept
        write_json(folder / LOGINS, logins)
    except (ConfigurationError, OSError) as e:  # the cluster works: it cannot be re-attached
        print(f"the nodes' logins could not be kept for a new daemon: {e}", file=sys.stderr)


_KNOWN_HOSTS = "UserKnownHostsFile="


def _copy(folder: Path, path: str, n: int) -> str:
    """A private copy (0600) of file ``path`` in ``folder``; its path."""
    import shutil

    copy = folder / f"{n}-{os.path.basename(path)}"
    with contextlib.suppress(FileNotFoundError):
        copy.unlink()
    fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as dst, open(path, "rb") as src:
        shutil.copyfileobj(src, dst)
    return str(copy)


def login_for(paths: Paths) -> Callable[[int], list[str]]:
    """How a cloud cluster's node is logged in to again (what :func:`keep_login` kept)."""

    def login(rank: int) -> list[str]:
        logins = read_json(paths.dir / "login" / LOGINS, ConfigurationError)
        if not logins or str(rank) not in logins:
            raise ConfigurationError(f"no login to node {rank} was kept")
        return list(logins[str(rank)])

    return login


class Leases:
    """The leases a cloud cluster's daemon holds on its instances' client identities
    (``cloud.identity.lease``), renewed every ``every`` s to last ``grace`` s more: while
    it runs, and for the grace after it died, no orphan cleanup takes its instances."""

    def __init__(self, clients: list[str], grace: float) -> None:
        self.clients = clients
        self.grace = grace
        self.every = max(1.0, min(30.0, grace / 4))
        self.ended = threading.Event()
        self.renew()
        threading.Thread(target=self._run, name="flotilla-leases", daemon=True).start()

    def renew(self) -> None:
        from .._providers.cloud.identity import lease

        lease(self.clients, self.grace + self.every)

    def _run(self) -> None:
        while not self.ended.wait(self.every):
            self.renew()

    def end(self) -> None:
        """The cluster released its instances: the leases end."""
        from .._providers.cloud.identity import drop_leases

        self.ended.set()
        drop_leases(self.clients)


def hold(provider: Provider, clients: list[str]) -> Leases | None:
    """For a cloud cluster's daemon (``provider``, or the re-attach provider over one):
    add this daemon to the cluster's ``clients`` and hold leases on all of them."""
    from .._providers.cloud.identity import client_id
    from .._providers.reattach import reattaches_over_ssh

    if not reattaches_over_ssh(getattr(provider, "base", provider)):
        return None
    clients.append(client_id())
    return Leases(clients, grace())


def release(
    leases: Leases, reattached: bool, backend: Backend[Any], spec: ProviderSpec, paths: Paths
) -> None:
    """A cloud cluster's pool closed: its leases end. A re-attached one's instances were
    made by a daemon that died, not by its pool: they are removed here, as ``flotilla down``
    removes a dead daemon's (``backend.on_down``), then as orphans (their client is gone
    and nothing holds them now: ``down --orphans``), which also takes the old pool's
    folder; what is said goes to the daemon's log."""
    leases.end()
    if reattached:
        _release_rented(backend, spec, paths)


def abandon(
    provider: Provider, clients: list[str], backend: Backend[Any], spec: ProviderSpec, paths: Paths
) -> None:
    """A re-attach that failed (a node is gone; the others' agents were stopped, see
    :func:`provider`): on a cloud (``provider``), the instances the dead daemon rented are
    released now, as :func:`release` does (the leases on its ``clients`` dropped first),
    so that ``flotilla down`` leaves none rented until the grace ends."""
    from .._providers.cloud.identity import drop_leases
    from .._providers.reattach import reattaches_over_ssh

    if not reattaches_over_ssh(provider) or not clients:
        return
    drop_leases(clients)
    _release_rented(backend, spec, paths)


def _release_rented(backend: Backend[Any], spec: ProviderSpec, paths: Paths) -> None:
    """Remove the instances a cloud cluster's dead daemon rented: as ``flotilla down``
    removes a dead daemon's (``backend.on_down``), then as orphans (``down --orphans``)."""
    from .state import load

    print("releasing the instances the cluster's first daemon rented", file=sys.stderr)
    with contextlib.suppress(Exception):  # (what is left is said, and `down` tries again)
        rec = load(paths)
        if rec is not None:
            backend.on_down(paths, rec)
    try:
        for line in backend.remove_orphans(spec, dry_run=False):
            print(line, file=sys.stderr)
    except Exception as e:
        print(f"could not release the cluster's instances: {e}", file=sys.stderr)


def stop_refusal(rec: ClusterRecord) -> str:
    """Why ``flotilla stop`` cannot stop a cloud cluster ('' when it can): a daemon that
    re-attached to its instances can release them, not stop and start them again."""
    if len(rec.clients) > 1:
        return "its daemon died and another re-attached to its instances, which it can only release"
    return ""
