"""What AWS pools leave when their client dies, and removing it.

Every resource of a pool is tagged ``flotilla:client = host:pid:start`` (the client
process's start time in clock ticks: a recycled pid is not mistaken for the client). A pool
whose client ran on this machine and is gone is an orphan: :func:`remove_orphans`
terminates its instances, deletes its security group and its local key folder. Pools of
clients on other machines cannot be checked from here and are left alone (their instances
end themselves ``ttl`` s after their client stopped talking to them). A key folder names
its pool's place (region and endpoint, ``Api.place``): only this API's are looked at.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from ..cloud.identity import client_alive
from .api import Api, error_code, translate
from .kept import TAG_STOPPED
from .keys import FOLDER_PREFIX

_LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


@dataclass(frozen=True)
class Orphans:
    """What :func:`remove_orphans` found (and removed, unless it was a dry run).

    Attributes:
        pools: ids of the orphan pools.
        instances: their instances.
        security_groups: their security groups.
        folders: their local key folders.
        skipped: pools whose client ran on another machine (not checked, not touched).
        placement_groups: their cluster placement groups (``network_tier="best"``).
        stopped: pools of stopped clusters (tagged ``flotilla:stopped``): kept, not
            touched (``flotilla down NAME`` removes them).
    """

    pools: tuple[str, ...]
    instances: tuple[str, ...]
    security_groups: tuple[str, ...]
    folders: tuple[str, ...]
    skipped: tuple[str, ...]
    placement_groups: tuple[str, ...] = ()
    stopped: tuple[str, ...] = ()


def _tag(resource: dict[str, Any], key: str) -> str:
    for tag in resource.get("Tags", []):
        if tag["Key"] == key:
            return str(tag["Value"])
    return ""


def sweep(api: Api) -> Orphans:
    """What every pool start does, as the local provider removes what killed clients
    left: the orphan pools' instances are told to terminate and their key folders removed,
    without waiting; their security groups are deleted once their instances no longer
    hold them (by this sweep or the next). Errors are left to ``remove_orphans``."""
    found = remove_orphans(api, dry_run=True)
    if found.instances:
        with contextlib.suppress(Exception):
            api.raw("ec2", "terminate_instances", InstanceIds=list(found.instances))
    for group in found.security_groups:
        with contextlib.suppress(Exception):  # DependencyViolation: instances still hold it
            api.raw("ec2", "delete_security_group", GroupId=group)
    for name in found.placement_groups:
        with contextlib.suppress(Exception):  # InvalidPlacementGroup.InUse: likewise
            api.raw("ec2", "delete_placement_group", GroupName=name)
    for folder in found.folders:
        shutil.rmtree(folder, ignore_errors=True)
    return found


def remove_orphans(api: Api, dry_run: bool = False) -> Orphans:
    """Find the orphan pools (see the module docstring) and remove their resources."""
    tagged = [{"Name": "tag-key", "Values": ["flotilla:pool"]}]
    reply = api.call(
        "ec2",
        "describe_instances",
        "list flotilla's instances",
        Filters=[*tagged, {"Name": "instance-state-name", "Values": _LIVE_STATES}],
    )
    instances = [i for r in reply["Reservations"] for i in r["Instances"]]
    groups = api.call(
        "ec2", "describe_security_groups", "list flotilla's security groups", Filters=tagged
    )["SecurityGroups"]
    placements = api.call(
        "ec2", "describe_placement_groups", "list flotilla's placement groups", Filters=tagged
    ).get("PlacementGroups", [])
    clients: dict[str, set[str]] = {}  # pool -> its resources' clients
    stopped: set[str] = set()
    for resource in [*instances, *groups, *placements]:
        pool = _tag(resource, "flotilla:pool")
        clients.setdefault(pool, set()).add(_tag(resource, "flotilla:client"))
        if _tag(resource, TAG_STOPPED):
            stopped.add(pool)
    folders: dict[str, list[str]] = {}
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"{FOLDER_PREFIX}*")):
        try:
            with open(os.path.join(folder, "client")) as f:
                client = f.read().strip()
            with contextlib.suppress(FileNotFoundError), open(os.path.join(folder, "place")) as f:
                if f.read() != api.place:
                    continue  # a pool of another region, account or endpoint: not this API's
        except OSError:
            continue
        pool = os.path.basename(folder)[len(FOLDER_PREFIX) :].rsplit("-", 1)[0]
        clients.setdefault(pool, set()).add(client)
        folders.setdefault(pool, []).append(folder)
    dead, skipped = set(), set()
    for pool, owners in clients.items():
        if pool in stopped:
            continue
        # a started stopped pool's resources name its new client and an old one: alive
        # when any of them is
        alive = [client_alive(client) for client in owners]
        if any(alive):
            continue
        if None in alive:
            skipped.add(pool)
        else:
            dead.add(pool)
    orphans = Orphans(
        pools=tuple(sorted(dead)),
        instances=tuple(
            sorted(i["InstanceId"] for i in instances if _tag(i, "flotilla:pool") in dead)
        ),
        security_groups=tuple(
            sorted(g["GroupId"] for g in groups if _tag(g, "flotilla:pool") in dead)
        ),
        folders=tuple(sorted(f for p in dead for f in folders.get(p, []))),
        skipped=tuple(sorted(skipped)),
        placement_groups=tuple(
            sorted(g["GroupName"] for g in placements if _tag(g, "flotilla:pool") in dead)
        ),
        stopped=tuple(sorted(stopped)),
    )
    if dry_run:
        return orphans
    if orphans.instances:
        terminate(api, [{"Name": "instance-id", "Values": list(orphans.instances)}], set(), 600)
    for group in orphans.security_groups:
        delete_group(api, group, 600)
    for name in orphans.placement_groups:
        delete_placement_group(api, name)
    for folder in orphans.folders:
        shutil.rmtree(folder, ignore_errors=True)
    return orphans


def terminate(api: Api, filters: list[dict[str, Any]], known: set[str], timeout: float) -> None:
    """Terminate the instances ``filters`` select (and the ``known`` ids), then wait until
    every one is terminated (ProvisionError after ``timeout`` s)."""
    reply = api.call("ec2", "describe_instances", "find the pool's instances", Filters=filters)
    found = {
        i["InstanceId"]: i["State"]["Name"] for r in reply["Reservations"] for i in r["Instances"]
    }
    # known ids the filter missed (their tags not applied?) are terminated too
    ids = sorted({i for i, state in found.items() if state != "terminated"} | (known - set(found)))
    if not ids:
        return
    try:
        api.raw("ec2", "terminate_instances", InstanceIds=ids)
    except Exception as e:
        if error_code(e) != "InvalidInstanceID.NotFound":
            raise translate(e, "terminate the pool's instances") from e
        return
    deadline = time.monotonic() + timeout
    delay = 0.1
    while True:
        reply = api.call(
            "ec2", "describe_instances", "check the instances terminated", InstanceIds=ids
        )
        left = [
            i["InstanceId"]
            for r in reply["Reservations"]
            for i in r["Instances"]
            if i["State"]["Name"] != "terminated"
        ]
        if not left:
            return
        if time.monotonic() > deadline:
            raise translate(
                TimeoutError(f"instances {', '.join(left)} still not terminated"),
                "terminate the pool's instances",
            )
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


def delete_group(api: Api, group: str, timeout: float) -> None:
    """Delete security group ``group``, waiting while terminated instances still hold it."""
    _delete(
        api,
        ("delete_security_group", {"GroupId": group}),
        gone="InvalidGroup.NotFound",
        busy="DependencyViolation",
        what=f"delete security group {group}",
        timeout=timeout,
    )


def delete_placement_group(api: Api, name: str, timeout: float = 600.0) -> None:
    """Delete placement group ``name``, waiting while terminated instances still count as
    in it."""
    _delete(
        api,
        ("delete_placement_group", {"GroupName": name}),
        gone="InvalidPlacementGroup.Unknown",
        busy="InvalidPlacementGroup.InUse",
        what=f"delete placement group {name}",
        timeout=timeout,
    )


def _delete(
    api: Api, call: tuple[str, dict[str, str]], gone: str, busy: str, what: str, timeout: float
) -> None:
    """Make the EC2 ``call`` that deletes something; gone already (error ``gone``) is fine,
    and while it is still in use (error ``busy``) it is tried again, backing off, until
    ``timeout`` s have passed."""
    deadline = time.monotonic() + timeout
    delay = 0.5
    while True:
        try:
            api.raw("ec2", call[0], **call[1])
            return
        except Exception as e:
            code = error_code(e)
            if code == gone:
                return
            if code != busy or time.monotonic() > deadline:
                raise translate(e, what) from e
        time.sleep(delay)
        delay = min(delay * 2, 10.0)
