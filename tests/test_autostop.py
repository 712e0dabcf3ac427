"""``flotilla autostop`` on running clusters and the task file's ``resources.autostop``
(SkyPilot's forms), on real local clusters."""

from __future__ import annotations

from pathlib import Path

import pytest
from _procs import assert_all_gone, processes_in, wait_until
from test_cli import CLI
from test_cli import cli as cli  # the fixture

from flotilla.cli.state import ClusterState, all_names
from flotilla.cli.taskfile import Autostop, TaskError, load_task


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("true", Autostop(5.0)),
        ("false", None),
        ("10", Autostop(10.0)),
        ("10m", Autostop(10.0)),
        ("2h", Autostop(120.0)),
        ("1d", Autostop(1440.0)),
        ("{idle_minutes: 10, down: true}", Autostop(10.0, down=True)),
        ("{down: true}", Autostop(5.0, down=True)),
        ("{idle_minutes: 3, wait_for: jobs}", Autostop(3.0)),
    ],
)
def test_resources_autostop_takes_skypilots_forms(
    tmp_path: Path, value: str, expected: Autostop | None
) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(f"run: echo hi\nresources:\n  autostop: {value}\n")
    assert load_task(str(path)).resources.autostop == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("ten", "`resources.autostop` must be true, false, minutes"),
        ("-5", "`resources.autostop` must be true, false, minutes"),
        ("{idle_minutes: 5, dwon: true}", "unknown field 'dwon'"),
        ("{down: yes please}", "`resources.autostop.down` must be true or false"),
        ("{wait_for: jobs_and_ssh}", "flotilla counts jobs only"),
    ],
)
def test_a_bad_autostop_names_the_line(tmp_path: Path, value: str, message: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(f"run: echo hi\nresources:\n  autostop: {value}\n")
    with pytest.raises(TaskError) as info:
        load_task(str(path))
    assert str(info.value).startswith(f"{path}:3: ") and message in str(info.value)


@pytest.mark.timeout(120)
def test_autostop_down_on_a_running_cluster_tears_it_down_when_idle(cli: CLI) -> None:
    cli.ok("launch", "echo up", "-c", "idle")
    rec = cli.record("idle")
    assert rec is not None and rec.idle_minutes is None
    done = cli.ok("autostop", "idle", "-i", "0.02", "--down")  # 1.2 s without jobs
    assert "cluster idle: torn down after 0.02 minute(s) without jobs, from now" in done.stderr
    assert wait_until(lambda: "idle" not in all_names(cli.home), 60)
    assert_all_gone([rec.pid, *(n.agent_pid for n in rec.nodes)], 30, "daemon and agents")
    assert wait_until(lambda: not processes_in(cli.home), 30)


@pytest.mark.timeout(120)
def test_autostop_stops_and_cancel_removes_the_limit(cli: CLI) -> None:
    cli.ok("launch", "echo up", "-c", "keep")
    cli.ok("autostop", "keep", "-i", "30")
    rec = cli.record("keep")
    assert rec is not None and (rec.idle_minutes, rec.autodown) == (30, False)
    cancelled = cli.ok("autostop", "keep", "--cancel")
    assert "autostop cancelled" in cancelled.stderr
    rec = cli.record("keep")
    assert rec is not None and rec.idle_minutes is None
    cli.ok("autostop", "keep", "-i", "0.02")  # stopped, not removed
    assert wait_until(
        lambda: (
            (r := cli.record("keep")) is not None and r.observed_state() is ClusterState.STOPPED
        ),
        60,
    )
    refused = cli("autostop", "keep", "--cancel", "-i", "3")
    assert refused.returncode == 2 and "give --cancel alone" in refused.stderr


@pytest.mark.timeout(120)
def test_a_tasks_autostop_applies_at_launch(cli: CLI) -> None:
    task = cli.task(
        "auto.yaml",
        """\
        resources:
          autostop:
            idle_minutes: 0.02
            down: true
        run: echo ran
        """,
    )
    done = cli.ok("launch", task, "-c", "auto")
    assert "ran" in done.stdout
    # without the task's autostop the cluster would stay up until `flotilla down`
    assert wait_until(lambda: "auto" not in all_names(cli.home), 60)
    assert wait_until(lambda: not processes_in(cli.home), 30)
