"""The Vast instances of one pool: rent, reach, replace, destroy (see ``provider``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import ipaddress
import json
import logging
import shutil
import time
from typing import Any

from ..._errors import ProvisionCause, ProvisionError
from ..._wire.protocol import CLOUD_ENV
from ..base import AgentProcess, AllocationState, Machine, PoolSpec
from ..cloud import login
from ..cloud.allocation import CloudAllocation, show
from ..cloud.identity import client_id, pool_folder
from ..cloud.keys import keygen, pin
from ..cloud.market import label, over_budget, pool_ids, release_each
from ..ssh_shell import Target
from .api import VastApi, VastApiError
from .choice import Choice, choose, describe, query
from .onstart import contact, onstart_script, poweroff_command
from .settings import VastSettings

logger = logging.getLogger("flotilla.vast")

FOLDER_PREFIX = "flotilla-vast-"
RUNTYPE = "ssh_direc ssh_proxy"
"""SSH launch mode, direct connections (``get_runtype``, vast.py 1456-1475)."""
POLL = 0.2


def ssh_port(row: dict[str, Any]) -> int:
    """The public port mapped to an instance's port 22 (``ssh_url``, vast.py 3346-3352),
    0 when not mapped yet (``row``: the instance as the API lists it)."""
    mapped = (row.get("ports") or {}).get("22/tcp") or []
    with contextlib.suppress(KeyError, IndexError, TypeError, ValueError):
        return int(mapped[0]["HostPort"])
    return 0


class VastAllocation(CloudAllocation):
    """The Vast instances of one pool.

    Attributes:
        choice: the offers rented (one per node) and their cluster.
        instances: instance id -> its last description, for every instance rented.
        overlay: the pool's overlay network's name ("" for none).
        subnet: the overlay's internal subnet.
        hourly: what the pool's instances cost per hour, as offered.
    """

    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=8, thread_name_prefix="flotilla-vast"
    )

    def __init__(self, settings: VastSettings, api: VastApi, spec: PoolSpec, url: str) -> None:
        super().__init__(spec, [])
        self.state = AllocationState.ACQUIRING
        self.settings = settings
        self.api = api
        self.url = url
        self.choice: Choice | None = None
        self.instances: dict[int, dict[str, Any]] = {}
        self.overlay = ""
        self.subnet = ""
        self.hourly = 0.0
        self._open(settings, pool_folder(FOLDER_PREFIX, spec.pool_id))
        self.label = label(spec.pool_id, client_id())
        self._launches = 0
        self._targets: dict[str, Target] = {}
        self._gone: set[int] = set()  # instances destroyed while the pool runs
        self._renting: set[Any] = set()  # machines an instance is being rented on

    # -- launch ------------------------------------------------------------------------
    async def launch(self) -> None:
        spec = self.spec
        offers, _ = await asyncio.gather(self._in_thread(self.search), self._make_login_key())
        cheapest = 0.0
        if spec.max_nodes:  # elastic: rents one by one (``candidate``), where max could fit
            most = dataclasses.replace(spec, nodes=spec.most)
            self.choice = choice = choose(offers, most, self.settings)
            cheapest = min(float(o.get("dph_total") or 0) for o in choice.offers)
            over_budget(
                cheapest,
                spec.max_hourly_cost,
                f"the cheapest Vast offer for a node of {describe(spec, self.settings)} costs",
            )
            rented: list[dict[str, Any]] = []
        else:
            self.choice = choice = choose(offers, spec, self.settings, spec.max_hourly_cost)
            rented = list(choice.offers)
            self.hourly = choice.hourly
        gpus = {str(o.get("gpu_name")) for o in choice.offers}
        where = f"cluster {choice.cluster_id}" if choice.cluster_id is not None else "any machines"
        count = f"up to {spec.most}" if spec.max_nodes else str(spec.nodes)
        price = (
            f"from ${cheapest:.2f}/h a node"
            if spec.max_nodes
            else f"${choice.hourly:.2f}/h for the pool"
        )
        _show(
            f"Vast: {count} x {describe(spec, self.settings)} -> {', '.join(sorted(gpus))} "
            f"on {where}, {price} (offers "
            f"{', '.join(str(o['id']) for o in choice.offers)})"
        )
        if choice.cluster_id is not None:
            self.overlay = f"flotilla-{spec.pool_id}"
            await self._in_thread(self._create_overlay, choice.cluster_id)
        ids = await self._rent(rented) if rented else []
        self.machines = [
            Machine(rank, f"vast-{i}", str(self.instances[i].get("public_ipaddr", "")), str(i))
            for rank, i in enumerate(ids)
        ]
        self.state = AllocationState.READY

    def _create_overlay(self, cluster_id: int) -> None:
        with self.creating("overlay network", self.overlay):
            self.api.call(
                "POST",
                "/overlay/",
                "create the pool's overlay network",
                {"cluster_id": cluster_id, "name": self.overlay},
            )

    def search(self) -> list[dict[str, Any]]:
        """The offers that fit one node of the pool, cheapest first (``/bundles/``)."""
        reply = self.api.call("POST", "/bundles/", "search offers", query(self.spec, self.settings))
        return list(reply.get("offers", []))

    async def _rent(self, offers: list[dict[str, Any]]) -> list[int]:
        """Rent ``offers`` (one instance each, at once), attach the login key, join the
        overlay, wait until every one runs with its SSH port mapped; their ids in order."""
        assert self.login_key is not None
        self._launches += 1
        host_key = await self._in_thread(
            keygen, self.folder, f"host_key_{self._launches}", f"flotilla-{self.spec.pool_id}"
        )
        script = onstart_script(
            self.spec.pool_id,
            host_key,
            self.url,
            self.settings.workdir,
            self.settings.ttl,
            self.spec.options.start_timeout,
        )
        results = await asyncio.gather(
            *(self._in_thread(self._rent_one, o, script) for o in offers), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        ids = [r for r in results if isinstance(r, int)]
        if self.overlay:
            reply = await self._in_thread(
                self.api.call, "GET", "/overlay/", "look up the pool's overlay network"
            )
            for o in reply if isinstance(reply, list) else []:
                if o.get("name") == self.overlay:
                    self.subnet = str(o.get("internal_subnet") or "")
        await self._in_thread(self._wait_running, ids)
        for i in ids:
            target = self._target(i)
            self._targets[str(i)] = target
            pin(self.known_hosts, f"[{target.host}]:{target.port}", host_key)
        return ids

    def _remember(self, machine: Machine) -> None:
        """Record where ``machine`` (by the address peers know) is reached over SSH, for
        ``flotilla ssh`` (:func:`ssh_login`)."""
        login.remember(self.folder, machine.address, self._targets[machine.ident])

    def _rent_one(self, offer: dict[str, Any], script: str) -> int:
        body: dict[str, Any] = {
            "client_id": "me",
            "image": self.settings.image,
            "env": {},
            "price": None,
            "disk": self.settings.disk_gb,
            "label": self.label,
            "extra": None,
            "onstart": script,
            "image_login": None,
            "python_utf8": False,
            "lang_utf8": False,
            "use_jupyter_lab": False,
            "jupyter_dir": None,
            "force": False,
            "cancel_unavail": True,
            "template_hash_id": None,
            "runtype": RUNTYPE,
        }
        try:
            with self.creating("instance", self.label):
                reply = self.api.call(
                    "PUT", f"/asks/{offer['id']}/", f"rent offer {offer['id']}", body
                )
        except VastApiError as e:
            if e.error in ("no_such_ask", "unavailable") or e.status in (400, 404, 410):
                raise ProvisionError(
                    f"Vast: offer {offer['id']} (machine {offer.get('machine_id')}) was taken "
                    f"before it could be rented: {e}; try again",
                    cause=ProvisionCause.CAPACITY,
                ) from None
            raise
        ident = int(reply["new_contract"])
        self.instances[ident] = {"id": ident, "machine_id": offer.get("machine_id")}
        assert self.login_key is not None
        self.api.call(
            "POST",
            f"/instances/{ident}/ssh/",
            f"attach the pool's SSH key to instance {ident}",
            {"ssh_key": self.login_key.public},
        )
        if self.overlay:
            self.api.call(
                "PUT",
                "/overlay/",
                f"join instance {ident} to the overlay network",
                {"name": self.overlay, "instance_id": ident},
            )
        return ident

    def _wait_running(self, ids: list[int]) -> None:
        deadline = time.monotonic() + self.spec.options.start_timeout
        waiting = set(ids)

        def step() -> bool:
            rows = self.api.call("GET", "/instances", "list the pool's instances", owner="me")
            for row in rows.get("instances", []):
                ident = int(row.get("id", 0))
                if ident in self.instances:
                    self.instances[ident] = row
                if ident in waiting and row.get("actual_status") == "running" and ssh_port(row):
                    waiting.discard(ident)
            return not waiting

        def late() -> str:
            states = ", ".join(
                f"{i}: {self.instances.get(i, {}).get('actual_status', 'unknown')}"
                for i in sorted(waiting)
            )
            return (
                f"Vast instances not running within {self.spec.options.start_timeout:g} s "
                f"({states}); Options(start_timeout=...) sets the limit"
            )

        self.poll(step, deadline, late, POLL)

    def _target(self, ident: int) -> Target:
        row = self.instances[ident]
        return Target(str(row["public_ipaddr"]), "root", ssh_port(row))

    # -- agents ------------------------------------------------------------------------
    handover = "installed through its on-start script"
    prefix = "vast-"

    def target(self, machine: Machine) -> Target:
        return self._targets[machine.ident]

    async def start_agent(self, machine: Machine) -> AgentProcess:
        """Wait for the mapped SSH port, then start the agent over SSH with the pinned host
        key (retried as on a booting instance until the start timeout, see
        ``cloud.allocation``) while learning the instance's overlay address (a cluster
        pool), which becomes the agent's address."""
        target = self.target(machine)
        deadline = time.monotonic() + self.spec.options.start_timeout
        await self.wait_ssh(machine, deadline)
        if not self.subnet:
            self._remember(machine)
            return await self.start_pinned(machine, deadline)
        probe = asyncio.create_task(self._overlay_address(machine, target, deadline))
        start = asyncio.create_task(self.start_pinned(machine, deadline))
        try:
            addr, agent = await asyncio.gather(probe, start)
        except BaseException:
            for t in (probe, start):
                t.cancel()
            done = await asyncio.gather(probe, start, return_exceptions=True)
            if isinstance(done[1], AgentProcess):
                await done[1].terminate()
            raise
        machine = dataclasses.replace(machine, address=addr)
        for rank, m in enumerate(self.machines):
            if m.ident == machine.ident:
                self._machines[rank] = machine
        agent.address = addr
        self._remember(machine)
        return agent

    async def _overlay_address(self, machine: Machine, target: Target, deadline: float) -> str:
        """The instance's address in the overlay's subnet (asked over SSH)."""
        net = ipaddress.ip_network(self.subnet, strict=False)
        argv = self.ssh.ssh_argv(target, "hostname -I 2>/dev/null || ip -o -4 addr show")
        said = ""
        while True:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await proc.communicate()
            said = err.decode(errors="replace").strip()
            for word in out.decode(errors="replace").replace("/", " ").split():
                with contextlib.suppress(ValueError):
                    if ipaddress.ip_address(word) in net:
                        return word
            if "REMOTE HOST IDENTIFICATION" in said or "Host key verification failed" in said:
                raise ProvisionError(
                    f"vast-{machine.ident}: REFUSED: the instance does not present the SSH "
                    f"host key flotilla generated for it ({said.splitlines()[-1]})",
                    cause=ProvisionCause.IDENTITY,
                )
            if time.monotonic() > deadline:
                raise ProvisionError(
                    f"vast-{machine.ident}: no address in the overlay network {self.overlay} "
                    f"({self.subnet}){': ' + said if said else ''}",
                    cause=ProvisionCause.NODE,
                )
            await asyncio.sleep(0.2)

    def agent_env(self, machine: Machine) -> dict[str, str]:
        """``FLOTILLA_CLOUD``: the watchdog destroys the instance ``ttl`` s after the
        client's last contact (see ``onstart``)."""
        settings = {
            "contact": contact(self.settings.workdir, machine.ident),
            "ttl": self.settings.ttl,
            "poweroff": poweroff_command(self.settings.workdir, machine.ident),
            "imds": "",
        }
        return {CLOUD_ENV: json.dumps(settings)}

    # -- replace -----------------------------------------------------------------------
    async def replacement(self, rank: int, reason: str) -> Machine:
        """Destroy the lost instance (its machine may then take the new one), then rent
        one new instance for ``rank`` on a machine none of the other ranks uses: in the
        pool's cluster, joined to its overlay (a cluster pool), or anywhere."""
        if self.state is not AllocationState.READY:
            raise ProvisionError(
                f"cannot replace node {rank}: the pool's allocation is {self.state.value}"
            )
        old = self.machines[rank]
        try:  # release() destroys it in any case
            await self._in_thread(self._destroy, int(old.ident))
        except ProvisionError as e:
            logger.warning("%s: %s", old.ident, e)
        self._gone.add(int(old.ident))
        machine = await self._rent_another(rank, f"node {rank}: {reason}", "to replace it with")
        self.hourly -= float(self.instances[int(old.ident)].get("dph_total") or 0)
        logger.info("node %d: %s replaced by %s (%s)", rank, old.ident, machine.ident, reason)
        return machine

    async def _rent_another(self, rank: int, why: str, what: str) -> Machine:
        """Rent one instance for ``rank``: the cheapest offer on a machine no other
        instance of the pool is on (or being rented on), in the pool's cluster (a cluster
        pool, joined to its overlay) or anywhere. ProvisionError (CAPACITY, ``why`` first,
        "no offer left ``what``") when there is none."""
        offers = await self._in_thread(self.search)
        taken = set(self._renting) | {
            row.get("machine_id") for i, row in self.instances.items() if i not in self._gone
        }
        free = [o for o in offers if o.get("machine_id") not in taken]
        cluster = self.choice.cluster_id if self.choice is not None else None
        fits = [o for o in free if cluster is None or o.get("cluster_id") == cluster]
        if not fits:
            elsewhere = len(free)
            raise ProvisionError(
                f"{why}; Vast has no offer left {what}"
                + (
                    f" in cluster {cluster} ({elsewhere} offer(s) on other machines: a "
                    "cluster pool's nodes share the cluster's overlay network, so a "
                    "node cannot be on another cluster; Options(cluster=False) "
                    "pools take any machine)"
                    if cluster is not None
                    else ""
                ),
                cause=ProvisionCause.CAPACITY,
            )
        offer = fits[0]
        on = offer.get("machine_id")
        self._renting.add(on)  # (on the loop: no other pick meanwhile)
        before = set(self.instances)
        try:
            (ident,) = await self._rent([offer])
        except BaseException:  # rented but not running: destroyed now, not at the release
            for i, row in list(self.instances.items()):
                if i not in before and row.get("machine_id") == on:
                    self._gone.add(i)
                    with contextlib.suppress(Exception):
                        await self._in_thread(self._destroy, i)
            raise
        finally:
            self._renting.discard(on)
        self.hourly += float(offer.get("dph_total") or 0)
        return Machine(
            rank, f"vast-{ident}", str(self.instances[ident].get("public_ipaddr", "")), str(ident)
        )

    # -- elastic pools: one instance more, one fewer -------------------------------------
    async def candidate(self, rank: int) -> Machine | None:
        """Rent one instance (an elastic pool grows; see :meth:`_rent_another`); a
        ProvisionError leaves the pool at its size, and it asks again later."""
        if self.state is not AllocationState.READY:
            raise ProvisionError(f"cannot add a node: the pool's allocation is {self.state.value}")
        return await self._rent_another(rank, "the pool cannot grow", "to add a node on")

    async def give_back(self, machine: Machine, failed: bool) -> None:
        """Destroy the instance of a node the pool released (drained first, see
        ``_client/elastic.py``) or whose agent did not start: its bill stops there. A
        failure is logged: the release destroys it (by the pool's label) in any case."""
        ident = int(machine.ident)
        try:
            await self._in_thread(self._destroy, ident)
        except ProvisionError as e:
            logger.warning("vast-%s: %s", ident, e)
            return
        self._gone.add(ident)
        self.hourly -= float(self.instances.get(ident, {}).get("dph_total") or 0)

    # -- release -----------------------------------------------------------------------
    def _destroy(self, ident: int) -> None:
        self.api.delete(f"/instances/{ident}/", f"destroy instance {ident}")

    def sweep(self) -> None:
        """Destroy everything of the pool (:meth:`_release`; synchronous, see
        ``base.Allocation.sweep``), then remove its local folder."""
        try:
            self._release()
        except Exception as e:
            _show(f"Vast: could not release everything of pool {self.spec.pool_id}: {e}")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _release(self) -> None:
        """Destroy every instance of the pool (the ones rented, and any the API lists with
        the pool's label: a rent whose answer was lost), then its overlay network."""
        ids = set(self.instances)
        with contextlib.suppress(ProvisionError):
            rows = self.api.call("GET", "/instances", "list the pool's instances", owner="me")
            found = pool_ids(rows.get("instances", []), "label", self.spec.pool_id)
            ids |= {int(i) for i in found}
        errors = release_each(sorted(ids), self._destroy)
        if self.overlay:
            try:
                self.api.delete(
                    "/overlay/", "delete the pool's overlay network", {"overlay_name": self.overlay}
                )
            except VastApiError as e:
                errors.append(str(e))
        if errors:
            raise ProvisionError("; ".join(errors))


def ssh_login(address: str) -> list[str]:
    """``ssh`` arguments that log in to the running pool instance whose peers' address is
    ``address`` as its pool does: its public address and mapped port, the pool's login key
    and pinned host key (for ``flotilla ssh``). ConfigurationError when no live pool of
    this user has it."""
    return login.ssh_login(FOLDER_PREFIX, address, "Vast")


def _show(message: str) -> None:
    show(logger, message)
