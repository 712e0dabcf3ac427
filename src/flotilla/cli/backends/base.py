"""What every command-line backend is made of: :class:`ProviderSpec` (its options, as the
cluster's state file records them), :class:`Flag` (its ``flotilla launch`` flags) and
:class:`Backend` (the behaviour: flags to spec, task checks, provider factory, hooks when a
cluster is up or taken down, ``flotilla ssh``). See ``registry`` for how they are listed.

This module and the backend modules import nothing heavy: every command reads them. A
backend imports its provider (``flotilla._providers...``) inside :meth:`make_provider`.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Self, TypeVar

from ..._errors import ConfigurationError
from ..._providers.options import Option, options, shown, task_values

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import ClusterRecord, NodeRecord, Paths
    from ..taskfile import Task


@dataclass(frozen=True)
class ProviderSpec:
    """A cluster's provider and its options: plain data, kept in the cluster's state file
    (:meth:`to_dict`, with ``kind``) and turned into a provider by the cluster's daemon.
    Each backend subclasses it with its own documented fields; checks of the values alone
    go in ``__post_init__`` (raising ConfigurationError, before anything starts)."""

    kind: ClassVar[str] = ""
    """The backend's name: ``--provider KIND``, ``"kind"`` in the state file."""

    settings: tuple[tuple[str, Any], ...] = ()
    """The provider settings the cluster was given (flags, the task file's ``config:`` and
    ``resources``): (field, value) pairs in field-name order; every other field is the
    settings class's default (:meth:`Backend.settings_of` makes the settings object)."""

    max_hourly_cost: float | None = None
    """The most the cluster may cost per hour in USD (the task's
    ``resources.max_hourly_cost``), for a provider that knows its prices; None: no limit."""

    max_node_hourly_cost: float | None = None
    """The most one node may cost per hour in USD (the task's
    ``resources.max_node_hourly_cost``, ``Compute(max_node_hourly_cost=)``); None: no limit."""

    def __post_init__(self) -> None:
        pairs = {str(k): frozen(v) for k, v in self.settings}
        object.__setattr__(self, "settings", tuple(sorted(pairs.items())))

    def value(self, name: str, default: Any = None) -> Any:
        """The setting ``name`` as given (``default`` when it was not)."""
        return dict(self.settings).get(name, default)

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-ready data (tuples as lists), ``kind`` included."""
        data = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        return {"kind": self.kind, **data}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> ProviderSpec:
        """The spec from :meth:`to_dict`'s data; unknown keys (``kind``, fields of another
        flotilla version) are ignored, lists become tuples."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        values["settings"] = tuple(data.get("settings", ()))  # lists again tuples: see init
        return cls(**{k: v for k, v in values.items() if k in known})

    def describe(self) -> str:
        """How messages name where the cluster runs."""
        return self.kind

    def max_nodes(self) -> int | None:
        """How many nodes this provider can start (None: no limit)."""
        return None


