"""The rented clouds of the cloud kit whose clusters had no re-attach test of their own
(Vast.ai, Compute Engine, Lambda Cloud, Verda): a cluster whose daemon died (kill -9)
while its instances ran is re-attached to by ``flotilla start``, nothing is rented again,
its job's output goes on, and ``down`` then deletes the instances (and the first daemon's
pool folder on this machine, its keys).

Each market's stand-in (``_vast``, ``_gcp``, ``_lambda``, ``_verda``, the same fixtures
their CLI tests use); root only. The job ticks until a file the test writes on each node
appears, so the test waits on what it printed, never on time. The stand-in's API is the
judge: how many instances were ever asked for, which are listed, and who deleted them
("account": the client's key, as ``down`` does; "self": an instance's own watchdog).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _gcp import GcpLab, gcp_lab_fixture  # noqa: F401 - the gcp_lab fixture
from _lambda import LambdaLab, lambda_lab_fixture  # noqa: F401 - the lambda_lab fixture
from _procs import wait_until
from _standin import key_folders
from _vast import VastLab, vast_lab_fixture  # noqa: F401 - the vast_lab fixture
from _verda import VerdaLab, verda_fixture, verda_lab_fixture  # noqa: F401 - the fixtures
from test_cli import CLI
from test_cli import cli as cli  # the fixture
from test_reattach import kill_daemon, last_tick, read, start_ticking

from flotilla.cli.state import ClusterState, JobStatus

# A launch, a start and a down each wait up to 300 s on a busy machine: longer than
# pytest-timeout's 120 s default.
pytestmark = pytest.mark.timeout(600)


@dataclass(frozen=True)
class Market:
    """What differs between the markets: the lab's fixture, what it offers, the task, and
    how its API tells the instances asked for, listed, and who deleted them."""

    name: str
    fixture: str
    offer: Callable[[Any], None]
    resources: str
    asked: Callable[[Any], int]
    """How many instances were ever asked of the lab (rented, inserted, launched, created)."""
    ids: Callable[[Any], set[str]]
    """The instances the lab lists (not deleted)."""
    deleted_by: Callable[[Any], dict[str, str]]
    """Deleted instance -> "account" | "self"."""
    flags: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.name


def _vast_asked(lab: VastLab) -> int:
    return sum(1 for method, path in lab.requests if method == "PUT" and "/asks/" in path)


MARKETS = [
    Market(
        "vast",
        "vast_lab",
        lambda lab: lab.add_machines(2, cluster_id=3, dph_total=1.25),
        "  infra: vast\n  cpus: 4\n",
        _vast_asked,
        lambda lab: {str(i.id) for i in lab.live()},
        lambda lab: {str(k): v for k, v in lab.destroyed.items()},
    ),
    Market(
        "gcp",
        "gcp_lab",
        lambda lab: None,
        "  infra: gcp/us-central1/us-central1-b\n  cpus: 4\nconfig:\n  gcp:\n    ssh_user: root\n",
        lambda lab: len(lab.made),
        lambda lab: {i.name for i in lab.live()},
        lambda lab: dict(lab.destroyed),
    ),
    Market(
        "lambda",
        "lambda_lab",
        lambda lab: lab.add_type(
            "gpu_1x_a10", "A10 (24 GB PCIe)", 1, 75, capacity={"us-west-1": 2}
        ),
        "  infra: lambda/us-west-1\n  accelerators: A10:1\n",
        lambda lab: sum(int(b.get("quantity") or 1) for b in lab.launches),
        lambda lab: {i.id for i in lab.live()},
        lambda lab: dict(lab.terminated),
        ("--lambda-ssh-user", "root"),
    ),
    Market(
        "verda",
        "verda",
        lambda lab: lab.add_type("1A100.22V", "A100 SXM4 80GB", 1, 1.29, capacity={"FIN-02": 2}),
        "  infra: verda/FIN-02\n  accelerators: A100:1\n",
        lambda lab: len(lab.creates),
        lambda lab: {i.id for i in lab.live()},
        lambda lab: dict(lab.deleted),
    ),
]


@pytest.mark.parametrize("market", MARKETS, ids=str)
def test_a_market_clusters_instances_are_re_attached_and_down_deletes_them(
    cli: CLI, market: Market, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    lab = request.getfixturevalue(market.fixture)
    market.offer(lab)
    cli.env.update(lab.env)
    task = cli.task("up.yaml", f"num_nodes: 2\nresources:\n{market.resources}run: echo up\n")
    cli.ok("launch", task, "-c", "rm", *market.flags, timeout=300)
    before = cli.record("rm")
    assert before is not None
    ids, asked = market.ids(lab), market.asked(lab)
    assert len(ids) == 2 and asked == 2, (ids, asked)
    agents = [n.agent_pid for n in before.nodes]
    assert key_folders(before.clients), before.clients  # the first daemon's pool's
    # on each instance's own file system (some share this machine's /tmp: one file then)
    stop = Path(f"/tmp/flotilla-stop-{tmp_path.name}")
    try:
        log = start_ticking(cli, "rm", stop)
        kill_daemon(cli, "rm")
        # its instances are held for the grace: an orphan cleanup leaves them
        cli.ok("down", "--orphans", "--provider", market.name)
        assert market.ids(lab) == ids and market.deleted_by(lab).keys().isdisjoint(ids)
        seen = {r: last_tick(read(log), r) for r in (0, 1)}

        started = cli.ok("start", "rm", timeout=300)
        assert "re-attached to its 2 node(s)" in started.stderr, started.stderr
        after = cli.record("rm")
        assert after is not None and after.observed_state() is ClusterState.UP
        assert [n.agent_pid for n in after.nodes] == agents  # the same agents
        assert market.ids(lab) == ids and market.asked(lab) == asked  # nothing rented again
        assert wait_until(lambda: all(last_tick(read(log), r) > seen[r] + 2 for r in (0, 1)), 60)
        for rank in (0, 1):
            cli.ok("ssh", "rm", "--node", str(rank), "--", f"touch {stop}")
        job = after.jobs[-1]
        followed = cli.ok("logs", "rm", str(job.id))
        assert "done-0" in followed.stdout and "done-1" in followed.stdout, followed.stdout
        done = cli.record("rm")
        assert done is not None and done.job(job.id).status == JobStatus.SUCCEEDED.value  # type: ignore[union-attr]

        cli.ok("down", "rm", timeout=300)
        assert wait_until(lambda: market.ids(lab).isdisjoint(ids), 60), market.ids(lab)
        by = market.deleted_by(lab)
        assert {by[i] for i in ids} == {"account"}  # by down, not by their watchdogs
        assert market.asked(lab) == asked
        assert key_folders(before.clients) == []  # nothing of the pool's left in /tmp
    finally:
        stop.unlink(missing_ok=True)


def test_a_gone_instance_is_said_and_down_deletes_the_other_at_once(
    cli: CLI, vast_lab: VastLab
) -> None:
    """One instance of the cluster went away while its daemon was dead (the market took
    the machine back): ``start`` names the node that is gone and fails, and the other
    instance is deleted with the account's key (the re-attach stopped its agent): none
    stays rented until its watchdog ends it at the grace's end (600 s). One market is
    enough: this is the cloud kit's path, shared by the four."""
    market = MARKETS[0]
    market.offer(vast_lab)
    cli.env.update(vast_lab.env)
    task = cli.task("up.yaml", f"num_nodes: 2\nresources:\n{market.resources}run: echo up\n")
    cli.ok("launch", task, "-c", "rg", timeout=300)
    rec = cli.record("rg")
    assert rec is not None and key_folders(rec.clients)
    (overlay,) = vast_lab.overlays.values()
    (gone,) = [i for i in vast_lab.live() if overlay.members[i.id] == rec.nodes[1].ip]
    (other,) = [i for i in vast_lab.live() if i is not gone]
    kill_daemon(cli, "rg")
    vast_lab.destroy(gone, "market")

    refused = cli("start", "rg", timeout=300)
    assert refused.returncode != 0, refused.stderr
    assert f"node 1 ({rec.nodes[1].host}) is gone" in refused.stderr, refused.stderr
    failed = cli.record("rg")
    assert failed is not None and failed.observed_state() is ClusterState.FAILED
    assert wait_until(lambda: vast_lab.live() == [], 60), [i.id for i in vast_lab.live()]
    assert vast_lab.destroyed[other.id] == "account"  # released, not by its watchdog
    cli.ok("down", "rg", timeout=300)
    assert cli.record("rg") is None and market.asked(vast_lab) == 2
    assert key_folders(rec.clients) == []  # nothing of the pool's left in /tmp
