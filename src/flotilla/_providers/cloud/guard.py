"""The boot guard: an instance that no client reaches powers itself off.

The instance watchdog (``_node/cloud.py``) ends an instance ``ttl`` s after the client's
last contact, but it starts with the agent. An instance whose agent never starts (the
client died between RunInstances and the agent's start: kill -9, a crash, power loss; SSH
is blocked; the AMI is broken) would run, and cost, until someone runs ``flotilla down
--orphans``. So the user-data carries a guard, a ``bootcmd`` entry: cloud-init runs it as
root early in every boot, before sshd starts, with the instance id in ``INSTANCE_ID``. It
detaches (``setsid``, ``&``: the boot goes on) and waits ``max(ttl, start_timeout)`` s (as
long as a live client tries to start the agent, or the watchdog's ``ttl`` if longer), then

* if the watchdog's lock file exists (``{workdir}/watchdog/{instance id}.lock``, made by
  the watchdog the agent starts), its watchdog is in charge: the guard exits;
* otherwise it runs the pool's power-off command (the watchdog's, with
  ``FLOTILLA_BOOT_GUARD=1`` in its environment, which ``sudo`` drops): with shutdown
  behaviour "terminate", the instance ends.

Ownership: the guard runs as root but creates nothing in the workdir, which belongs to the
login user (and may not exist yet; at the first boot not even the user does, so its home is
looked up after the wait). It only removes the contact and lock files left by an earlier boot,
whose watchdog died with it: an instance rebooted without its agent powers off too. It tells what
it decided on its standard output, cloud-init's (``/var/log/cloud-init-output.log``, the
console). POSIX sh plus util-linux's ``setsid`` (``nohup`` without it): the AMI has no
flotilla yet.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence

WATCHDOG_FOLDER = "watchdog"
"""The watchdogs' contact files are ``{workdir}/watchdog/{instance id}``."""
GUARD_ENV = "FLOTILLA_BOOT_GUARD"
"""Set (to 1) in the environment of the power-off command when the guard runs it."""
USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
"""Login names the guard can find the home of (``~name``)."""


def home_path(workdir: str) -> str:
    """``workdir`` as the agent sees it: relative paths are relative to the login user's
    home (where SSH commands start), so they become ``~/...``."""
    return workdir if workdir.startswith(("/", "~")) else f"~/{workdir}"


def contact_path(workdir: str, instance_id: str) -> str:
    """The watchdog's contact file of an instance (the agent expands ``~``)."""
    return f"{home_path(workdir)}/{WATCHDOG_FOLDER}/{instance_id}"


def guard_command(
    ttl: float, start_timeout: float, workdir: str, user: str, poweroff: Sequence[str]
) -> str:
    """The guard as one shell command line, a ``bootcmd`` entry (see the module
    docstring): ``workdir`` is the provider's, ``user`` its ``ssh_user``."""
    delay = math.ceil(max(ttl, start_timeout))
    contact = f'{_as_root(home_path(workdir), user)}/{WATCHDOG_FOLDER}/"$1"'
    command = " ".join(shlex.quote(word) for word in poweroff)
    guard = (
        'if [ -z "$1" ]; then echo "flotilla boot guard: no INSTANCE_ID: not guarding"; '
        "exit 0; fi; "
        f'echo "flotilla boot guard: powering off in {delay} s unless an agent starts"; '
        f"sleep {delay}; c={contact}.lock; "
        'if [ -e "$c" ]; then echo "flotilla boot guard: an agent started ($c): its '
        'watchdog is in charge"; '
        f'else echo "flotilla boot guard: no agent started within {delay} s of the boot '
        f'($c is missing): powering off"; {GUARD_ENV}=1 {command}; fi'
    )
    stale = contact.replace('"$1"', '"$i"')
    return (
        'i="${INSTANCE_ID:-$(cat /var/lib/cloud/data/instance-id 2>/dev/null)}"; '
        f'[ -z "$i" ] || rm -f {stale} {stale}.lock; '
        "s=$(command -v setsid || echo nohup); "
        f'$s sh -c {shlex.quote(guard)} flotilla-boot-guard "$i" </dev/null &'
    )


def _as_root(path: str, user: str) -> str:
    """``path`` (from :func:`home_path`) as a shell word for a root shell: ``~`` is
    ``user``'s home, ``~name`` stays unquoted so the shell expands it."""
    if not path.startswith("~"):
        return shlex.quote(path)
    name, sep, rest = path[1:].partition("/")
    name = name or user
    if not USER_NAME.fullmatch(name):
        raise ValueError(f"not a login name: {name!r}")
    return f"~{name}{sep}{shlex.quote(rest) if rest else ''}"
