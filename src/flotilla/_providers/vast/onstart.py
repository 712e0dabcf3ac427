"""The on-start script of a pool's instances: the pinned SSH host key and the guard.

No trust on first use (as on AWS, ``cloud/keys.py``): the client generates the instances'
SSH host key (ed25519, in a pool-private folder) and hands it over in the instance's
on-start script (``onstart`` of ``PUT /asks/{id}/``), which installs it as the only host
key of the instance's sshd (and makes a running sshd reload); the client connects with
exactly that key pinned for ``[public address]:port`` in the pool's own known_hosts. The
login key is attached through the API (``POST /instances/{id}/ssh/``).

The guard (as AWS's boot guard, ``cloud/guard.py``): an instance that no client ever reaches
must not run, and cost, forever. The script writes ``{workdir}/vast/{CONTAINER_ID}.destroy``
(0700), which destroys the instance through Vast's API with the key Vast gives each
instance for itself (``CONTAINER_API_KEY``: it can act on that instance only; the
account's key never leaves the client), then detaches a guard that waits
``max(ttl, start_timeout)`` s and runs it unless an agent started its watchdog (the
watchdog's lock file exists): the watchdog (``_node/cloud.py``) runs the same script
``ttl`` s after the client's last contact. The destroy call is tried again for a few
minutes (the API may throttle). POSIX sh and python3 (curl if there is no python3).
"""

from __future__ import annotations

import math
import re
import shlex

from ..._errors import ConfigurationError
from ..cloud.guard import WATCHDOG_FOLDER
from ..cloud.keys import KeyPair

ONSTART_LIMIT = 4048
"""The most characters Vast takes in an instance's ``onstart`` (its API reference)."""
SAFE_URL = re.compile(r"[A-Za-z0-9:/._\-\[\]%@]+")


def shell_path(path: str) -> str:
    """``path`` (absolute or under ``~``) as a word for root's shell."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    if path == "~":
        return "~"
    return shlex.quote(path)


def destroy_path(workdir: str, instance: str) -> str:
    return f"{workdir.rstrip('/')}/vast/{instance}.destroy"


def contact(workdir: str, instance: str) -> str:
    return f"{workdir.rstrip('/')}/{WATCHDOG_FOLDER}/{instance}"


def poweroff_command(workdir: str, instance: int | str) -> list[str]:
    """What the watchdog runs when the client is gone: the instance's destroy script."""
    return ["sh", "-c", f"exec sh {shell_path(destroy_path(workdir, str(instance)))}"]


def onstart_script(
    pool_id: str, host_key: KeyPair, url: str, workdir: str, ttl: float, start_timeout: float
) -> str:
    """The on-start script (see the module docstring)."""
    if not SAFE_URL.fullmatch(url):
        raise ValueError(f"not a plain URL: {url!r}")
    private = host_key.private().strip()
    public = " ".join(host_key.public.split()[:2])
    delay = math.ceil(max(ttl, start_timeout))
    vast_dir = shell_path(workdir.rstrip("/") + "/vast")
    watch = shell_path(workdir.rstrip("/") + f"/{WATCHDOG_FOLDER}")
    endpoint = f"{url}/api/v0/instances/$CONTAINER_ID/"
    python = (  # tried 8 times over ~4 min (the API may throttle or be out of reach)
        "import time,urllib.request as u\n"
        "for n in range(8):\n"
        " try:\n"
        f'  u.urlopen(u.Request("{endpoint}",method="DELETE",headers='
        '{"Authorization":"Bearer $CONTAINER_API_KEY"}),timeout=10).read();'
        'print("destroyed");break\n'
        " except Exception as x:\n"
        '  if getattr(x,"code",0)==404:print("gone already");break\n'
        '  print("failed:",x,flush=True);time.sleep(2**n)\n'
        "else:raise SystemExit(1)"
    )
    guard = (
        f'sleep {delay}; if [ -e "$2/$1.lock" ]; then echo "flotilla guard: an agent started: '
        'its watchdog is in charge"; else echo "flotilla guard: no agent started within '
        f'{delay} s: destroying the instance"; sh "$3/$1.destroy"; fi'
    )
    script = f"""#!/bin/sh
# flotilla pool {pool_id}: the pinned SSH host key and the guard (see flotilla's
# _providers/vast/onstart.py)
umask 077
mkdir -p /etc/ssh
rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub
cat > /etc/ssh/ssh_host_ed25519_key <<'FLOTILLA_HOST_KEY'
{private}
FLOTILLA_HOST_KEY
echo '{public} flotilla-{pool_id}' > /etc/ssh/ssh_host_ed25519_key.pub
chmod 600 /etc/ssh/ssh_host_ed25519_key
if [ -s /run/sshd.pid ]; then kill -HUP "$(cat /run/sshd.pid)" 2>/dev/null; fi
[ -n "$CONTAINER_ID" ] || {{ echo "flotilla guard: no CONTAINER_ID: not guarding"; exit 0; }}
mkdir -p {vast_dir} {watch}
rm -f {watch}/"$CONTAINER_ID" {watch}/"$CONTAINER_ID.lock"
cat > {vast_dir}/"$CONTAINER_ID.destroy" <<FLOTILLA_DESTROY
#!/bin/sh
# destroy Vast instance $CONTAINER_ID with its own key (what it says: in \\$0.log)
exec >>"\\$0.log" 2>&1 </dev/null
echo "\\$(date) destroying instance $CONTAINER_ID"
if command -v python3 >/dev/null; then
  exec python3 -c '{python}'
fi
exec curl -fsS --retry 8 --retry-all-errors -m 10 -X DELETE \\
  -H "Authorization: Bearer $CONTAINER_API_KEY" "{endpoint}"
FLOTILLA_DESTROY
chmod 700 {vast_dir}/"$CONTAINER_ID.destroy"
echo "flotilla guard: destroying this instance in {delay} s unless an agent starts"
s=$(command -v setsid || echo nohup)
$s sh -c {shlex.quote(guard)} flotilla-guard "$CONTAINER_ID" {watch} {vast_dir} </dev/null &
"""
    if len(script) > ONSTART_LIMIT:
        raise ConfigurationError(
            f"the on-start script is {len(script)} characters, more than Vast takes "
            f"({ONSTART_LIMIT}): use a shorter VastAI(url=..., workdir=...)"
        )
    return script
