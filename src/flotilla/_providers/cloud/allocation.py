"""The allocation of a cloud pool: instances reached over SSH with the host key the pool
made pinned (``keys``), their agents started by the launch layer once their SSH port
answers (``boot.wait_port``), a start that fails as on a booting instance tried again
(:class:`CloudShell`'s ``transient()``, ``boot.booting``) until the start timeout.

An :class:`InstanceAllocation`'s instances also come and go one at a time (``candidate``,
``give_back``, ``replacement``): an elastic pool grows by one instance (made where there is
room, waited for until it runs; one made that does not come up is ended at once, not at the
release) and shrinks by ending one; a lost node's instance is ended and another made."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from ..._errors import ProvisionCause, ProvisionError
from ..._wire.protocol import CLOUD_ENV
from ..base import AgentProcess, AllocationState, Machine, PoolSpec
from ..bootstrap import NoAnswer
from ..launch import ShellAllocation, start_remote_agent
from ..ssh_shell import SSHShell, Target
from . import login
from .boot import booting, wait_port
from .guard import contact_path, guard_command
from .identity import client_id, pool_folder
from .keys import KeyPair, keygen, pin
from .market import label, over_budget, pool_ids, release_each

_T = TypeVar("_T")
logger = logging.getLogger("flotilla.cloud")


class CloudShell(SSHShell):
    """``ssh`` to a cloud instance, its host key pinned (never trusted on first use): a
    start that ssh ends as on a booting instance is tried again every 0.2-1 s."""

    retry_first = 0.2
    retry_max = 1.0

    def transient(self, failure: NoAnswer) -> bool:
        return super().transient(failure) or booting(failure)


class CloudAllocation(ShellAllocation):
    """Instances reached through a :class:`CloudShell`. A subclass sets ``shell`` and
    implements :meth:`target` (where a machine's sshd is) and acquiring, replacing and
    releasing its instances.

    Attributes:
        handover: how the pool's host key reached the instances, in the refusal of one
            that presents another key.
        prefix: before a machine's id in its name ("vast-").
        executor: the threads of the cloud's blocking API calls (one pool of them per
            cloud, shared by its allocations).
        shell_type: the shell that reaches the instances (:class:`CloudShell`, or one
            that tries more failures again).
    """

    shell: CloudShell
    ssh: CloudShell
    settings: Any
    folder: str
    known_hosts: str
    login_key: KeyPair | None
    handover = "installed at its start"
    prefix = ""
    executor: ClassVar[concurrent.futures.ThreadPoolExecutor]
    shell_type: ClassVar[type[CloudShell]] = CloudShell

    def guard(self, poweroff: Sequence[str]) -> str:
        """The boot guard of the pool's instances (``guard.guard_command``): ``poweroff``
        after ``max(ttl, start_timeout)`` s unless an agent started, per the pool's
        settings (``ttl``, ``workdir``, ``ssh_user``)."""
        settings = self.settings
        return guard_command(
            settings.ttl,
            self.spec.options.start_timeout,
            settings.workdir,
            settings.ssh_user,
            poweroff,
        )

    def poll(
        self, step: Callable[[], bool], deadline: float, late: Callable[[], str], every: float
    ) -> None:
        """Call ``step`` every ``every`` s until it says it is done (it raises when an
        instance ended); ProvisionError when the pool is released meanwhile, or (TIMEOUT)
        saying ``late()`` past ``deadline``."""
        while not step():
            if self.ending.is_set():
                raise ProvisionError(f"pool {self.spec.pool_id}: released while starting")
            if time.monotonic() > deadline:
                raise ProvisionError(late(), cause=ProvisionCause.TIMEOUT)
            time.sleep(every)

    def _open(self, settings: Any, folder: str) -> None:
        """The pool's side on this machine: its private ``folder`` (keys, known_hosts),
        the login key to come (:meth:`_make_login_key`), and the shell that reaches its
        instances with their host keys pinned, per ``settings`` (``python``, ``workdir``,
        ``connect_timeout``)."""
        self.folder = folder
        self.known_hosts = os.path.join(folder, "known_hosts")
        self.login_key = None
        self._key_numbers = itertools.count(1)
        self.python = settings.python or "python3"
        self.workdir = settings.workdir
        self.ssh = self.shell_type(
            self.target,
            key=None,
            known_hosts=self.known_hosts,
            accept_new_host_keys=False,
            connect_timeout=settings.connect_timeout,
        )
        self.shell = self.ssh

    async def _make_login_key(self) -> KeyPair:
        """The pool's login key, made in its folder; the shell logs in with it."""
        key = await self._in_thread(
            keygen, self.folder, "login_key", f"flotilla-{self.spec.pool_id}"
        )
        self.login_key = key
        self.ssh.key = key.path
        return key

    def new_host_key(self) -> KeyPair:
        """A new SSH host key for the instances made next, in the pool's folder (numbered:
        ``next()`` of a count is atomic, so concurrent grow steps never share a file)."""
        number = next(self._key_numbers)
        return keygen(self.folder, f"host_key_{number}", f"flotilla-{self.spec.pool_id}")

    async def _in_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in one of :attr:`executor`'s threads. A cancelled caller does not
        stop the thread: what it creates is recorded before it is sent
        (``base.Allocation.creating``), and the release waits for those calls, so nothing
        made escapes it."""
        return await asyncio.wrap_future(self.executor.submit(fn, *args))

    def target(self, machine: Machine) -> Target:
        """Where ``machine``'s sshd answers."""
        raise NotImplementedError

    def name(self, machine: Machine) -> str:
        """``machine`` in messages: its id (after ``prefix``) and where it is reached."""
        target = self.target(machine)
        port = f":{target.port}" if target.port != 22 else ""
        return f"{self.prefix}{machine.ident} ({target.host}{port})"

    async def start_agent(self, machine: Machine) -> AgentProcess:
        """Wait for the instance's SSH port, then start the agent (:meth:`start_pinned`)."""
        deadline = time.monotonic() + self.spec.options.start_timeout
        await self.wait_ssh(machine, deadline)
        return await self.start_pinned(machine, deadline)

    async def wait_ssh(self, machine: Machine, deadline: float) -> None:
        """Wait until ``machine``'s SSH port accepts connections (until ``deadline``)."""
        target = self.target(machine)
        timeout = self.spec.options.start_timeout
        await wait_port(target.host, target.port, deadline, self.name(machine), timeout)

    async def start_pinned(self, machine: Machine, deadline: float) -> AgentProcess:
        """Start the agent on ``machine`` over SSH with its host key pinned, tried again
        while it fails as on a booting instance, until ``deadline``; ProvisionError naming
        the instance (REFUSED when it presents another host key)."""
        name = self.name(machine)
        try:
            return await start_remote_agent(
                self.shell,
                machine,
                python=self.python,
                workdir=self.workdir,
                timeout=max(1.0, deadline - time.monotonic()),
                env=self.agent_env(machine),
            )
        except ProvisionError as e:
            if e.cause is ProvisionCause.IDENTITY:
                raise ProvisionError(
                    f"{name}: REFUSED: the instance does not present the SSH host key "
                    f"flotilla generated for it and {self.handover} (the connection may be "
                    f"intercepted): {e}",
                    cause=e.cause,
                ) from None
            raise ProvisionError(f"{name}: {e}", cause=e.cause) from None


