"""``flotilla`` with ``--provider container`` on the podman lab of ``_container`` (root
only): a cluster of containers from the command line, ``flotilla ssh`` into one, and
``down --orphans --provider container`` removing what a killed client left. Every flag is
derived from ``ContainerSettings`` (``--container-FIELD``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _container import (  # noqa: F401 - the fixtures
    ContainerLab,
    container_lab_fixture,
    no_netns_left,
)
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture
from test_cli_files import copy_check
from test_container import _killed_client
from test_reattach import check_ends_after_the_grace, check_survives_its_daemon


def _engine_flags(lab: ContainerLab) -> list[str]:
    """The flags that make the lab's podman work here (``=``: the values start with -)."""
    flags = ["--provider", "container", "--container-binary", "podman"]
    if lab.binary_args:
        flags.append(f"--container-binary-args={' '.join(lab.binary_args)}")
    return flags


@pytest.mark.timeout(300)
def test_a_container_cluster_from_the_command_line(cli: CLI, container_lab: ContainerLab) -> None:
    lab = container_lab
    flags = [
        *_engine_flags(lab),
        "--container-rootfs",
        str(lab.rootfs),
        "--container-python",
        lab.python,
        f"--container-volumes={' '.join(lab.volumes)}",
    ]
    if lab.run_args:
        flags.append(f"--container-run-args={' '.join(lab.run_args)}")
    done = cli.ok(
        "launch", "echo RUN $SKYPILOT_NODE_RANK $HOSTNAME", "-c", "box", "--nodes", "2", *flags,
        timeout=240,
    )  # fmt: skip
    ran = node_lines(done.stdout, "RUN")
    assert sorted(ran) == [0, 1], done.stdout
    names = {rank: line.split()[1] for rank, line in ran.items()}
    assert set(names.values()) <= set(lab.containers())  # each node is a container of the lab
    shell = cli.ok("ssh", "box", "--node", "1", "--", "echo $HOSTNAME")
    assert shell.stdout.split() == [names[1]]
    copy_check(cli, "box", 1, cli.cwd / "copies")  # cp through podman/docker exec
    cli.ok("down", "box")
    assert not set(names.values()) & set(lab.containers())


@pytest.mark.timeout(300)
def test_down_orphans_provider_container_removes_a_killed_clients_pool(
    cli: CLI, container_lab: ContainerLab
) -> None:
    pool_id = _killed_client(container_lab, janitor_too=True)
    left = container_lab.containers(pool_id)
    assert len(left) == 2
    flags = _engine_flags(container_lab)
    listed = cli.ok("down", "--orphans", *flags, "--dry-run")
    said = listed.stdout + listed.stderr
    assert pool_id in said and "would remove" in said and all(c in said for c in left), said
    assert container_lab.containers(pool_id) == left  # a dry run removes nothing
    done = cli.ok("down", "--orphans", *flags)
    removed = next(line for line in done.stderr.splitlines() if "removed" in line)
    assert all(c in removed for c in left), done.stderr
    assert container_lab.containers(pool_id) == []
    assert f"flotilla-{pool_id}" not in container_lab.networks()


def _cluster_flags(lab: ContainerLab, shared: Path) -> list[str]:
    """A cluster of the lab's containers that see ``shared`` (read-write)."""
    flags = [
        *_engine_flags(lab),
        "--container-rootfs",
        str(lab.rootfs),
        "--container-python",
        lab.python,
        f"--container-volumes={' '.join([*lab.volumes, f'{shared}:{shared}'])}",
    ]
    if lab.run_args:
        flags.append(f"--container-run-args={' '.join(lab.run_args)}")
    return flags


@pytest.mark.timeout(420)
def test_a_container_cluster_outlives_its_killed_daemon_and_is_re_attached(
    cli: CLI, container_lab: ContainerLab, tmp_path: Path
) -> None:
    """The janitor waits while the agents do (each agent's exec holds its stdin); `start`
    re-attaches through exec into the same containers; `down` removes them."""
    before = set(container_lab.containers())

    def held() -> list[str]:
        return sorted(set(container_lab.containers()) - before)

    flags = _cluster_flags(container_lab, tmp_path)
    check_survives_its_daemon(cli, "boxa", flags, tmp_path / "stop", held)


@pytest.mark.timeout(420)
def test_a_container_cluster_nobody_re_attaches_to_is_removed_after_the_grace(
    cli: CLI, container_lab: ContainerLab, tmp_path: Path
) -> None:
    before = set(container_lab.containers())

    def held() -> list[str]:
        return sorted(set(container_lab.containers()) - before)

    flags = _cluster_flags(container_lab, tmp_path)
    check_ends_after_the_grace(cli, "boxg", flags, tmp_path / "stop", held)
