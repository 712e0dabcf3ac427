"""Fallback across providers: a pool tries Vast (the stand-in, ``_vast.py``) and AWS (the
moto lab, ``_aws.py``) in turn; ``allocation="cheapest"``; ``max_hourly_cost``."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _aws import AwsLab, aws_lab_fixture, aws_shared_lab_fixture  # noqa: F401
from _procs import wait_until
from _vast import VastLab, vast_lab_fixture  # noqa: F401 - the vast_lab fixture
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture

import flotilla as sky
from flotilla._errors import ConfigurationError, ProvisionError


@sky.function
def where() -> str:
    import socket

    return socket.gethostname()


@pytest.fixture(name="labs")
def labs_fixture(vast_lab: VastLab, aws_lab: AwsLab) -> Iterator[tuple[VastLab, AwsLab]]:
    yield vast_lab, aws_lab


def _rented(vast: VastLab) -> int:
    return sum(1 for method, path in vast.requests if method == "PUT" and "/asks/" in path)


def test_vast_without_capacity_falls_back_to_aws(
    labs: tuple[VastLab, AwsLab], capfd: pytest.CaptureFixture[str]
) -> None:
    vast, aws = labs
    vast.add_machines(1, cluster_id=1)  # one machine: not enough for 2 nodes
    with sky.Compute(provider=[sky.VastAI(), aws.provider()], nodes=2) as pool:
        hosts = where() @ pool
        chosen = pool.provider.chosen  # type: ignore[attr-defined]
    assert type(chosen).__name__ == "AWS" and all(h.startswith("ip-") for h in hosts)
    err = capfd.readouterr().err
    failed = err.index("candidate VastAI(")
    assert "failed: Vast has 1 machine(s)" in err or "no physical cluster" in err, err
    assert failed < err.index("chose AWS(") and "for 2 node(s), " in err
    assert _rented(vast) == 0 and vast.live() == []


def test_max_hourly_cost_skips_an_expensive_candidate(
    labs: tuple[VastLab, AwsLab], capfd: pytest.CaptureFixture[str]
) -> None:
    vast, aws = labs
    vast.add_machines(2, cluster_id=1, dph_total=5.0)
    with sky.Compute(provider=[sky.VastAI(), aws.provider()], nodes=1, max_hourly_cost=2.0) as pool:
        assert type(pool.provider.chosen).__name__ == "AWS"  # type: ignore[attr-defined]
    err = capfd.readouterr().err
    assert "above max_hourly_cost=$2.00/h" in err
    assert _rented(vast) == 0


def test_cheapest_first(labs: tuple[VastLab, AwsLab], capfd: pytest.CaptureFixture[str]) -> None:
    """AWS first in the list, but its price is unknown on the lab: Vast, priced, goes
    first with allocation="cheapest"."""
    vast, aws = labs
    vast.add_machines(1, dph_total=0.7)
    with sky.Compute(
        provider=[aws.provider(allocation="on-demand"), sky.VastAI()],
        nodes=1,
        options=sky.Options(cluster=False),
        allocation="cheapest",
    ) as pool:
        assert type(pool.provider.chosen).__name__ == "VastAI"  # type: ignore[attr-defined]
    assert (
        "chose VastAI(" in capfd.readouterr().err
        and "$0.70/h" in capfd.readouterr().err + "$0.70/h"
    )
    assert vast.live() == []


def test_nothing_can_start_the_pool(labs: tuple[VastLab, AwsLab]) -> None:
    _, aws = labs
    aws.fail_launches("InsufficientInstanceCapacity")
    try:
        with pytest.raises(ProvisionError, match="no provider could start the pool") as info:
            sky.Compute(provider=[sky.VastAI(), aws.provider()], nodes=1).open()
    finally:
        aws.clear_faults()
    assert "VastAI(" in str(info.value) and "AWS(" in str(info.value)
    assert "InsufficientInstanceCapacity" in str(info.value)


def test_bad_lists_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="at least one provider"):
        sky.Compute(provider=[])
    with pytest.raises(ConfigurationError, match="allocation="):
        sky.Compute(provider=[sky.Local()], allocation="random")


ANY_OF = """\
num_nodes: 2
resources:
  cpus: 2
  any_of:
    - infra: vast
    - infra: aws/us-east-1
