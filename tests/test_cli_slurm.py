"""``flotilla`` on a real SLURM cluster (``--provider slurm``, ``infra: slurm/<partition>``):
the CLI runs as a subprocess against the test cluster of ``_slurm`` (root only)."""

from __future__ import annotations

from pathlib import Path

from _slurm import SHORT_PARTITION, SlurmCluster, slurm_cluster_fixture  # noqa: F401
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture
from test_cli_files import copy_check
from test_reattach import check_ends_after_the_grace, check_survives_its_daemon

TASK = """\
num_nodes: 3
setup: echo "SETUP $(hostname) $SKYPILOT_NODE_RANK"
run: |
  IPS=$(echo $SKYPILOT_NODE_IPS)
  echo "RUN $SKYPILOT_NODE_RANK $(hostname) $SKYPILOT_NUM_NODES $IPS $MASTER_ADDR $SLURM_JOB_ID"
"""


def _flotilla_jobs(cluster: SlurmCluster) -> list[str]:
    return [j for j in cluster.jobs() if j.split()[1].startswith("flotilla-")]


def test_task_file_with_provider_slurm_runs_setup_then_run_on_3_nodes(
    cli: CLI, slurm_cluster: SlurmCluster
) -> None:
    cli.env["SLURM_CONF"] = str(slurm_cluster.conf)
    task = cli.task("job.yaml", TASK)
    done = cli.ok("launch", task, "-c", "hpc", "--provider", "slurm", "--time", "30:00")
    jobs = _flotilla_jobs(slurm_cluster)
    assert len(jobs) == 1 and jobs[0].split()[2] == "RUNNING", jobs
    job_id = jobs[0].split()[0]
    addrs = [slurm_cluster.node_addr(i) for i in (1, 2, 3)]
    ips = " ".join(addrs)
    assert node_lines(done.stdout, "SETUP") == {r: f"n{r + 1} {r}" for r in range(3)}
    assert node_lines(done.stdout, "RUN") == {
        r: f"{r} n{r + 1} 3 {ips} {addrs[0]} {job_id}" for r in range(3)
    }
    first_run = done.stdout.index("RUN ")
    assert all(done.stdout.index(f"SETUP n{r + 1}") < first_run for r in range(3))
    shown = slurm_cluster.slurm("scontrol", "-o", "show", "job", job_id).stdout
    assert "TimeLimit=00:30:00" in shown
    # exec and logs on the same job
    again = cli.ok("exec", "hpc", "echo AGAIN $SKYPILOT_NODE_RANK $(hostname)")
    assert node_lines(again.stdout, "AGAIN") == {r: f"{r} n{r + 1}" for r in range(3)}
    # no ssh between SLURM nodes: from node 0, srun reaches every node of the allocation
    fan = "srun --overlap -N 3 --ntasks-per-node=1 hostname | sort | paste -sd,"
    spread = cli.ok("exec", "hpc", "--nodes", "1", f'echo "SRUN $({fan})"')
    assert node_lines(spread.stdout, "SRUN") == {0: "n1,n2,n3"}, spread.stderr
    logs = cli.ok("logs", "hpc", "1")
    assert node_lines(logs.stdout, "RUN") == node_lines(done.stdout, "RUN")
    # flotilla ssh: a step of the job on node K, in the node's working directory
    rec = cli.record("hpc")
    assert rec is not None
    shell = cli.ok("ssh", "hpc", "--node", "2", "--", "echo $(hostname) $SLURM_JOB_ID $PWD")
    assert shell.stdout.split() == ["n3", job_id, rec.nodes[2].workdir]
    copy_check(cli, "hpc", 2, cli.cwd / "copies")  # cp through srun into the job
    cli.ok("down", "hpc")
    assert _flotilla_jobs(slurm_cluster) == []


def test_infra_slurm_partition_and_resources_from_the_task_file(
    cli: CLI, slurm_cluster: SlurmCluster
) -> None:
    """``infra: slurm/<partition>`` chooses the backend and the partition; ``cpus`` and
    ``memory`` become --cpus-per-task and --mem. ``launch --down`` leaves an empty queue."""
    cli.env["SLURM_CONF"] = str(slurm_cluster.conf)
    task = cli.task(
        "short.yaml",
        f"""\
        num_nodes: 2
        resources:
          infra: slurm/{SHORT_PARTITION}
          cpus: 2
          memory: 0.5
        run: scontrol -o show job $SLURM_JOB_ID
        """,
    )
    done = cli.ok("launch", task, "-c", "short", "--down")
    assert "warning" not in done.stderr
    assert f"Partition={SHORT_PARTITION}" in done.stdout
    assert "MinCPUsNode=2" in done.stdout and "MinMemoryNode=512M" in done.stdout
    assert _flotilla_jobs(slurm_cluster) == []
    assert cli.record("short") is None


def test_bad_slurm_time_is_refused_before_anything_starts(cli: CLI, tmp_path: Path) -> None:
    done = cli("launch", "echo hi", "-c", "bad", "--provider", "slurm", "--time", "UNLIMITED")
    assert done.returncode != 0
    assert "unlimited time" in done.stderr
    assert cli.record("bad") is None


def test_a_slurm_cluster_outlives_its_killed_daemon_and_is_re_attached(
    cli: CLI, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The job stays allocated while the agents wait (each agent's srun holds the holder's
    stdin); `start` re-attaches through steps of the same job; `down` ends the job."""
    cli.env["SLURM_CONF"] = str(slurm_cluster.conf)
    flags = ["--provider", "slurm", "--time", "30:00"]
    check_survives_its_daemon(
        cli, "sra", flags, tmp_path / "stop", lambda: _flotilla_jobs(slurm_cluster)
    )


def test_a_slurm_cluster_nobody_re_attaches_to_is_released_after_the_grace(
    cli: CLI, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    cli.env["SLURM_CONF"] = str(slurm_cluster.conf)
    flags = ["--provider", "slurm", "--time", "30:00"]
    check_ends_after_the_grace(
        cli, "srg", flags, tmp_path / "stop", lambda: _flotilla_jobs(slurm_cluster)
    )
