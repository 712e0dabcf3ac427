"""SSH keys of an AWS pool: made by the client (``cloud.keys``), handed over in cloud-init
user-data, pinned.

No trust on first use: the client generates the instances' SSH host key and the pool's
login key (``ssh-keygen``, ed25519) in a pool-private folder (0700, files 0600), gives both
to the instances in ``#cloud-config`` user-data (``ssh_keys``, ``ssh_authorized_keys``;
cloud-init installs them before sshd starts) and connects with exactly that host key
pinned in the folder's own ``known_hosts``. An instance that answers with another key is
refused. No EC2 key pair is created: nothing key-related is left in the account.

One RunInstances call gives every instance it launches the same user-data, so the
instances of one launch share their host key; a replacement launch gets a key of its own.
(Distinct keys in one user-data would not help: every instance could read all of them.)
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from collections.abc import Sequence

from ..._errors import ConfigurationError
from ..cloud.keys import KeyPair

FOLDER_PREFIX = "flotilla-aws-"
"""Pool folders are ``{tempdir}/flotilla-aws-{pool_id}-XXXX`` (the orphan cleanup finds them)."""


def pool_folder(pool_id: str) -> str:
    """A new folder for the pool's keys and known_hosts, private to this user (0700)."""
    return tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{pool_id}-")


def remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def user_data(host_key: KeyPair, login_key: KeyPair, bootcmd: Sequence[str] = ()) -> str:
    """The ``#cloud-config`` that installs ``host_key`` as the instance's only SSH host key,
    authorizes ``login_key`` for the default user and runs the ``bootcmd`` shell lines
    early in every boot (the boot guard, see ``cloud.guard``)."""
    private = "\n".join(f"    {line}" for line in host_key.private().strip().splitlines())
    # a JSON string is a YAML double-quoted scalar: any shell line, safely quoted
    commands = "".join(f"  - {json.dumps(line)}\n" for line in bootcmd)
    return (
        "#cloud-config\n"
        "ssh_deletekeys: true\n"
        "ssh_genkeytypes: []\n"
        "ssh_keys:\n"
        "  ed25519_private: |\n"
        f"{private}\n"
        f"  ed25519_public: {host_key.public}\n"
        "ssh_authorized_keys:\n"
        f"  - {login_key.public}\n" + (f"bootcmd:\n{commands}" if bootcmd else "")
    )


def ssh_login(address: str) -> list[str]:
    """``ssh`` options that log in to the running pool instance at ``address`` as its
    pool does: the pool's login key and its pinned host key (for ``flotilla ssh``). The
    pool is found by its folder's known_hosts (only live pools have a folder); a
    ConfigurationError when no pool of this user has an instance there."""
    pattern = os.path.join(tempfile.gettempdir(), f"{FOLDER_PREFIX}*", "known_hosts")
    for known_hosts in sorted(glob.glob(pattern), key=os.path.getmtime, reverse=True):
        folder = os.path.dirname(known_hosts)
        key = os.path.join(folder, "login_key")
        if os.stat(folder).st_uid != os.getuid() or not os.path.exists(key):
            continue
        with open(known_hosts) as f:
            if any(line.split(" ", 1)[0] == address for line in f):
                return [
                    "-i",
                    key,
                    "-o",
                    "IdentitiesOnly=yes",
                    "-o",
                    f"UserKnownHostsFile={known_hosts}",
                    "-o",
                    "StrictHostKeyChecking=yes",
                ]
    raise ConfigurationError(
        f"no running AWS pool of this user has an instance at {address}: is the cluster up?"
    )
