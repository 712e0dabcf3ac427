"""The command line as SkyPilot users expect it (the ``flotilla`` command on real processes;
see test_cli for the fixtures): task files that run as they are, exit codes, flags."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from _procs import wait_until
from _tty import Terminal
from test_cli import CLI
from test_cli import cli as cli  # the fixture

import flotilla
from flotilla.cli.state import Paths, all_names


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


def test_version_and_node_counts(cli: CLI) -> None:
    done = cli.ok("--version")
    assert done.stdout.strip() == f"flotilla {flotilla.__version__}"
    for flag in ("--nodes", "--num-nodes"):
        for bad in ("0", "-1", "two"):
            refused = cli("launch", "true", "-c", "never", flag, bad)
            assert refused.returncode == 2, refused.stderr
            assert "--nodes takes a whole number of nodes, 1 or more" in refused.stderr
    assert cli.record("never") is None  # refused before anything started


def test_launch_names_the_cluster_and_says_what_next(cli: CLI) -> None:
    done = cli.ok("launch", "echo one two", "--num-nodes", "2")
    name = next(n for n in all_names(cli.home))
    rec = cli.record(name)
    assert rec.num_nodes == 2
    for step in (f"cluster {name} is up", f"flotilla logs {name}", f"flotilla ssh {name}",
                 f"flotilla down {name}", "--idle-minutes"):  # fmt: skip
        assert step in done.stderr, done.stderr
    assert rec.jobs[0].name == "echo-one-two"  # an ad-hoc job named after its command
    for bad in ("0", "-1"):
        refused = cli("exec", name, "true", "--nodes", bad)
        assert refused.returncode == 2 and "--nodes takes a whole number" in refused.stderr


def test_ssh_options_in_any_order(cli: CLI) -> None:
    cli.ok("launch", "true", "-c", "sh", "--nodes", "2")
    for argv in (
        ["ssh", "sh", "--node", "1", "echo", "on", "$FLOTILLA_NODE_RANK"],
        ["ssh", "--node", "1", "sh", "echo", "on", "$FLOTILLA_NODE_RANK"],
        ["ssh", "sh", "--node=1", "--", "echo", "on", "$FLOTILLA_NODE_RANK"],
    ):
        assert cli.ok(*argv).stdout.strip() == "on 1", argv
    # the command's own options stay the command's (its words are joined for the node's
    # shell, as OpenSSH's ssh joins them)
    done = cli.ok("ssh", "sh", "--node", "1", "python3", "-c", "\"print('-c kept')\"")
    assert done.stdout.strip() == "-c kept"
    assert cli("ssh", "sh", "--node", "-1", "true").returncode == 2


def test_exit_codes(cli: CLI) -> None:
    assert cli("launch", "exit 7", "-c", "ex").returncode == 7  # the job's own
    assert cli("exec", "ex", "kill -9 $$").returncode == 128 + 9  # killed by SIGKILL
    missing = cli("logs", "nope", "--no-follow")
    assert missing.returncode == 100 and "no cluster 'nope'" in missing.stderr
    assert cli("exec", "ex", "true", "--bogus").returncode == 2


def test_a_launch_whose_cluster_is_taken_down_exits_lost_not_interrupted(cli: CLI) -> None:
    """``down`` while a foreground ``launch`` follows its job: the launch exits 102 (its
    cluster went away), not 130, which says Ctrl-C."""
    from flotilla.cli.conventions import EXIT_LOST

    flag = cli.cwd / "running"
    task = cli.task("long.yaml", f"run: touch {flag}; while true; do sleep 1; done\n")
    launch = subprocess.Popen(
        [sys.executable, "-m", "flotilla", "launch", task, "-c", "race"],
        cwd=cli.cwd, env=cli.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_until(flag.exists, timeout=60)
        cli.ok("down", "race", timeout=90)
        out, err = launch.communicate(timeout=60)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == EXIT_LOST, (out, err)
    assert "cluster down" in out + err


def test_logs_follow_by_default(cli: CLI) -> None:
    go = cli.cwd / "go"
    cli.ok("launch", "true", "-c", "lg")
    cli.ok("exec", "lg", f"until [ -f {go} ]; do sleep 0.05; done; echo released", "-d")
    early = cli.ok("logs", "lg", "--no-follow")  # returns at once with what there is
    assert "released" not in early.stdout
    follower = subprocess.Popen(
        [sys.executable, "-m", "flotilla", "logs", "lg"],
        cwd=cli.cwd, env=cli.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        go.touch()
        out, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, err
    assert "(node-0, rank=0) released" in out


def test_down_all_and_cancel_all_ask_first(cli: CLI) -> None:
    cli.ok("launch", "true", "-c", "a1")
    cli.ok("launch", "true", "-c", "a2")
    cli.ok("exec", "a1", "sleep 600", "-d")
    refused = cli("cancel", "a1", "-a")  # no terminal to ask on: -y is needed
    assert refused.returncode == 2 and "-y/--yes" in refused.stderr
    done = cli.ok("cancel", "a1", "-a", "-y")
    assert "job 2: CANCELLED" in done.stderr or "CANCEL" in done.stderr, done.stderr
    refused = cli("down", "-a")
    assert refused.returncode == 2 and "-y/--yes" in refused.stderr
    assert sorted(all_names(cli.home)) == ["a1", "a2"]
    cli.ok("down", "-a", "-y")
    assert all_names(cli.home) == []
    assert cli("down").returncode == 2  # which clusters?


BAR = r"""
import sys
for k in range(51):
    sys.stderr.write(f"\r{k * 2:3d}%|" + "#" * (k // 5))
    sys.stderr.flush()
sys.stderr.write("\n")
"""


def test_a_job_bar_on_a_terminal_and_in_the_log(cli: CLI, tmp_path: Path) -> None:
    script = cli.cwd / "bar.py"
    script.write_text(BAR)
    argv = [sys.executable, "-m", "flotilla", "launch", f"python3 {script}", "-c", "tb",
            "--nodes", "2"]  # fmt: skip
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in cli.env.items() if k in ENV_KEYS)
    term = Terminal(
        ["sh", "-c", f"cd {cli.cwd} && env {env} {shlex.join(argv)}"], 100, 40, tmp_path
    )
    try:
        screen = term.wait_for(lambda s: "[exited]" in s, "the launch's end", timeout=120)
    finally:
        term.close()
    bars = sorted(r for r in screen.splitlines() if "%|" in r)
    assert bars == [f"(node-{k}, rank={k}) 100%|##########" for k in range(2)], screen
    log = (Paths("tb", cli.home).job_dir(1) / "job.log").read_text()
    for k in range(2):
        mine = [x for x in log.splitlines() if x.startswith(f"(node-{k}, rank={k}) ")]
        assert mine[-1] == f"(node-{k}, rank={k}) 100%|##########"
        assert 1 <= len(mine) <= 3  # throttled: the first state, maybe one more, the end


ENV_KEYS = ("FLOTILLA_HOME", "PATH", "PYTHONPATH", "HOME")


def test_sync_follows_the_ignore_files_and_says_what_it_left_out(cli: CLI) -> None:
    work = cli.cwd / "work"
    for rel, text in {
        "train.py": "print('train')\n",
        "data/raw/big.bin": "x" * 5000,
        "data/keep.csv": "k\n",
        "ckpt/last.pt": "x" * 300,
        "sub/ckpt/notes.txt": "n\n",
    }.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    (work / ".skyignore").write_text("data/raw\n/ckpt\n")
    task = cli.task(
        "sync.yaml", f"workdir: {work}\nrun: find . -type f -not -path './.flotilla/*' | sort\n"
    )
    done = cli.ok("launch", task, "-c", "ign", "--down")
    found = {line.split(") ", 1)[1] for line in done.stdout.splitlines() if ") ./" in line}
    assert found == {"./.skyignore", "./train.py", "./data/keep.csv", "./sub/ckpt/notes.txt"}
    assert "left out 2 file(s) (5.2 KB) by .skyignore" in done.stderr, done.stderr


def test_ssh_on_a_local_node_has_the_same_home_as_run(cli: CLI) -> None:
    cli.ok("launch", "echo run-home=$HOME", "-c", "hm", "--nodes", "2")
    rec = cli.record("hm")
    done = cli.ok("ssh", "hm", "--node", "1", "echo", "ssh-home=$HOME")
    assert done.stdout.strip() == f"ssh-home={rec.nodes[1].workdir}"