class InstanceAllocation(CloudAllocation):
    """A cloud pool whose instances are made and ended one at a time (see the module
    docstring): an elastic pool's grow and shrink steps (``candidate``, ``give_back``)
    and a lost node's replacement, over the provider's steps (``create_one``,
    ``wait_one``, ``machine_of``, ``end_one``).

    Attributes:
        costs: what each instance billed now costs per hour (None: not known), by id.
        hourly: what the pool's instances cost per hour now, their sum (None: one's price
            is not known; 0 with none).
    """

    costs: dict[str, float | None]
    hourly: float | None

    def _open(self, settings: Any, folder: str) -> None:
        super()._open(settings, folder)
        self.costs = {}
        self.hourly = 0.0
        self._bill = threading.Lock()  # (instances are billed from the API threads)

    def starts_empty(self, log: logging.Logger, cloud: str, what: str, detail: str = "") -> bool:
        """Whether the pool is elastic (``spec.nodes`` 0: its instances come one at a time,
        :meth:`candidate`). If so it is READY with none, and the console says ``{cloud}: up
        to {max} {what} as the pool grows{detail}``."""
        if self.spec.nodes:
            return False
        show(log, f"{cloud}: up to {self.spec.most} {what} as the pool grows{detail}")
        self.state = AllocationState.READY
        return True

    def tell(self, log: logging.Logger, message: str) -> None:
        """``message`` on the console while the pool starts (:func:`show`); later (a grow
        step or a replacement, tried again with a backoff) in the log only."""
        if self.state is AllocationState.ACQUIRING:
            show(log, message)
        else:
            log.info("%s", message)

    def billed(self, ident: str, price: float | None) -> None:
        """Instance ``ident`` is billed from now, at ``price`` an hour."""
        with self._bill:
            self.costs[ident] = price
            self._total()

    def unbilled(self, ident: str) -> None:
        """Instance ``ident`` ended: its bill stops."""
        with self._bill:
            self.costs.pop(ident, None)
            self._total()

    def _total(self) -> None:
        prices = list(self.costs.values())
        known = [p for p in prices if p is not None]
        self.hourly = None if len(known) < len(prices) else round(sum(known), 4)

    def create_one(self, rank: int) -> str:
        """Create one instance where there is room (the provider's places in order, a
        capacity error moving on) and bill it (:meth:`billed`); its id. ProvisionError
        (CAPACITY) when no place has room. In a thread; ``rank``: the node it is for."""
        raise NotImplementedError

    def wait_one(self, ident: str) -> None:
        """Wait until instance ``ident`` runs, its SSH host key pinned (ProvisionError when
        it ends or the start timeout passes). In a thread."""
        raise NotImplementedError

    def machine_of(self, rank: int, ident: str) -> Machine:
        """Instance ``ident`` (running) as the machine at ``rank``."""
        raise NotImplementedError

    def end_one(self, ident: str) -> None:
        """End instance ``ident``; one already gone is no error. In a thread."""
        raise NotImplementedError

    def ready_for(self, what: str) -> None:
        """ProvisionError saying ``what`` cannot be done unless the allocation is READY."""
        if self.state is not AllocationState.READY:
            raise ProvisionError(f"{what}: the pool's allocation is {self.state.value}")

    async def add_instance(self, rank: int) -> Machine:
        """One instance more, running, for ``rank``; one made that does not come up is
        ended now (not at the release)."""
        ident = await self._in_thread(self.create_one, rank)
        try:
            await self._in_thread(self.wait_one, ident)
        except Exception:
            with contextlib.suppress(Exception):
                await self.end_instance(ident)
            raise
        return self.machine_of(rank, ident)

    async def end_instance(self, ident: str) -> None:
        """End instance ``ident``: its bill stops."""
        await self._in_thread(self.end_one, ident)
        self.unbilled(ident)

    async def candidate(self, rank: int) -> Machine | None:
        """One instance more (an elastic pool grows, see ``_client/elastic.py``). A
        ProvisionError leaves the pool at its size, and it asks again later."""
        self.ready_for("cannot add a node")
        return await self.add_instance(rank)

    async def give_back(self, machine: Machine, failed: bool) -> None:
        """End the instance of a node the pool released (drained first) or whose agent did
        not start: its bill stops there. A failure is logged: the release ends every
        instance of the pool in any case."""
        try:
            await self.end_instance(machine.ident)
        except ProvisionError as e:
            logger.warning("%s: %s", machine.ident, e)
            return
        logger.info("%s ended (%s)", machine.ident, "did not start" if failed else "released")

    async def replacement(self, rank: int, reason: str) -> Machine:
        """End the lost node's instance (the release ends it if this fails), then add one
        for ``rank``."""
        self.ready_for(f"cannot replace node {rank}")
        old = self.machines[rank]
        try:
            await self.end_instance(old.ident)
        except ProvisionError as e:
            logger.warning("%s: %s", old.ident, e)
        machine = await self.add_instance(rank)
        logger.info("node %d: %s replaced by %s (%s)", rank, old.ident, machine.ident, reason)
        return machine