run: echo "RUN $SKYPILOT_NODE_RANK $(hostname)"
"""


def test_task_file_any_of_falls_back_from_vast_to_aws(
    cli: CLI, labs: tuple[VastLab, AwsLab]
) -> None:
    from test_cli_aws import _lab_flags

    vast, aws = labs
    vast.add_machines(1, cluster_id=1)  # not enough for 2 nodes
    cli.env.update(vast.env)
    cli.env.update(aws.env)
    task = cli.task("job.yaml", ANY_OF)
    done = cli.ok("launch", task, "-c", "anyof", *_lab_flags(aws), timeout=300)
    lines = node_lines(done.stdout, "RUN")
    assert sorted(lines) == [0, 1] and all(" ip-" in f" {v}" for v in lines.values()), lines
    assert "candidate VastAI(" in done.stderr and "chose AWS(" in done.stderr, done.stderr
    assert vast.live() == [] and _rented(vast) == 0
    status = cli.ok("status").stdout
    assert "anyof" in status
    # the chosen candidate's ssh_config entries (AWS's pinned login): plain ssh reaches node 1
    config = cli.home / "ssh" / "anyof.config"
    plain = subprocess.run(
        ["ssh", "-F", str(config), "-o", "BatchMode=yes", "anyof-worker1", "hostname"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.stdout.strip() == lines[1].split()[1], plain.stderr
    cli.ok("down", "anyof", "-y", timeout=120)


def test_the_candidate_chosen_defines_the_jobs_gpus(cli: CLI, labs: tuple[VastLab, AwsLab]) -> None:
    """Issue 43: Vast (A100:1) has no capacity, AWS (an image, no accelerators) starts the
    instance: the job asks that node for no GPU (SkyPilot's semantics: the candidate
    chosen defines the resources), where it used to fail for the first candidate's A100."""
    from test_cli_aws import _lab_flags

    vast, aws = labs
    cli.env.update(vast.env)
    cli.env.update(aws.env)
    task = cli.task(
        "job.yaml",
        f"""\
        resources:
          any_of:
            - {{infra: vast, accelerators: A100:1}}
            - {{infra: aws/us-east-1, image_id: {aws.ami}}}
        run: echo "GPUS $SKYPILOT_NUM_GPUS_PER_NODE $(hostname)"
        """,
    )
    done = cli.ok("launch", "--down", task, "-c", "chosen", *_lab_flags(aws), timeout=300)
    assert "chose AWS(" in done.stderr, done.stderr
    gpus, host = node_lines(done.stdout, "GPUS")[0].split()
    assert gpus == "0" and host.startswith("ip-"), done.stdout
    assert vast.live() == [] and _rented(vast) == 0


def test_a_later_candidate_with_other_gpus_gets_its_own_count(
    cli: CLI, vast_lab: VastLab, tmp_path: Path
) -> None:
    """``ordered``: Vast (A100:1, no capacity), then this machine with T4:2 (listed by a
    stand-in nvidia-smi): the job gets 2 GPUs per node (SKYPILOT_NUM_GPUS_PER_NODE, the
    GPU check, the hostfile's slots), not the first candidate's 1."""
    from test_node_gpus import TWO_T4, stand_in_nvidia_smi

    cli.env.update(vast_lab.env)
    cli.env["PATH"] = stand_in_nvidia_smi(tmp_path / "bin", TWO_T4)
    task = cli.task(
        "job.yaml",
        """\
        resources:
          cpus: 1
          ordered:
            - {infra: vast, accelerators: A100:1}
            - {accelerators: T4:2}         # no infra: the default, this machine
        run: echo "GPUS $SKYPILOT_NUM_GPUS_PER_NODE"; cat "$FLOTILLA_HOSTFILE"
        """,
    )
    done = cli.ok("launch", "--down", task, "-c", "later")
    assert "candidate VastAI(" in done.stderr and "chose Local(" in done.stderr, done.stderr
    assert node_lines(done.stdout, "GPUS") == {0: "2"}
    assert " slots=2" in done.stdout, done.stdout
    assert vast_lab.live() == [] and _rented(vast_lab) == 0


@sky.function
def accelerators() -> tuple[float, str | None]:
    info = sky.instance_info()
    return info.accelerators, info.accelerator


