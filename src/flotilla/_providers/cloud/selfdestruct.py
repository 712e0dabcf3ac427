"""The start script of a rented container or instance that ends itself: the pinned SSH host
key, and the guard and destroy script of a provider whose instances can delete themselves
through its API with a credential of their own (RunPod's pod-scoped ``RUNPOD_API_KEY``,
Vast's ``CONTAINER_API_KEY``).

No trust on first use (as on AWS, ``keys``): the client generates the instance's SSH host
key (ed25519, in a pool-private folder) and hands it over in the start script, which
installs it as the only host key before sshd starts (an sshd already running, as on Vast,
is made to reload); the client pins exactly that key.

The destroy script (``{workdir}/{provider}/{ID}.destroy``, 0700) makes one API request with
the instance's own key (never the account's, which does not leave the client), tried 8
times over about 4 minutes (the API may throttle or be out of reach); a 404 is "gone
already". The guard waits ``max(ttl, start_timeout)`` s and runs it unless an agent started
its watchdog (the watchdog's lock file exists); the watchdog (``_node/cloud.py``) runs the
same script ``ttl`` s after the client's last contact. POSIX sh and python3 (curl if
there is no python3).
"""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass

from .guard import WATCHDOG_FOLDER
from .keys import KeyPair, host_key_script

SAFE_URL = re.compile(r"[A-Za-z0-9:/._\-\[\]%@$?=&{}]+")
"""A URL the script can hold unquoted (``$NAME`` of the instance's environment allowed)."""


@dataclass(frozen=True)
class DestroyCall:
    """The API request that deletes the instance, with the instance's own variables
    (``$RUNPOD_POD_ID``) in ``url``, ``headers`` and ``body``.

    Attributes:
        id_var: the variable holding the instance's id (the script's files are named by it).
        method: "DELETE", "POST"...
        url: the request's URL.
        headers: its headers.
        body: its JSON body (None: none).
    """

    id_var: str
    method: str
    url: str
    headers: tuple[tuple[str, str], ...] = ()
    body: object = None


def shell_path(path: str) -> str:
    """``path`` (absolute or under ``~``) as a word for root's shell."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    if path == "~":
        return "~"
    return shlex.quote(path)


def destroy_path(workdir: str, provider: str, instance: str) -> str:
    return f"{workdir.rstrip('/')}/{provider}/{instance}.destroy"


def contact(workdir: str, instance: str) -> str:
    return f"{workdir.rstrip('/')}/{WATCHDOG_FOLDER}/{instance}"


def poweroff_command(workdir: str, provider: str, instance: str) -> list[str]:
    """What the watchdog runs when the client is gone: the instance's destroy script."""
    return ["sh", "-c", f"exec sh {shell_path(destroy_path(workdir, provider, instance))}"]


def start_script(
    provider: str,
    pool_id: str,
    host_key: KeyPair,
    call: DestroyCall,
    workdir: str,
    ttl: float,
    start_timeout: float,
    guard_log: bool = True,
) -> str:
    """The part of the start script that installs the host key, the destroy script and
    the guard (see the module docstring); ValueError for a URL it cannot hold. The guard
    writes to ``{ID}.guard.log`` beside the destroy script, or without ``guard_log`` to
    the script's output (Vast keeps an on-start script's output as the instance's log)."""
    if not SAFE_URL.fullmatch(call.url):
        raise ValueError(f"not a plain URL: {call.url!r}")
    install_key = host_key_script(host_key, pool_id)
    delay = math.ceil(max(ttl, start_timeout))
    folder = shell_path(f"{workdir.rstrip('/')}/{provider}")
    watch = shell_path(f"{workdir.rstrip('/')}/{WATCHDOG_FOLDER}")
    ident = f"${call.id_var}"
    headers = json.dumps(dict(call.headers))  # a dict literal in double quotes
    data = "None" if call.body is None else json.dumps(json.dumps(call.body)) + ".encode()"
    python = (
        "import time,urllib.request as u\n"
        "for n in range(8):\n"
        " try:\n"
        f'  u.urlopen(u.Request("{call.url}",data={data},method="{call.method}",'
        f"headers={headers}),timeout=10).read();"
        'print("destroyed");break\n'
        " except Exception as x:\n"
        '  if getattr(x,"code",0)==404:print("gone already");break\n'
        '  print("failed:",x,flush=True);time.sleep(2**n)\n'
        "else:raise SystemExit(1)"
    )
    curl_headers = " ".join(f'-H "{k}: {v}"' for k, v in call.headers)
    curl_data = (
        ""
        if call.body is None
        else f"-H 'Content-Type: application/json' -d '{json.dumps(call.body)}'"
    )
    guard_out = f' \\\n  >>{folder}/"{ident}.guard.log" 2>&1' if guard_log else ""
    guard = (
        f'sleep {delay}; if [ -e "$2/$1.lock" ]; then echo "flotilla guard: an agent started: '
        'its watchdog is in charge"; else echo "flotilla guard: no agent started within '
        f'{delay} s: destroying the instance"; sh "$3/$1.destroy"; fi'
    )
    return f"""# flotilla pool {pool_id}: the pinned SSH host key and the guard (see flotilla's
# _providers/cloud/selfdestruct.py)
{install_key}if [ -s /run/sshd.pid ]; then kill -HUP "$(cat /run/sshd.pid)" 2>/dev/null; fi
if [ -n "{ident}" ]; then
mkdir -p {folder} {watch}
rm -f {watch}/"{ident}" {watch}/"{ident}.lock"
cat > {folder}/"{ident}.destroy" <<FLOTILLA_DESTROY
#!/bin/sh
# destroy {provider} instance {ident} with its own key (what it says: in \\$0.log)
exec >>"\\$0.log" 2>&1 </dev/null
echo "\\$(date) destroying instance {ident}"
if command -v python3 >/dev/null; then
  exec python3 -c '{python}'
fi
exec curl -fsS --retry 8 --retry-all-errors -m 10 -X {call.method} {curl_headers} {curl_data} \\
  "{call.url}"
FLOTILLA_DESTROY
chmod 700 {folder}/"{ident}.destroy"
echo "flotilla guard: destroying this instance in {delay} s unless an agent starts"
s=$(command -v setsid || echo nohup)
$s sh -c {shlex.quote(guard)} flotilla-guard "{ident}" {watch} {folder} </dev/null{guard_out} &
else
echo "flotilla guard: no {call.id_var}: not guarding"
fi
"""
