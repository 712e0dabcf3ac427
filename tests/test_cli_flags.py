"""SkyPilot's flags on ``launch`` and ``exec`` (issue 40 item 3): ``--infra``,
``--use-spot``, ``--gpus/--cpus/--memory`` on launch, ``--env-file``, ``--workdir``,
``--dryrun`` on exec, ``--yes``; the task file's ``resources.max_hourly_cost``. The CLI
runs as a subprocess on real local clusters; ``--dryrun`` starts nothing."""

from __future__ import annotations

import json
from pathlib import Path

from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture

from flotilla.cli.state import all_names


def test_launch_infra_use_spot_and_resources_flags_choose_and_size(cli: CLI) -> None:
    task = cli.task("t.yaml", "resources:\n  accelerators: V100:1\nrun: echo hi\n")
    plan = json.loads(
        cli.ok(
            "launch", task, "-c", "x", "--dryrun", "--json", "--infra", "aws/eu-west-1",
            "--use-spot", "--gpus", "A100:2", "--cpus", "8", "--memory", "32", "--yes",
        ).stdout
    )  # fmt: skip
    assert (plan["provider"], plan["settings"]["region"]) == ("aws", "eu-west-1")
    assert plan["settings"]["allocation"] == "spot"
    assert plan["per_node"] == {"accelerator": "A100:2", "vcpus": 8.0, "memory_gb": 32.0}
    plan = json.loads(
        cli.ok("launch", task, "--dryrun", "--json", "--infra", "aws", "--no-use-spot").stdout
    )
    assert plan["settings"]["allocation"] == "on-demand"
    assert plan["per_node"]["accelerator"] == "V100:1"  # the task's, no --gpus
    done = cli("launch", task, "--dryrun", "--infra", "/x")
    assert done.returncode == 2 and "--infra '/x': give a provider" in done.stderr
    assert all_names(cli.home) == []


def test_max_hourly_cost_is_a_task_field(cli: CLI) -> None:
    task = cli.task(
        "t.yaml",
        "resources:\n  infra: aws\n  max_hourly_cost: 2.5\n  max_node_hourly_cost: 1.5\n"
        "run: echo hi\n",
    )
    plan = json.loads(cli.ok("launch", task, "--dryrun", "--json").stdout)
    assert plan["max_hourly_cost"] == 2.5 and plan["max_node_hourly_cost"] == 1.5
    shown = cli.ok("launch", task, "--dryrun").stdout
    assert "at most $2.5/h for the cluster" in shown and "at most $1.5/h a node" in shown
    bad = cli.task("node.yaml", "resources:\n  max_node_hourly_cost: -1\nrun: echo hi\n")
    done = cli("launch", bad)
    assert done.returncode == 2
    assert (
        "node.yaml:2" in done.stderr
        and ("resources.max_node_hourly_cost` must be a positive number of USD per hour")
        in done.stderr
    )
    bad = cli.task("bad.yaml", "resources:\n  max_hourly_cost: cheap\nrun: echo hi\n")
    done = cli("launch", bad)
    assert done.returncode == 2
    assert "bad.yaml:2" in done.stderr and "max_hourly_cost` must be a positive number" in (
        done.stderr
    )


def test_env_file_and_workdir_flags(cli: CLI, tmp_path: Path) -> None:
    env = tmp_path / "job.env"
    env.write_text("# a comment\nexport A=\"quoted value\"\nB=plain\nC='single'\n")
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "marker.txt").write_text("from --workdir\n")
    done = cli.ok(
        "launch", 'echo "V $A|$B|$C|$(cat marker.txt)"', "-c", "fl", "--env-file", str(env),
        "--env", "B=over", "--workdir", str(folder), "--down",
    )  # fmt: skip
    assert node_lines(done.stdout, "V ") == {0: "quoted value|over|single|from --workdir"}
    done = cli("launch", "echo x", "--workdir", str(tmp_path / "none"))
    assert done.returncode == 2 and "--workdir" in done.stderr and "not a folder" in done.stderr
    done = cli("launch", "echo x", "--env-file", str(tmp_path / "none.env"))
    assert done.returncode == 2 and "--env-file" in done.stderr


def test_exec_dryrun_submits_nothing(cli: CLI, tmp_path: Path) -> None:
    cli.ok("launch", "echo up", "-c", "dry", "--nodes", "2")
    done = cli.ok(
        "exec", "dry", "--dryrun", "--cpus", "1", "--env", "K=v", "--secret", "S=hidden",
        "--yes", "echo", "hello",
    )  # fmt: skip
    out = done.stdout
    assert "on 2 of cluster dry's 2 node(s), holding cpus=1 while it runs" in out
    assert "envs: K" in out and "secrets: S" in out and "hidden" not in out
    assert "run: echo hello" in out and "--dryrun: nothing was submitted" in out
    rec = cli.record("dry")
    assert rec is not None and [j.id for j in rec.jobs] == [1]  # only launch's job
    dashed = cli.ok("exec", "dry", "--dryrun", "--", "ls", "-la")  # words after `--`
    assert "run: ls -la" in dashed.stdout
    done = cli("exec", "dry", "--dryrun", "--gpus", "A100:9", "echo", "x")
    assert done.returncode == 2  # refused as a real exec is: the check runs first
