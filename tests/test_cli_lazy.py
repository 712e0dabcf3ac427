"""The ``flotilla`` command imports what the command it runs needs, and nothing else: a
``status`` or a ``--version`` loads no backend, server, observer or pool machinery (each
CLI call used to import all of them, ~0.25 CPU-s), with the same parser and help."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flotilla.cli import parser

SRC = str(Path(__file__).resolve().parent.parent / "src")

HEAVY = (
    "flotilla.cli.backends",
    "flotilla.server",
    "flotilla._providers",
    "flotilla._client.compute",
    "flotilla.cli.observe",
    "flotilla.cli.jobs",
    "asyncio",
    "rich",
)
"""Modules (and their submodules) a command that only reads state must not import."""

_PROBE = """
import json, sys
from flotilla.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:  # --version, --help
    code = e.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def loaded(tmp_path: Path, *argv: str) -> list[str]:
    """The modules a fresh interpreter has after running ``flotilla ARGV``."""
    env = dict(os.environ, FLOTILLA_HOME=str(tmp_path / "home"))
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["code"] == 0, out
    modules: list[str] = got["modules"]
    return modules


@pytest.mark.parametrize("argv", [("--version",), ("status",), ("status", "nope")])
def test_a_command_that_reads_state_imports_no_backend_server_or_pool(
    tmp_path: Path, argv: tuple[str, ...]
) -> None:
    modules = loaded(tmp_path, *argv)
    heavy = [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == []
    assert "flotilla.cli.main" in modules  # (the probe did run the command line)


def test_launch_still_has_every_backends_flags(tmp_path: Path) -> None:
    modules = loaded(tmp_path, "launch", "--help")
    assert "flotilla.cli.backends.registry" in modules


def test_each_command_is_parsed_and_helped_as_by_the_whole_parser() -> None:
    whole = parser.build_parser()
    names = list(_subcommands(whole))
    assert "status" in names and "server" in names and "jobs" in names
    for name in names:
        alone = parser.build_parser(name)
        assert list(_subcommands(alone)) == names  # every name, in order: usage and errors
        assert alone.format_usage() == whole.format_usage()
        assert _subcommands(alone)[name].format_help() == _subcommands(whole)[name].format_help()
    nowhere = parser.build_parser("no-such-command")
    assert list(_subcommands(nowhere)) == names
    # `flotilla logs` gets its --export from the observers' part
    assert "--export" in _subcommands(parser.build_parser("logs"))["logs"].format_help()


def test_help_before_a_command_builds_the_whole_parser() -> None:
    assert parser.command_of(["--help"]) is None
    assert parser.command_of(["-h", "status"]) is None
    assert parser.command_of(["status", "--help"]) == "status"
    assert parser.command_of(["--version"]) == ""
    assert parser.command_of([]) == ""
    assert parser.command_of(["jobs", "launch", "t.yaml"]) == "jobs"


def _subcommands(whole: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = whole._subparsers._group_actions[0]  # type: ignore[union-attr]
    choices: dict[str, argparse.ArgumentParser] = sub.choices  # type: ignore[assignment]
    return choices