GUARD_ID = "flotilla"
"""The name the boot guard and the watchdog give the contact file of an instance that ends
itself (:class:`SelfEnding`: one pool per instance; the cloud gives it no id to read)."""


def as_root(script: str) -> list[str]:
    """``sh {script}`` as root (the login user through ``sudo -n``): what the watchdog and
    the guard run when the client is gone, on an instance that ends itself."""
    return [
        "sh",
        "-c",
        f'if [ "$(id -u)" = 0 ]; then exec sh {script}; else exec sudo -n sh {script}; fi',
    ]


class SelfEnding(InstanceAllocation):
    """Instances reached at their ``ip`` as ``settings.ssh_user`` that end themselves
    through their cloud's API with a root-only script of their own (``poweroff``) when the
    client is gone (Lambda Cloud, Verda: no credential scoped to one instance).

    Attributes:
        instances: instance id -> its last description.
    """

    cloud: ClassVar[str]
    """The cloud in messages ("Lambda Cloud")."""
    poweroff: ClassVar[list[str]]
    label_key: ClassVar[str]
    """The field of an instance's row that holds its pool's label."""
    cloud_log: ClassVar[logging.Logger]
    noun: ClassVar[str]
    """The cloud before "instance" in messages ("Lambda")."""
    running: ClassVar[str]
    """The status of an instance that runs ("active")."""
    ended: ClassVar[frozenset[str]]
    """The statuses of an instance that will not run."""
    gone: ClassVar[frozenset[str]]
    """The statuses of an instance the release need not end."""
    show_status = False
    """Whether "ended while starting" says the status it ended in."""
    folder_prefix: ClassVar[str]
    """The start of its pools' folders' names on this machine ("flotilla-lambda-")."""
    instances: dict[str, dict[str, Any]]
    settings: Any
    api: Any
    _candidates: list[Any]
    _launching: threading.Lock

    def __init__(self, settings: Any, api: Any, spec: PoolSpec) -> None:
        super().__init__(spec, [])
        self.state = AllocationState.ACQUIRING
        self.settings = settings
        self.api = api
        self.instances = {}
        self.ssh_key_id = ""
        self._open(settings, pool_folder(self.folder_prefix, spec.pool_id))
        self.label = label(spec.pool_id, client_id())
        self.key_name = f"flotilla-{spec.pool_id}"
        self._candidates = []
        self._launching = threading.Lock()  # one launch at a time: it chooses the place

    async def launch(self) -> None:
        await self._make_login_key()
        self._candidates = self._affordable(await self._in_thread(self.search))
        await self._in_thread(self._register_key)
        if self.starts_empty(self.cloud_log, self.cloud, "instance(s)", cheapest(self._candidates)):
            return
        ids, where = await self._in_thread(self._launch, self.spec.nodes, None)
        show(self.cloud_log, f"{self.cloud}: {len(ids)} instance(s) in {where}: {', '.join(ids)}")
        await self._in_thread(self.wait_running, ids)
        self.machines = [self._machine(rank, i) for rank, i in enumerate(ids)]
        self.state = AllocationState.READY

    def search(self) -> list[Any]:
        """The instance types that fit the pool, cheapest first."""
        raise NotImplementedError

    def price(self, kind: Any) -> float:
        """What an instance of ``kind`` (one of :meth:`search`'s) costs an hour here."""
        raise NotImplementedError

    def _affordable(self, found: list[Any]) -> list[Any]:
        """Those of ``found`` within ``max_node_hourly_cost`` (ProvisionError when none
        is; when the cheapest pool is over ``max_hourly_cost``)."""
        spec = self.spec
        cap = spec.max_node_hourly_cost
        cheap = [c for c in found if cap is None or self.price(c) <= cap]
        if found and not cheap:
            raise ProvisionError(
                f"every {self.noun} instance type with {spec.accelerator} costs more than "
                f"max_node_hourly_cost=${cap:.2f}/h a node: nothing was rented",
                cause=ProvisionCause.CAPACITY,
            )
        nodes = max(1, spec.nodes)  # an elastic pool (nodes 0): its first node
        if cheap:
            over_budget(
                min(self.price(c) for c in cheap) * nodes,
                spec.max_hourly_cost,
                f"the cheapest {self.noun} instances for {nodes} node(s) cost",
            )
        return cheap

    key_path: ClassVar[str]
    """The API's path of SSH keys ("/ssh-keys")."""
    key_field: ClassVar[str]
    """The field of a key's public half when registering it."""
    key_name: str
    ssh_key_id: str

    def answer_id(self, reply: Any) -> str:
        """The id in the API's answer to a create."""
        raise NotImplementedError

    def _register_key(self) -> None:
        assert self.login_key is not None
        with self.creating("ssh key", self.key_name):
            reply = self.api.call(
                "POST",
                self.key_path,
                "register the pool's SSH key",
                {"name": self.key_name, self.key_field: self.login_key.public},
            )
        self.ssh_key_id = self.answer_id(reply)

    def _launch(self, count: int, where: str | None) -> tuple[list[str], str]:
        """``count`` instances at the first place with room (in ``where`` only when
        given); their ids and the place."""
        raise NotImplementedError

    def place(self, ident: str) -> str:
        """Where instance ``ident`` runs (a region, a location)."""
        raise NotImplementedError

    def create_one(self, rank: int) -> str:
        """One instance, where the pool's instances are (:meth:`place`), anywhere while it
        has none; the types and places with room asked again."""
        with self._launching:
            self._candidates = self._affordable(self.search())
            places = {self.place(i) for i in list(self.costs)}
            (ident,), _ = self._launch(1, min(places) if places else None)
        return ident

    def end_one(self, ident: str) -> None:
        self.end([ident])

    def rows(self) -> list[dict[str, Any]]:
        """The account's instances, as the API lists them."""
        raise NotImplementedError

    def wait_one(self, ident: str) -> None:
        self.wait_running([ident])

    def wait_running(self, ids: list[str]) -> None:
        """Wait until the instances ``ids`` run with an address (``ip``), then pin each
        one's host key."""
        deadline = time.monotonic() + self.spec.options.start_timeout
        waiting = set(ids)

        def step() -> bool:
            listed = {str(r.get("id")): r for r in self.rows() or []}
            for i in list(waiting):
                row = listed.get(i)
                if row is None or row.get("status") in self.ended:
                    status = f" ({(row or {}).get('status', 'gone')})" if self.show_status else ""
                    raise ProvisionError(
                        f"{self.noun} instance {i} ended while starting{status}",
                        cause=ProvisionCause.NODE,
                    )
                self.instances[i].update(row)
                if row.get("status") == self.running and row.get("ip"):
                    waiting.discard(i)
            return not waiting

        self.poll(
            step,
            deadline,
            lambda: (
                f"{self.noun} instances {', '.join(sorted(waiting))} not {self.running} within "
                f"{self.spec.options.start_timeout:g} s; Options(start_timeout=...) sets the limit"
            ),
            0.3,
        )
        for i in ids:
            row = self.instances[i]
            pin(self.known_hosts, str(row["ip"]), row["host_key"])

    def machine_of(self, rank: int, ident: str) -> Machine:
        return self._machine(rank, ident)

    def _machine(self, rank: int, ident: str) -> Machine:
        raise NotImplementedError

    def target(self, machine: Machine) -> Target:
        return Target(str(self.instances[machine.ident]["ip"]), self.settings.ssh_user, 22)

    async def start_agent(self, machine: Machine) -> Any:
        agent = await super().start_agent(machine)
        login.remember(self.folder, machine.address, self.target(machine))
        return agent

    def agent_env(self, machine: Machine) -> dict[str, str]:
        """``FLOTILLA_CLOUD``: the watchdog ends the instance ``ttl`` s after the client's
        last contact (its own script, ``poweroff``)."""
        settings = {
            "contact": contact_path(self.settings.workdir, GUARD_ID),
            "ttl": self.settings.ttl,
            "poweroff": self.poweroff,
            "imds": "",
        }
        return {CLOUD_ENV: json.dumps(settings)}

    def end(self, ids: list[str]) -> None:
        """End the instances ``ids`` (none: nothing)."""
        raise NotImplementedError

    def leftovers(self) -> list[Callable[[], None]]:
        """What the release deletes besides the instances (the pool's SSH key...)."""
        return []

    def sweep(self) -> None:
        """End every instance of the pool (also those the API lists with its label: a
        create whose answer was lost) and delete its :meth:`leftovers`; remove the local
        folder."""
        try:
            ids = set(self.instances)
            with contextlib.suppress(ProvisionError):
                live = [row for row in self.rows() or [] if row.get("status") not in self.gone]
                ids |= pool_ids(live, self.label_key, self.spec.pool_id)
            steps = [lambda: self.end(sorted(ids)), *self.leftovers()]
            errors = release_each(steps, lambda step: step())
            if errors:
                show(
                    self.cloud_log,
                    f"{self.cloud}: could not release everything of pool "
                    f"{self.spec.pool_id}: {'; '.join(errors)}",
                )
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def cheapest(kinds: Sequence[Any]) -> str:
    """`` (NAME, $P/h each)`` of the first of ``kinds`` (instance types with ``name`` and
    ``hourly``, cheapest first), for :meth:`InstanceAllocation.starts_empty`."""
    if not kinds:
        return " (none available now)"
    return f" ({kinds[0].name}, ${kinds[0].hourly:.2f}/h each)"


def show(logger: logging.Logger, message: str) -> None:
    """Log ``message`` and say it on stderr (what the user waits for)."""
    logger.info("%s", message)
    print(f"flotilla: {message}", file=sys.stderr, flush=True)