def test_a_python_candidates_accelerator_is_what_instance_info_reports(
    vast_lab: VastLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Candidate(..., accelerator="T4:2")`` chosen after Vast (no capacity): the node's
    ``instance_info()`` reports the candidate's 2 T4s, not the pool's A100."""
    from test_node_gpus import TWO_T4, stand_in_nvidia_smi

    monkeypatch.setenv("PATH", stand_in_nvidia_smi(tmp_path / "bin", TWO_T4))
    with sky.Compute(
        provider=[sky.Candidate(sky.VastAI()), sky.Candidate(sky.Local(), accelerator="T4:2")],
        accelerator="A100:1",
        nodes=1,
    ) as pool:
        assert type(pool.provider.chosen.provider).__name__ == "Local"  # type: ignore[attr-defined]
        got = accelerators() @ pool
    assert got == [(2, "T4")]
    assert vast_lab.live() == [] and _rented(vast_lab) == 0


def _parse(tmp_path: Path, text: str) -> Any:
    from flotilla.cli.taskfile import load_task

    path = tmp_path / "t.yaml"
    path.write_text(text)
    return load_task(str(path))


def test_task_file_candidates_parse(tmp_path: Path) -> None:
    task = _parse(
        tmp_path, "resources:\n  cpus: 4\n  accelerators: {A100: 8, H100: 8}\nrun: 'true'\n"
    )
    assert [c.accelerators for c in task.resources.candidates] == ["A100:8", "H100:8"]
    assert task.resources.ordered is False and {c.cpus for c in task.resources.candidates} == {"4"}
    task = _parse(
        tmp_path,
        "resources:\n  ordered:\n    - {infra: vast, accelerators: H100:8}\n"
        "    - {infra: aws}\nrun: 'true'\n",
    )
    assert [(c.infra, c.accelerators) for c in task.resources.candidates] == [
        ("vast", "H100:8"),
        ("aws", None),
    ]
    assert task.resources.ordered is True
    task = _parse(  # SkyPilot's merge: over the top level; labels added to its labels
        tmp_path,
        "resources:\n  cpus: 4\n  accelerators: A100:1\n  labels: {team: ml, tier: a}\n"
        "  any_of:\n    - {infra: vast}\n    - {infra: aws, accelerators: T4:2, labels: "
        "{tier: b}}\nrun: 'true'\n",
    )
    assert [
        (c.infra, c.cpus, c.accelerators, dict(c.labels)) for c in task.resources.candidates
    ] == [
        ("vast", "4", "A100:1", {"team": "ml", "tier": "a"}),
        ("aws", "4", "T4:2", {"team": "ml", "tier": "b"}),
    ]


MANAGED = """\
    name: resumable
    num_nodes: 2
    resources:
      job_recovery: EAGER_NEXT_REGION
      ordered:
        - infra: vast
        - infra: aws/us-east-1
    run: |
      echo "$(hostname)" >> $CKPT/hosts-$SKYPILOT_NODE_RANK
      if [ ! -e $CKPT/step-$SKYPILOT_NODE_RANK ]; then
        echo 1 > $CKPT/step-$SKYPILOT_NODE_RANK
        echo $$ > $CKPT/pid-$SKYPILOT_NODE_RANK
        exec sleep 300                                # works until its node is lost
      fi
      echo "rank $SKYPILOT_NODE_RANK resumed"
"""


@pytest.mark.timeout(300)
def test_a_managed_job_recovers_on_the_next_candidate(
    labs: tuple[VastLab, AwsLab], tmp_path: Path
) -> None:
    """EAGER_NEXT_REGION on a fallback cluster: the job first runs on Vast; when a node is
    lost the cluster is relaunched on the next candidate (AWS) first."""
    from test_cli_aws import _lab_flags
    from test_managed import Jobs, agent_above, assert_nothing_left

    vast, aws = labs
    vast.add_machines(2, cluster_id=1)
    jobs = Jobs(tmp_path)
    jobs.env.update(vast.env)
    jobs.env.update(aws.env)
    task = jobs.task("job.yaml", MANAGED)
    launch = jobs.popen("launch", task, "--env", f"CKPT={jobs.ckpt}", *_lab_flags(aws))
    try:
        pid_files = [jobs.ckpt / "pid-0", jobs.ckpt / "pid-1"]
        assert wait_until(
            lambda: all(p.exists() and p.read_text().strip() for p in pid_files), 120
        ), "the ranks never started"
        assert len(vast.live()) == 2
        os.kill(agent_above(int(pid_files[1].read_text())), signal.SIGKILL)
        out, err = launch.communicate(timeout=240)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    assert launch.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "recovering on the candidate after VastAI(" in err, err
    for rank in (0, 1):
        first, second = (jobs.ckpt / f"hosts-{rank}").read_text().split()
        assert first.startswith("C.") and second.startswith("ip-"), (first, second)
        assert f"rank {rank} resumed" in out
    assert vast.wait_gone(30) == []
    assert_nothing_left(jobs)
