"""``flotilla ssh`` into a node of a live cloud pool: each pool's private folder
(``{tempdir}/{prefix}{pool}-XXXX``) holds its login key, its known_hosts with the pinned
host keys, and ``addresses``: one line per node, the address peers know it by, then the
host, port and user its sshd is reached at."""

from __future__ import annotations

import glob
import os
import tempfile

from ..._errors import ConfigurationError
from ..ssh_shell import Target


def remember(folder: str, address: str, target: Target) -> None:
    """Record that the node peers know as ``address`` is reached at ``target``."""
    with open(os.path.join(folder, "addresses"), "a") as f:
        f.write(f"{address} {target.host} {target.port} {target.user}\n")


def ssh_login(prefix: str, address: str, cloud: str) -> list[str]:
    """``ssh`` arguments that log in to the node at ``address`` of a live pool of this
    user whose folder starts with ``prefix``, as its pool does (its login key, its pinned
    host key); ConfigurationError naming ``cloud`` when none has it."""
    pattern = os.path.join(tempfile.gettempdir(), f"{prefix}*", "addresses")
    for path in sorted(glob.glob(pattern), key=os.path.getmtime, reverse=True):
        folder = os.path.dirname(path)
        if os.stat(folder).st_uid != os.getuid():
            continue
        with open(path) as f:
            found = [w for w in map(str.split, f) if len(w) == 4 and w[0] == address]
        if found:  # the latest line: a replacement may have the address of one before it
            words = found[-1]
            return [
                "-i",
                os.path.join(folder, "login_key"),
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                f"UserKnownHostsFile={os.path.join(folder, 'known_hosts')}",
                "-o",
                "StrictHostKeyChecking=yes",
                "-p",
                words[2],
                f"{words[3]}@{words[1]}",
            ]
    raise ConfigurationError(
        f"no running {cloud} pool of this user has a node at {address}: is the cluster up?"
    )
