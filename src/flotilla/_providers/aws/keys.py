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

import shutil

from ..cloud import login
from ..cloud.keys import user_data as user_data  # the cloud kit's #cloud-config

FOLDER_PREFIX = "flotilla-aws-"
"""Pool folders are ``{tempdir}/flotilla-aws-{pool_id}-XXXX`` (the orphan cleanup finds them)."""


def remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def ssh_login(address: str) -> list[str]:
    """``ssh`` arguments that log in to the running pool instance peers know as
    ``address`` (its private address) as its pool does: the pool's login key, its pinned
    host key, ``USER@HOST`` at the address the client reaches it at (its public one unless
    ``private_ips``; the pool records it, ``cloud.login``). For ``flotilla ssh`` and a
    re-attach; a ConfigurationError when no live pool of this user has an instance there."""
    return login.ssh_login(FOLDER_PREFIX, address, "AWS")