def frozen(value: Any) -> Any:
    """``value`` as a spec keeps it (hashable, the same after the state file's JSON):
    lists as tuples, mappings as sorted (key, value) pairs."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class Flag:
    """A command-line flag a backend adds to ``flotilla launch`` (in its own help group).

    Attributes:
        name: the flag, e.g. ``--hosts``; its value is ``args.<name without dashes, - as _>``.
        help: the help text.
        switch: an on/off flag (no value; False unless given).
        metavar: how the help shows its value (default: argparse's).
        type: converts the value (e.g. ``int``); argparse reports what it refuses.
        choices: the values allowed (empty: any).
    """

    name: str
    help: str
    switch: bool = False
    metavar: str | None = None
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] = ()
    setting: str = ""
    """The provider settings field it sets ("" for none); see :meth:`Backend.all_flags`."""
    value: Any = True
    """A switch's value when given (the field's default is the other one)."""

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def given(self, args: argparse.Namespace) -> bool:
        """Whether the command line set this flag."""
        return getattr(args, self.dest, None) not in (None, False)


@dataclass(frozen=True)
class PoolResources:
    """What a cluster's pool asks of every node, given to ``Compute`` by the daemon (the
    provider acts on it: a SLURM ``--gres``/``--cpus-per-task``/``--mem``, an instance type).

    Attributes:
        accelerator: accelerators per node, e.g. ``"A100:8"`` (None: none asked for).
        vcpus: CPUs per node (None: the provider's default).
        memory_gb: memory per node in GiB (None: the provider's default).
        max_hourly_cost: the most the whole pool may cost per hour, USD (None: no limit).
        max_node_hourly_cost: the most one node may cost per hour, USD (None: no limit).
    """

    accelerator: str | None = None
    vcpus: float | None = None
    memory_gb: float | None = None
    max_hourly_cost: float | None = None
    max_node_hourly_cost: float | None = None


@dataclass(frozen=True)
class ResourceSpec(ProviderSpec):
    """A spec whose provider acts on the task's per-node resources (a SLURM job's
    ``--gres``/``--cpus-per-task``/``--mem``, an instance type): they come from the task
    (:meth:`with_task_resources`), never from flags, and go to the pool as they are.

    Attributes:
        accelerator: accelerators per node (``A100:8``, the task's ``accelerators``).
        vcpus: CPUs per node (the task's ``cpus``).
        memory_gb: memory per node in GiB (the task's ``memory``).
    """

    where: ClassVar[str] = ""
    """The setting (a name, or names) that messages show after the kind, when set."""
    shown: ClassVar[str] = " ({})"
    """How they show it (``{}``: its value)."""

    accelerator: str | None = None
    vcpus: float | None = None
    memory_gb: float | None = None

    def describe(self) -> str:
        place = self.value(self.where) if self.where else None
        if isinstance(place, tuple | list):
            place = ", ".join(place)
        return self.kind + (self.shown.format(place) if place else "")

    def with_task_resources(self, task: Task, **changes: Any) -> Self:
        """This spec with the task's resources (and ``changes``)."""
        res = task.resources
        return replace(
            self,
            accelerator=res.accelerators,
            vcpus=amount(res.cpus, "cpus"),
            memory_gb=amount(res.memory, "memory"),
            **changes,
        )


@dataclass(frozen=True)
class ShellCommand:
    """What ``flotilla ssh`` executes (it replaces the CLI process).

    Attributes:
        argv: the program and its arguments (looked up on PATH).
        env: the environment (None: the CLI's own).
        cwd: the directory to run in (None: the current one).
        note: a line to tell the user first ('' for none).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    note: str = ""


HINTS = (
    "infra",
    "region",
    "zone",
    "instance_type",
    "image_id",
    "use_spot",
    "network_tier",
    "disk_size",
    "disk_tier",
    "labels",
    "cpus",
    "memory",
    "ports",
)
"""Task ``resources`` fields a backend may not act on: set ones outside its ``honours``
are reported as warnings, in this order."""

S = TypeVar("S", bound=ProviderSpec)


class Backend(ABC, Generic[S]):
    """One provider kind on the command line.

    Attributes:
        spec_type: its :class:`ProviderSpec` subclass (``spec_type.kind`` is its name).
        summary: what ``--provider KIND`` means, for ``--help``.
        flags: ``flotilla launch`` flags of its own, beside the ones derived from
            ``settings_type`` (see :attr:`all_flags`). Giving one without ``--provider``
            selects this backend; giving one with another ``--provider`` is an error.
        settings_type: the provider's settings dataclass (None: it has none): every field
            not in ``fixed`` is a flag (``flotilla._providers.options``), a task file's
            ``config: {KIND: {FIELD: VALUE}}`` key and, where its metadata says so, set by
            the task's ``resources``.
        fixed: the provider's settings fields the command line sets itself, and how
            (``{"workdir": "the cluster's folder"}``): no flag, no ``config:`` key.
        shares_filesystem: every node runs on this machine (node paths are kept apart,
            ``~`` in a file mount is the node's folder, one node does machine-wide work).
        stop_note: '' when ``flotilla stop`` can stop its clusters, keeping their nodes'
            disks and environments (agents stopped; ``start`` starts them again); else why
            it cannot (``stop`` then refuses, offering ``down``).
        honours: the task ``resources`` fields (of :data:`HINTS`) it acts on besides those
            its settings' fields name as their source.
        hint_reason: why it cannot act on the others (shown with the warning).
        infra: the task-file ``resources.infra`` names (the part before any ``/``:
            ``aws`` of ``aws/us-east-1``) that choose this backend when the command line
            names none; such an ``infra`` is acted on, not warned about.
    """

    spec_type: type[S]
    summary: ClassVar[str]
    flags: ClassVar[tuple[Flag, ...]] = ()
    settings_type: ClassVar[type[Any] | None] = None
    fixed: ClassVar[Mapping[str, str]] = {}
    shares_filesystem: ClassVar[bool] = False
    stop_note: ClassVar[str] = "its nodes cannot be stopped and started again"
    honours: ClassVar[frozenset[str]] = frozenset()
    hint_reason: ClassVar[str] = "its nodes already exist"
    infra: ClassVar[tuple[str, ...]] = ()

    @property
    def kind(self) -> str:
        return self.spec_type.kind

    # -- the command line ---------------------------------------------------------------
    def options(self) -> tuple[Option, ...]:
        """The provider's options the command line sets (not :attr:`fixed`)."""
        if self.settings_type is None:
            return ()
        return tuple(o for o in options(self.settings_type, self.kind) if o.name not in self.fixed)

    @property
    def all_flags(self) -> tuple[Flag, ...]:
        """Its own :attr:`flags`, then one per option (a secret has none)."""
        derived = tuple(
            Flag(
                o.flag,
                o.help,
                switch=o.switch,
                type=o.parse,
                choices=o.choices,
                setting=o.name,
                value=not o.default,
            )
            for o in self.options()
            if o.flag is not None
        )
        return (*self.flags, *derived)

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        """Add its flags to ``parser``, in a help group named after the backend."""
        if not self.all_flags:
            return
        group = parser.add_argument_group(f"--provider {self.kind}")
        for flag in self.all_flags:
            if flag.switch:
                group.add_argument(flag.name, action="store_true", help=flag.help)
            else:
                group.add_argument(
                    flag.name,
                    help=flag.help,
                    metavar=flag.metavar,
                    type=flag.type,
                    choices=flag.choices or None,
                )

    def given_flags(self, args: argparse.Namespace) -> list[str]:
        """The names of this backend's flags the command line set."""
        return [f.name for f in self.all_flags if f.given(args)]

    def given_settings(self, args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
        """The (field, value) of every settings flag the command line set."""
        given = [
            (f, f.value if f.switch else getattr(args, f.dest))
            for f in self.all_flags
            if f.setting and f.given(args)
        ]
        return tuple((f.setting, tuple(v) if isinstance(v, list) else v) for f, v in given)

    def spec_from_args(self, args: argparse.Namespace) -> S:
        """The spec the command line asks for: the settings its flags give (paths made
        absolute: the daemon runs elsewhere). Checked with the task (:meth:`with_task`)."""
        return self.spec_type(settings=self.given_settings(args))

    def with_task(self, spec: S, task: Task) -> S:
        """``spec`` completed with what the task file asks of this provider: its
        ``config: {KIND: {...}}`` settings, then its ``resources`` (the fields whose
        metadata names a source, see ``options.From``; for a :class:`ResourceSpec` also
        accelerators, CPUs and memory). The command line wins over ``config:``, which wins
        over ``resources``, which win over the configuration files' defaults
        (:meth:`file_values`)."""
        if self.settings_type is not None:
            res = task.resources
            detail = infra_detail(res.infra) if infra_name(res.infra) in self.infra else None
            hints = {f.name: getattr(res, f.name) for f in fields(res)}
            values = {
                **self.file_values(),
                **{
                    k: v
                    for k, v in task_values(self.settings_type, detail, hints).items()
                    if k not in self.fixed
                },
                **self.config_values(task),
                **dict(spec.settings),
            }
            spec = replace(spec, settings=tuple(values.items()))
        if isinstance(spec, ResourceSpec):
            spec = spec.with_task_resources(task)
        return replace(
            spec,
            max_hourly_cost=task.resources.max_hourly_cost,
            max_node_hourly_cost=task.resources.max_node_hourly_cost,
        )

    def file_values(self) -> dict[str, Any]:
        """The configuration files' defaults of this provider (``_providers.config_files``: the
        user's ``config.yaml``, the project's ``.flotilla.yaml`` over it), checked there;
        the fields the command line sets itself (:attr:`fixed`) are ``Compute``'s only."""
        from ..._providers import config_files as config

        if self.kind not in config.KINDS:
            return {}
        given = config.load().defaults(self.kind)
        return {k: v for k, v in given.items() if k not in self.fixed}

    def config_values(self, task: Task) -> dict[str, Any]:
        """The task file's ``config: {KIND: {FIELD: VALUE}}`` settings of this provider; a
        ConfigurationError for a field it has not, or one the command line sets itself."""
        given: dict[str, Any] = {}
        for key in dict.fromkeys((self.kind, *self.infra)):  # k8s, or SkyPilot's kubernetes
            given.update(task.config.get(key) or {})
        if not given:
            return {}
        known = {o.name: o for o in self.options()}
        for name in given:
            if name in known and not known[name].secret:
                continue
            line = task.lines.get(f"config.{self.kind}.{name}", 0)
            where = f"{task.path}:{line}: " if task.path and line else ""
            every = {f.name for f in fields(self.settings_type)} if self.settings_type else set()
            if name in every:
                why = self.fixed.get(name) or "a secret: never in a task file"
                raise ConfigurationError(
                    f"{where}config.{self.kind}.{name}: not a task-file setting ({why})"
                )
            raise ConfigurationError(
                f"{where}config.{self.kind}.{name}: the {self.kind} provider has no such "
                f"setting (it has: {', '.join(known) or 'none'})"
            )
        return given

    def settings_of(self, spec: S, **fixed: Any) -> Any:
        """The provider's settings object for ``spec`` (with the :attr:`fixed` values the
        command line sets itself): checked; a ConfigurationError names the flag too."""
        assert self.settings_type is not None
        values = {**dict(spec.settings), **fixed}
        for o in options(self.settings_type, self.kind):
            if o.mapping and isinstance(values.get(o.name), tuple):
                values[o.name] = dict(values[o.name])  # kept as pairs (see frozen)
        try:
            return self.settings_type(**values)
        except ConfigurationError as e:
            flags = [o.flag for o in self.options() if o.flag and f"{o.name}=" in str(e)]
            if not flags:
                raise
            raise ConfigurationError(f"{e} (the command line's {flags[0]})") from None

    def check_spec(self, spec: S) -> None:
        """Refuse a spec whose settings the provider would refuse, before anything starts."""
        if self.settings_type is not None:
            self.settings_of(spec)

    def describe_plan(self, spec: S) -> dict[str, Any]:
        """What ``launch --dryrun`` shows of ``spec``: the provider, every setting (secrets
        as ``***``) and what the pool asks of every node."""
        plan: dict[str, Any] = {"provider": self.kind, "where": spec.describe()}
        if self.settings_type is not None:
            settings = shown(self.settings_of(spec))
            plan["settings"] = {k: v for k, v in settings.items() if k not in self.fixed}
            plan["set_by_flotilla"] = dict(self.fixed)
        plan["per_node"] = asdict(self.pool_resources(spec))
        plan["max_hourly_cost"] = plan["per_node"].pop("max_hourly_cost")
        plan["max_node_hourly_cost"] = plan["per_node"].pop("max_node_hourly_cost")
        return plan

    def spec_from_dict(self, data: Mapping[str, Any]) -> S:
        """The spec kept in a state file (one of an older flotilla, whose settings were
        fields of the spec, too)."""
        if self.settings_type is not None:
            names = {f.name for f in fields(self.settings_type)}
            names -= {f.name for f in fields(self.spec_type)}
            old = {k: v for k, v in data.items() if k in names and v is not None}
            if old:
                settings = {**old, **dict(map(tuple, data.get("settings", ())))}
                data = {**data, "settings": list(settings.items())}
        spec = self.spec_type.from_fields(data)
        assert isinstance(spec, self.spec_type)
        return spec

    # -- task files ---------------------------------------------------------------------
    def check_task(self, task: Task, spec: S, cluster_nodes: int) -> list[str]:
        """What this provider cannot honour in a task: a ConfigurationError for a
        requirement (too many nodes, GPUs this machine lacks), a warning (returned) for
        each hint it cannot act on."""
        self.check_nodes(spec, cluster_nodes)
        warnings = self.check_resources(task, spec, cluster_nodes)
        res = task.resources
        values: dict[str, object] = {
            "infra": res.infra,
            "region": res.region,
            "zone": res.zone,
            "instance_type": res.instance_type,
            "image_id": res.image_id,
            "use_spot": res.use_spot or None,
            "network_tier": res.network_tier if res.network_tier == "best" else None,
            "disk_size": res.disk_size,
            "disk_tier": res.disk_tier,
            "labels": dict(res.labels) or None,
            "cpus": res.cpus,
            "memory": res.memory,
            "ports": ",".join(res.ports) or None,
        }
        sources = {s for o in self.options() if o.task for s in o.task.sources} - {"infra"}
        honours = self.honours | sources
        for name in HINTS:
            value = values[name]
            if name == "infra" and infra_name(res.infra) in self.infra:
                continue
            if value is not None and name not in honours:
                warnings.append(
                    f"{task_location(task, name)}resources.{name}: {value!r} is a hint the "
                    f"{self.kind} provider cannot act on ({self.hint_reason}); ignored"
                )
        return warnings

    def check_nodes(self, spec: S, cluster_nodes: int) -> None:
        """Raise a ConfigurationError when the provider cannot start ``cluster_nodes``."""
        limit = spec.max_nodes()
        if limit is not None and cluster_nodes > limit:
            raise ConfigurationError(
                f"{cluster_nodes} nodes wanted but the {self.kind} provider has {limit}: "
                f"use --nodes {limit}"
            )

    def check_resources(self, task: Task, spec: S, cluster_nodes: int) -> list[str]:
        """Check the ``resources`` fields this backend honours; warnings about them."""
        return []

    # -- the cluster daemon -------------------------------------------------------------
    def pool_resources(self, spec: S) -> PoolResources:
        """What the cluster's pool asks of every node: a :class:`ResourceSpec`'s resources,
        else nothing in particular; and the task's price limits."""
        pool, node = spec.max_hourly_cost, spec.max_node_hourly_cost
        if isinstance(spec, ResourceSpec):
            return PoolResources(spec.accelerator, spec.vcpus, spec.memory_gb, pool, node)
        return PoolResources(max_hourly_cost=pool, max_node_hourly_cost=node)

    @abstractmethod
    def make_provider(self, spec: S, nodes_dir: Path) -> Provider:
        """The flotilla provider for ``spec``; ``nodes_dir`` is the cluster's own folder on
        this machine for nodes' working directories (used by providers whose nodes run
        here)."""

    def on_up(self, paths: Paths, spec: S, nodes: Sequence[NodeRecord]) -> None:
        """The cluster's nodes are running. Default: for a provider reached over ssh
        (:meth:`ssh_login`), the cluster's ssh_config entries (``NAME``, ``NAME-workerK``,
        the pool's key and pinned host keys), which ``~/.ssh/config`` includes (see
        ``sshconfig``); a node whose login is unknown (yet) is left out."""
        blocks = []
        for node in nodes:
            try:
                login = self.ssh_login(paths, spec, nodes, node.node)
            except (ConfigurationError, OSError):
                continue
            if login:
                blocks.append(ssh_block(ssh_alias(paths.name, node.node), login, node.workdir))
        if blocks:
            from ..._system.private import private_dir

            private_dir(paths.ssh_config.parent)
            header = f"# flotilla cluster {paths.name}: generated, removed by `flotilla down`\n"
            paths.ssh_config.write_text(header + "".join(blocks))

    def ssh_login(self, paths: Paths, spec: S, nodes: Sequence[NodeRecord], node: int) -> list[str]:
        """The ``ssh`` arguments (options, then ``USER@HOST``) that log in to node ``node``
        as its pool does, for a provider reached over ssh; empty for the others (their
        channel is ``kubectl exec``, ``podman exec``, ``srun``, a local shell)."""
        return []

    def stop_refusal(self, paths: Paths, spec: S) -> str:
        """Why ``flotilla stop`` cannot stop this cluster ('' when it can); default:
        :attr:`stop_note`."""
        return self.stop_note

    def autostop_refusal(self, spec: S) -> str:
        """Why ``launch --autostop`` (without ``--down``) cannot stop such a cluster
        ('' when it can: by default, an idle cluster's pool is closed and the record says
        STOPPED; ``start`` provisions it again)."""
        return ""

    def before_close(self, provider: Provider, keep: bool) -> None:
        """The cluster's daemon is about to close its pool: to stop the cluster
        (``keep``: the nodes' disks are to stay, for ``flotilla start``) or to tear it
        down. Default: nothing to tell the provider."""

    def restartable(self, paths: Paths) -> bool:
        """Whether a cluster whose start failed still has its stopped nodes (so
        ``flotilla start`` may try again). Default: no."""
        return False

    def on_down(self, paths: Paths, record: ClusterRecord) -> None:
        """``flotilla down``: the daemon is gone (or was already); clean up what it may
        have left behind on this machine before the cluster's files are removed."""

    def remove_folder(self, spec: S, folder: str) -> None:
        """Remove ``folder`` (relative to the nodes' working folder: a managed job's
        ``managed/ID``) that a cluster made on its machines, once its agents are gone.
        Default: nothing (the machines went with the pool, or the agents removed it)."""

    def remove_orphans(self, spec: S, dry_run: bool) -> list[str]:
        """``flotilla down --orphans --provider KIND [its flags]``: remove what pools of
        killed clients left behind (only those: a live client's pool is never touched),
        where ``spec``'s settings say (the same flags as ``launch``: ``--region``,
        ``--namespace``); one line per finding. Default: nothing can be left (a provider
        whose nodes end with the client)."""
        return [f"the {self.kind} provider leaves nothing behind when its client dies"]

    # -- show-gpus, check ---------------------------------------------------------------
    def market_provider(self) -> Provider | None:
        """A provider with this machine's defaults whose offers ``flotilla show-gpus``
        lists (None: this kind has no offers: its machines already exist)."""
        return None

    def check(self) -> str:
        """``flotilla check``: whether this provider can be used from here (a line saying
        so); a FlotillaError or OSError saying why not."""
        return "nothing to configure"

    # -- flotilla ssh -------------------------------------------------------------------
    @abstractmethod
    def shell(
        self, paths: Paths, spec: S, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        """How to open a shell (``command`` empty) or run ``command`` in the working
        directory of node ``node`` of a running cluster."""


@dataclass(frozen=True)
class RentedSpec(ResourceSpec):
    """A :class:`RentedBackend`'s spec; the task's resources (see :class:`ResourceSpec`)
    select the offers. ``where`` names the setting (a name, or names) that messages show
    after the kind."""


def rented_spec(kind: str, where: str) -> type[RentedSpec]:
    """The :class:`RentedSpec` of ``--provider KIND`` (``where``: see there)."""
    members = {"kind": kind, "where": where, "__doc__": f"``--provider {kind}``'s spec."}
    spec: type[RentedSpec] = dataclass(frozen=True)(
        type(f"{kind.title()}Spec", (RentedSpec,), members)
    )
    return spec


class RentedBackend(Backend[S]):
    """A cloud whose machines are rented for the cluster and given back by ``flotilla
    down`` (Vast.ai, RunPod, Lambda Cloud, Compute Engine): its provider class, built from
    the spec's settings, makes the pool, removes orphans, lists offers and checks the
    credentials; the ``ssh_login(address)`` of its ``pool`` module logs in to a node.

    Attributes:
        package: the provider's package under ``flotilla._providers`` (imported when used,
            so that every command starts as fast).
        provider_name: the provider class in that package.
        removes: what ``down --orphans`` says it would do (dry run) and did.
        orphan_kinds: (what, field of the provider's orphan findings) of each kind of
            thing it removes.
        ssh_config: whether ``flotilla launch`` writes the nodes' ``ssh_config`` blocks.
        stoppable: ``flotilla stop`` stops the instances, their disks kept, and ``start``
            starts the same ones again (``_providers.cloud.stopstart``; the provider's
            ``keep`` is the cluster's folder ``KIND/``); spot ones are refused.
    """

    package: ClassVar[str]
    provider_name: ClassVar[str]
    removes: ClassVar[tuple[str, str]] = ("would destroy", "destroyed")
    orphan_kinds: ClassVar[tuple[tuple[str, str], ...]] = (("instance(s)", "instances"),)
    ssh_config: ClassVar[bool] = True
    stoppable: ClassVar[bool] = False

    def provider_class(self) -> Any:
        """The provider class (``package.provider_name``)."""
        module = importlib.import_module(f"..._providers.{self.package}", __package__)
        return getattr(module, self.provider_name)

    def make_provider(self, spec: S, nodes_dir: Path) -> Provider:
        provider: Provider = self.provider_class().from_settings(self.settings_of(spec))
        if self.stoppable:
            from ..._providers.cloud.kept import Keep

            provider.keep = Keep(nodes_dir.parent / self.kind)  # type: ignore[attr-defined]
        return provider

    # -- stop and start (a stoppable cloud's) -------------------------------------------
    def _keep(self, paths: Paths) -> Any:
        from ..._providers.cloud.kept import Keep

        return Keep(paths.dir / self.kind)

    def _kept(self, paths: Paths) -> Any:
        """The cluster's kept pool record (None: none, or unreadable)."""
        try:
            return self._keep(paths).load() if self.stoppable else None
        except ConfigurationError:
            return None

    def stop_refusal(self, paths: Paths, spec: S) -> str:
        if not self.stoppable:
            return self.stop_note
        kept = self._kept(paths)
        if self.settings_of(spec).allocation == "spot" or (kept is not None and kept.spot):
            return f"its instances are {self.kind} spot instances, which are never stopped"
        return ""

    def autostop_refusal(self, spec: S) -> str:
        allocation = self.settings_of(spec).allocation if self.stoppable else "on-demand"
        if allocation != "on-demand":
            return f"{self.kind} spot instances are never stopped (allocation {allocation})"
        return ""

    def before_close(self, provider: Provider, keep: bool) -> None:
        """Closing the pool stops the instances (``keep``) or removes them."""
        folder = getattr(provider, "keep", None)
        if folder is not None:
            folder.stop = keep

    def restartable(self, paths: Paths) -> bool:
        kept = self._kept(paths)
        return kept is not None and kept.stopped

    def on_down(self, paths: Paths, record: ClusterRecord) -> None:
        """``down`` of a stopped cluster (or one whose daemon died): remove its kept
        instances and the kept keys."""
        if not self.stoppable:
            return
        keep = self._keep(paths)
        kept = keep.load()  # unreadable: say so (its instances are not forgotten silently)
        if kept is not None and kept.stopped:
            provider = self.provider_class().from_settings(
                self.settings_of(self.spec_from_dict(record.provider))
            )
            provider.remove_kept(kept)
        keep.forget()

    def remove_orphans(self, spec: S, dry_run: bool) -> list[str]:
        """What pools whose client (a killed program, or a cluster daemon) on this machine
        is gone left behind, found by their label or name; pools of other machines'
        clients are listed, not touched."""
        provider = self.provider_class().from_settings(self.settings_of(spec))
        found = provider.remove_orphans(dry_run=dry_run)
        removed = [(what, getattr(found, field)) for what, field in self.orphan_kinds]
        return orphan_lines(found.pools, self.removes[not dry_run], removed, found.skipped)

    def market_provider(self) -> Provider:
        provider: Provider = self.provider_class()()
        return provider

    def check(self) -> str:
        line: str = self.provider_class()().check()
        return line

    def pool_login(self, address: str) -> list[str]:
        """``ssh`` arguments logging in to the node at ``address`` as its pool does."""
        module = importlib.import_module(f"..._providers.{self.package}.pool", __package__)
        login: list[str] = module.ssh_login(address)
        return login

    def ssh_login(self, paths: Paths, spec: S, nodes: Sequence[NodeRecord], node: int) -> list[str]:
        """The pool's login to the node (its address, the pool's key, its pinned host
        keys) when :attr:`ssh_config`; else none."""
        return self.pool_login(nodes[node].ip) if self.ssh_config else []

    def shell(
        self, paths: Paths, spec: S, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        return ssh_command(self.pool_login(nodes[node].ip), nodes[node].workdir, command)


def orphan_lines(
    pools: Sequence[str],
    verb: str,
    removed: Sequence[tuple[str, Sequence[object]]],
    skipped: Sequence[str],
) -> list[str]:
    """``flotilla down --orphans``'s lines: the orphan pools, what of each kind ``verb``
    (``would destroy``, ``destroyed``...) names was removed, the pools of other machines'
    clients (not checked)."""
    lines = [f"{len(pools)} orphan pool(s){': ' if pools else ''}" + ", ".join(pools)]
    for what, items in removed:
        if items:
            lines.append(f"{verb} {len(items)} {what}: {', '.join(map(str, items))}")
    if skipped:
        lines.append(f"not checked (clients on other machines): {', '.join(skipped)}")
    return lines


def ssh_alias(cluster: str, node: int) -> str:
    """A node's ``Host`` name in the cluster's ssh_config: ``NAME`` (the head) and
    ``NAME-workerK``, as SkyPilot names them."""
    return cluster if node == 0 else f"{cluster}-worker{node}"


def ssh_block(alias: str, login: Sequence[str], workdir: str) -> str:
    """The ssh_config ``Host`` block of ``ssh LOGIN`` (``-i KEY``, ``-p PORT``,
    ``-o Key=Value``, then ``USER@HOST``)."""
    user, _, host = login[-1].rpartition("@")
    lines = [f"Host {alias}", f"  HostName {host}"] + ([f"  User {user}"] if user else [])
    words = list(login[:-1])
    while words:
        flag = words.pop(0)
        value = words.pop(0) if words else ""
        if flag == "-i":
            lines.append(f"  IdentityFile {value}")
        elif flag == "-p":
            lines.append(f"  Port {value}")
        elif flag == "-o":
            key, _, setting = value.partition("=")
            lines.append(f"  {key} {setting}")
    lines.append(f"  # working directory: {workdir}")
    return "\n".join(lines) + "\n"


def infra_name(infra: str | None) -> str:
    """The provider part of a task's ``resources.infra`` (``aws`` of ``aws/us-east-1``)."""
    return (infra or "").split("/", 1)[0].strip().lower()


def infra_detail(infra: str | None) -> str | None:
    """The part of ``resources.infra`` after the provider (``us-east-1`` of
    ``aws/us-east-1``), or None."""
    _, _, rest = (infra or "").partition("/")
    return rest.strip() or None


def amount(text: str | None, field: str) -> float | None:
    """A task's ``cpus``/``memory`` value ("4", "4+": at least 4) as a number (None when
    unset); a ConfigurationError when it is not one."""
    if text is None:
        return None
    try:
        value = float(str(text).strip().rstrip("+"))
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigurationError(
            f"resources.{field}: {text!r} is not a positive number (e.g. 4 or 4+)"
        )
    return value


def ssh_shell(workdir: str, command: str) -> tuple[tuple[str, ...], str]:
    """(ssh's ``-t`` when a terminal is wanted, the remote command) of ``flotilla ssh``
    over ssh: ``command``, or a login shell, in the node's ``workdir``."""
    remote = f"cd {shlex.quote(workdir)} && " + (command or "exec ${SHELL:-bash} -l")
    return ("-t",) if not command and sys.stdin.isatty() else (), remote


def ssh_command(login: Sequence[str], workdir: str, command: str) -> ShellCommand:
    """``flotilla ssh`` as ``ssh LOGIN``: ``command``, or a login shell, in ``workdir``."""
    tty, remote = ssh_shell(workdir, command)
    return ShellCommand(("ssh", *login, *tty, remote))


def task_location(task: Task, name: str) -> str:
    """``file:line: `` of ``resources.<name>`` in the task file, for messages."""
    where = task.path
    line = task.lines.get(f"resources.{name}", 0)
    if not line and name == "infra":
        line = task.lines.get("resources.cloud", 0)
    return f"{where}:{line}: " if where and line else (f"{where}: " if where else "")


def check_gpus(want: int, gpus_by_node: list[int]) -> None:
    """After provisioning (remote hosts' GPUs are known only then): every node must have
    ``want`` accelerators."""
    short = [i for i, have in enumerate(gpus_by_node) if have < want]
    if want and short:
        raise ConfigurationError(
            f"resources.accelerators: the task needs {want} GPU(s) per node but node(s) "
            f"{', '.join(map(str, short))} have "
            f"{', '.join(str(gpus_by_node[i]) for i in short)}"
        )
