"""The command line as SkyPilot users expect it (the ``flotilla`` command on real processes;
see test_cli for the fixtures): task files that run as they are, exit codes, flags."""

from __future__ import annotations

from test_cli import CLI
from test_cli import cli as cli  # the fixture


def test_a_home_file_mount_is_read_as_home_in_run(cli: CLI) -> None:
    data = cli.cwd / "data.txt"
    data.write_text("the mounted data\n")
    task = cli.task(
        "home.yaml",
        f"""
        num_nodes: 2
        file_mounts:
          ~/x/data.txt: {data}
        setup: |
          test -f ~/x/data.txt || {{ echo "setup cannot see ~/x"; exit 1; }}
        run: |
          echo "node $FLOTILLA_NODE_RANK reads: $(cat ~/x/data.txt)"
        """,
    )
    done = cli.ok("launch", task, "-c", "homes", "--down")
    got = sorted(line for line in done.stdout.splitlines() if "reads:" in line)
    assert got == [f"(node-{k}, rank={k}) node {k} reads: the mounted data" for k in range(2)]
