"""SSH keys of a cloud pool: made by the client, handed to the instances, pinned.

No trust on first use: the client generates the instances' SSH host key and the pool's
login key (``ssh-keygen``, ed25519) in a pool-private folder (0700, files 0600), hands both
to the instances (AWS: cloud-init user-data; Vast: the on-start script and the API) and
connects with exactly that host key pinned in the folder's own ``known_hosts``. An
instance that answers with another key is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from ..._errors import ConfigurationError, ProvisionError


@dataclass(frozen=True)
class KeyPair:
    """An ed25519 key pair on disk.

    Attributes:
        path: the private key file (0600); the public key is ``path + ".pub"``.
        public: the public key line (``ssh-ed25519 AAAA... comment``).
    """

    path: str
    public: str

    def private(self) -> str:
        with open(self.path) as f:
            return f.read()


def keygen(folder: str, name: str, comment: str) -> KeyPair:
    """A new ed25519 key pair ``folder/name``; ProvisionError when ssh-keygen fails."""
    exe = shutil.which("ssh-keygen")
    if exe is None:
        raise ConfigurationError(
            "the cloud providers make SSH keys with OpenSSH's `ssh-keygen`, which is not on "
            "PATH: install it (apt-get install openssh-client, brew install openssh)"
        )
    path = os.path.join(folder, name)
    proc = subprocess.run(
        [exe, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", path],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise ProvisionError(f"ssh-keygen failed ({proc.returncode}): {proc.stderr.strip()}")
    with open(path + ".pub") as f:
        return KeyPair(path, f.read().strip())


def pin(known_hosts: str, address: str, host_key: KeyPair) -> None:
    """Record ``host_key`` as the only key accepted for ``address``."""
    pin_public(known_hosts, address, host_key.public)


def pin_public(known_hosts: str, address: str, public: str) -> None:
    """Record the public key line ``public`` as the only key accepted for ``address``."""
    key = " ".join(public.split()[:2])
    fd = os.open(known_hosts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(f"{address} {key}\n")


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


def host_key_script(host_key: KeyPair, pool_id: str) -> str:
    """Shell lines (run as root) that make ``host_key`` the instance's only SSH host key."""
    private = host_key.private().strip()
    public = " ".join(host_key.public.split()[:2])
    return f"""umask 077
mkdir -p /etc/ssh
rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub
cat > /etc/ssh/ssh_host_ed25519_key <<'FLOTILLA_HOST_KEY'
{private}
FLOTILLA_HOST_KEY
echo '{public} flotilla-{pool_id}' > /etc/ssh/ssh_host_ed25519_key.pub
chmod 600 /etc/ssh/ssh_host_ed25519_key
"""
