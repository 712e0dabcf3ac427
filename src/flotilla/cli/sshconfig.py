"""The one line flotilla adds to ``~/.ssh/config``: ``Include $FLOTILLA_HOME/ssh/*.config``.

Each cluster reached over ssh (SSH hosts, AWS and Vast instances) has its ssh_config
entries in ``$FLOTILLA_HOME/ssh/NAME.config`` (``NAME``, ``NAME-workerK``: its key and
pinned host keys; written when it is up, removed by ``flotilla down``). With the line in
``~/.ssh/config``, ``ssh NAME``, ``scp``, ``rsync`` and VS Code Remote reach the nodes.
The line is added once, at the top of the file (an ``Include`` after a ``Host`` block
would apply to that block only), when the user says so: ``flotilla ssh-config`` (asked on
a terminal, or ``-y``), or ``launch -y`` / ``--yes``. Nothing else in the file is touched.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from .console import say
from .conventions import confirm
from .state import flotilla_home


def include_line() -> str:
    """The line: every cluster's entries under this FLOTILLA_HOME."""
    return f"Include {flotilla_home() / 'ssh'}/*.config"


def user_config() -> Path:
    """``~/.ssh/config``."""
    return Path(os.path.expanduser("~")) / ".ssh" / "config"


def included() -> bool:
    """Whether ``~/.ssh/config`` has the line."""
    try:
        lines = user_config().read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return include_line() in (line.strip() for line in lines)


def add_include() -> Path:
    """Put the line at the top of ``~/.ssh/config`` (created 0600, its folder 0700, when
    missing), replacing the file atomically with its mode kept."""
    path = user_config()
    path.parent.mkdir(mode=0o700, exist_ok=True)
    try:
        old = path.read_text()
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        old, mode = "", 0o600
    text = f"# added by flotilla: its clusters' hosts\n{include_line()}\n\n{old}"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config.flotilla.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def offer(cluster_config: Path, yes: bool) -> None:
    """After a launch whose cluster has ssh_config entries: add the line when ``yes``,
    else say how (never asked where nobody can answer)."""
    if not cluster_config.exists() or included():
        return
    if yes:
        say(f"added `{include_line()}` to {add_include()}: `ssh {cluster_config.stem}` works")
    else:
        say(
            f"`flotilla ssh-config` lets `ssh {cluster_config.stem}` work (one line in "
            "~/.ssh/config)"
        )


def cmd_ssh_config(args: argparse.Namespace) -> int:
    if included():
        print(f"{user_config()} includes the clusters' hosts: {include_line()}")
        return 0
    question = f"add `{include_line()}` at the top of {user_config()}?"
    if not confirm(question, args.yes):
        return 1
    print(f"added `{include_line()}` to {add_include()}")
    return 0


def add_parser(sub: Any) -> None:
    """``flotilla ssh-config [-y]``."""
    q = sub.add_parser(
        "ssh-config",
        help="let `ssh NAME` reach the clusters' nodes: one Include line in ~/.ssh/config",
    )
    q.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    q.set_defaults(func=cmd_ssh_config)
