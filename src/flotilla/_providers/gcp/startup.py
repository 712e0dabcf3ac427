"""The startup script of a pool's instances: self-deletion and the boot guard.

The guest agent runs the ``startup-script`` metadata value as root at every boot. It asks
the metadata server (``http://metadata.google.internal``, header ``Metadata-Flavor:
Google``) for the instance's name, and writes ``/var/lib/flotilla/self-delete`` (0755, no
secret in it): a standard-library Python program that gets an access token for the
instance's service account from the metadata server and deletes the instance through the
Compute API (``DELETE .../zones/{zone}/instances/{name}``, tried again for a few minutes;
a 404 is done). Then the boot guard (``cloud/guard.py``) with the instance's name as its id:
``max(ttl, start_timeout)`` s later it runs the self-deletion unless an agent started its
watchdog, which runs the same program ``ttl`` s after the client's last contact.

No key of the account is on the instance: it acts with its own service account's token
(the compute scope; ``GCP(service_account=...)`` names an account of its own, which a
custom role can restrict to deleting instances).

Host keys are not handed over: the guest agent publishes the instance's own SSH host keys
as guest attributes (``hostkeys/``, with the metadata ``enable-guest-attributes=TRUE``),
which the client reads through the API and pins (as ``gcloud compute ssh
--strict-host-key-checking=yes`` does); no private key travels.
"""

from __future__ import annotations

import re

from ..cloud.guard import guard_command

METADATA = "http://metadata.google.internal/computeMetadata/v1"
SELF_DELETE = "/var/lib/flotilla/self-delete"
SAFE_URL = re.compile(r"https?://[A-Za-z0-9.:\[\]_-]+")

_DELETE = """#!/usr/bin/env python3
# flotilla: delete this instance through the Compute API with its service account's token
import json, sys, time, urllib.error, urllib.request as u
MD = "{metadata}/"
API = "{api}"
def md(path):
    req = u.Request(MD + path, headers={{"Metadata-Flavor": "Google"}})
    return u.urlopen(req, timeout=10).read().decode()
for attempt in range(12):
    try:
        token = json.loads(md("instance/service-accounts/default/token"))["access_token"]
        zone = md("instance/zone").rsplit("/", 1)[-1]
        url = API + "/compute/v1/projects/%s/zones/%s/instances/%s" % (
            md("project/project-id"), zone, md("instance/name"))
        req = u.Request(url, method="DELETE", headers={{"Authorization": "Bearer " + token}})
        u.urlopen(req, timeout=30).read()
        print("deletion asked", flush=True)
        sys.exit(0)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            sys.exit(0)
        print("deletion refused: %s" % e, flush=True)
    except Exception as e:
        print("cannot ask for the deletion: %s" % e, flush=True)
    time.sleep(min(30, 2 ** attempt))
sys.exit(1)
"""


def startup_script(api: str, ttl: float, start_timeout: float, workdir: str, user: str) -> str:
    """The ``startup-script`` metadata value (see the module docstring); ``api`` is the
    Compute API's base URL as the instance reaches it."""
    if not SAFE_URL.fullmatch(api):
        raise ValueError(f"an API URL the startup script cannot quote: {api!r}")
    program = _DELETE.format(metadata=METADATA, api=api)
    guard = guard_command(ttl, start_timeout, workdir, user, [SELF_DELETE])
    fetch = (
        "import sys, urllib.request as u; print(u.urlopen(u.Request(sys.argv[1], "
        "headers={'Metadata-Flavor': 'Google'}), timeout=10).read().decode())"
    )
    return f"""#!/bin/sh
# flotilla: the instance deletes itself when no client reaches it (see its docs)
mkdir -p /var/lib/flotilla && chmod 755 /var/lib/flotilla
cat > {SELF_DELETE} <<'FLOTILLA_DELETE'
{program}FLOTILLA_DELETE
chmod 755 {SELF_DELETE}
INSTANCE_ID=$(python3 -c "{fetch}" {METADATA}/instance/name)
export INSTANCE_ID
{guard}
"""
