"""Command-line conventions (pure parts; the commands themselves are in test_cli)."""

from __future__ import annotations

import argparse

import pytest

from flotilla.cli.conventions import count, index, job_name, next_steps, split_command


@pytest.mark.parametrize(
    ("argv", "parsed", "command"),
    [
        (["dev"], ["dev"], []),
        (["dev", "--node", "2", "hostname"], ["dev", "--node", "2"], ["hostname"]),
        (["--node", "2", "dev", "ls", "-la"], ["--node", "2", "dev"], ["ls", "-la"]),
        (["dev", "--node=1", "python", "-c", "x"], ["dev", "--node=1"], ["python", "-c", "x"]),
        (["dev", "--node", "1", "--", "--weird"], ["dev", "--node", "1"], ["--weird"]),
        (["dev", "ls", "--node", "3"], ["dev"], ["ls", "--node", "3"]),  # the command's own
        (["dev", "--bogus", "ls"], ["dev", "--bogus"], ["ls"]),  # left for argparse to refuse
    ],
)
def test_split_command(argv: list[str], parsed: list[str], command: list[str]) -> None:
    assert split_command(argv, {"--node"}) == (parsed, command)


def test_counts_and_indexes() -> None:
    assert count("--nodes")("3") == 3
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--nodes takes a whole number"):
            count("--nodes")(bad)
    assert index("--node")("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="--node takes a node index"):
        index("--node")("-1")


def test_job_names_are_readable() -> None:
    assert job_name("python   train.py\n --lr 3") == "python-train.py-lr-3"
    long = job_name("for i in 1 2 3 4 5 6 7 8 9 10; do echo $i; sleep 1; done")
    assert long.startswith("for-i-in-1-2-3") and len(long) <= 40 and " " not in long
    assert job_name("$ ; |") == "command"


def test_next_steps_name_the_cluster_and_its_idle_policy() -> None:
    steps = "\n".join(next_steps("dev", 1, None))
    for part in ("flotilla logs dev 1", "flotilla ssh dev", "flotilla down dev", "until"):
        assert part in steps
    assert "after 30 minute(s)" in next_steps("dev", 1, 30)[0]
