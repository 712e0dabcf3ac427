"""The command line's backends (provider kinds), and the only place that lists them.

A backend is one module in this folder (see ``local.py``, ``ssh.py``) that defines:

1. a :class:`~.base.ProviderSpec` subclass: a frozen dataclass with ``kind = "NAME"`` (a
   ClassVar: ``--provider NAME``, ``"kind"`` in the state file); the provider's options
   are its ``settings`` (kept in the state file), never fields of its own;
2. a :class:`~.base.Backend` subclass over that spec (``Backend[MySpec]``), whose typed
   members are

   - ``spec_type``: the spec class; ``summary``: one line for ``--help``;
   - ``settings_type``: the provider's settings class, from which its ``flotilla launch``
     flags, its task-file ``config:`` keys and ``resources`` mapping are derived
     (``flotilla._providers.options``; ``fixed``: the fields the command line sets itself);
   - ``infra``: task-file ``resources.infra`` names that choose it;
   - task-file checks: ``check_nodes(spec, n)``, ``check_resources(task, spec, n)``,
     ``honours`` / ``hint_reason`` (which ``resources`` it acts on; warnings for the rest);
   - ``make_provider(spec, nodes_dir) -> Provider`` (imports its provider there),
     ``pool_resources(spec)`` (the pool's accelerator, vcpus, memory_gb) and
     ``shares_filesystem``;
   - hooks: ``on_up(paths, spec, nodes)`` once the cluster runs, ``on_down(paths, record)``
     at ``flotilla down``;
   - ``shell(paths, spec, nodes, node, command) -> ShellCommand``: ``flotilla ssh``;
3. ``BACKEND``: its one instance.

Adding a provider kind (SLURM, AWS...) is adding such a module and its ``BACKEND`` to
:data:`BACKENDS` below: nothing else in the command line names provider kinds (a test
checks it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError
from . import aws, container, gcp, k8s, lambda_cloud, local, plugin, runpod, slurm, ssh, vast, verda
from .base import Backend, ProviderSpec, ShellCommand, infra_name

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths
    from ..taskfile import Task

BACKENDS: tuple[Backend[Any], ...] = (
    local.BACKEND,
    ssh.BACKEND,
    slurm.BACKEND,
    aws.BACKEND,
    k8s.BACKEND,
    vast.BACKEND,
    runpod.BACKEND,
    lambda_cloud.BACKEND,
    gcp.BACKEND,
    verda.BACKEND,
    container.BACKEND,
)
"""Every backend, the default (used when the command line names none) first."""

DEFAULT = BACKENDS[0]


def kinds() -> list[str]:
    """The names of every backend, as ``--provider`` takes them."""
    return [b.kind for b in BACKENDS]


def backend(kind: str) -> Backend[Any]:
    """The backend named ``kind`` (a built-in one, else a provider another package
    registers: see ``plugin``); a ConfigurationError listing the known ones otherwise."""
    for b in BACKENDS:
        if b.kind == kind:
            return b
    if kind == FALLBACK.kind:  # a task's candidates (not a --provider)
        return FALLBACK
    found = plugin.plugin_backend(kind)
    if found is None:
        others = ", ".join(plugin.entry_points())
        raise ConfigurationError(
            f"unknown provider {kind!r}: flotilla has {', '.join(kinds())}"
            + (f"; other packages add {others}" if others else "")
        )
    return found


def backend_for(spec: ProviderSpec) -> Backend[Any]:
    """The backend a spec belongs to."""
    return backend(spec.kind)


def spec_from_dict(data: Mapping[str, Any]) -> ProviderSpec:
    """A spec from a state file's ``provider`` entry (``kind`` and the options)."""
    spec: ProviderSpec = backend(str(data.get("kind", DEFAULT.kind))).spec_from_dict(data)
    return spec


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--provider`` and every backend's own flags."""
    parser.add_argument(
        "--provider",
        metavar="{" + ",".join(kinds()) + ",...}",
        help="where nodes run: "
        + "; ".join(f"{b.kind}: {b.summary}" for b in BACKENDS)
        + f" (default: {DEFAULT.kind}); or a provider another package registers (entry "
        f"point group {plugin.GROUP})",
    )
    for b in BACKENDS:
        b.add_flags(parser)
    o = plugin.OPTION
    parser.add_argument(o.name, action="append", metavar=o.metavar, help=o.help)


def spec_from_args(args: argparse.Namespace, task: Task | None = None) -> ProviderSpec | None:
    """The provider the command line asks for: ``--provider``, else the backend whose flags
    were given, else the one the task's ``resources.infra`` names (see ``Backend.infra``);
    None when nothing asks for one in particular. A backend's flag given with another
    backend is a ConfigurationError."""
    given = {b.kind: b.given_flags(args) for b in BACKENDS}
    chosen: str | None = args.provider
    if task is not None and task.resources.candidates:
        return fallback_spec(backend(chosen) if chosen else None, DEFAULT, args, task)
    if chosen is None:
        implied = [kind for kind, flags in given.items() if flags]
        if not implied and task is not None:
            name = infra_name(task.resources.infra)
            implied = [b.kind for b in BACKENDS if name and name in b.infra]
        if not implied:
            return None
        chosen = implied[0]
    for kind, flags in given.items():
        if kind != chosen and flags:
            raise ConfigurationError(
                f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} for --provider {kind}"
                + (f", not {chosen}" if args.provider else "")
            )
    b = backend(chosen)
    if getattr(args, plugin.OPTION.dest, None) and not isinstance(b, plugin.PluginBackend):
        raise ConfigurationError(
            f"{plugin.OPTION.name} is for providers from other packages, not {chosen}: "
            "use its own flags (flotilla launch --help)"
        )
    spec: ProviderSpec = b.spec_from_args(args)
    if task is not None:
        spec = b.with_task(spec, task)
    else:  # `down --orphans --provider aws`: where the configured defaults put clusters
        settings = {**b.file_values(), **dict(spec.settings)}
        spec = replace(spec, settings=tuple(settings.items()))
    b.check_spec(spec)  # the provider's own checks, before anything starts
    return spec


# -- a task's alternatives ----------------------------------------------------------------------
# A task whose ``resources`` have alternatives (``any_of``, ``ordered``, accelerator sets):
# a cluster tried on each candidate in turn (see ``flotilla._providers.fallback``). Each
# candidate is a complete provider spec of its own backend (the one its ``infra`` names, else
# the one the command line names), kept in the cluster's state file; the daemon makes a
# ``Fallback`` of them, each with its own per-node resources. ``any_of`` and accelerator sets
# try the cheapest first, ``ordered`` and accelerator lists in order.


@dataclass(frozen=True)
class FallbackSpec(ProviderSpec):
    """Candidates tried in turn.

    Attributes:
        candidates: each candidate's spec, as its state-file data (JSON text, ``kind``
            included), in the task's order.
        allocation: ``"ordered"`` or ``"cheapest"``.
    """

    kind = "fallback"

    candidates: tuple[str, ...] = ()
    allocation: str = "ordered"

    def specs(self) -> list[ProviderSpec]:
        return [spec_from_dict(json.loads(c)) for c in self.candidates]

    def describe(self) -> str:
        order = " then " if self.allocation == "ordered" else " or "
        return "(" + order.join(s.describe() for s in self.specs()) + ")"


def fallback_spec(
    chosen: Backend[Any] | None, default: Backend[Any], args: argparse.Namespace, task: Task
) -> FallbackSpec:
    """The spec of a task with candidates: each candidate's backend is ``chosen`` (the
    command line named one), else the one its ``infra`` names, else ``default``; the
    command line's flags of a backend apply to its candidates."""
    specs = []
    for res in task.resources.candidates:
        b = chosen
        if b is None:
            name = infra_name(res.infra)
            b = next((x for x in BACKENDS if name and name in x.infra), default)
        spec = b.spec_from_args(args) if b is chosen or b.given_flags(args) else b.spec_type()
        one = replace(task, resources=replace(res, candidates=()))
        spec = b.with_task(spec, one)
        b.check_spec(spec)
        specs.append(spec)
    return FallbackSpec(
        candidates=tuple(json.dumps(s.to_dict()) for s in specs),
        allocation="ordered" if task.resources.ordered else "cheapest",
        max_hourly_cost=task.resources.max_hourly_cost,
    )


class FallbackBackend(Backend[FallbackSpec]):
    spec_type = FallbackSpec
    summary = "a task's resources.any_of / ordered: candidates tried in turn"
    hint_reason = "each candidate's provider reports them"

    def spec_from_args(self, args: argparse.Namespace) -> FallbackSpec:
        raise ConfigurationError(
            "candidates come from a task file's resources.any_of / resources.ordered or an "
            "accelerator set, not from --provider"
        )

    def spec_from_dict(self, data: Mapping[str, Any]) -> FallbackSpec:
        spec = FallbackSpec.from_fields(data)
        assert isinstance(spec, FallbackSpec)
        return spec

    def check_task(self, task: Task, spec: FallbackSpec, cluster_nodes: int) -> list[str]:
        warnings: list[str] = []
        for res, one in zip(task.resources.candidates, spec.specs(), strict=False):
            b = backend_for(one)
            b.check_nodes(one, cluster_nodes)
            sub = replace(task, resources=replace(res, candidates=()))
            warnings += b.check_resources(sub, one, cluster_nodes)
        return warnings

    def describe_plan(self, spec: FallbackSpec) -> dict[str, Any]:
        """Each candidate's plan, in the order they are tried (``cheapest``: by price)."""
        return {
            "provider": self.kind,
            "where": spec.describe(),
            "allocation": spec.allocation,
            "candidates": [backend_for(one).describe_plan(one) for one in spec.specs()],
        }

    def make_provider(self, spec: FallbackSpec, nodes_dir: Path) -> Provider:
        from ..._providers.fallback import Candidate, Fallback

        candidates = []
        for i, one in enumerate(spec.specs()):
            b = backend_for(one)
            wants = b.pool_resources(one)
            provider = b.make_provider(one, nodes_dir / f"candidate-{i}")
            candidates.append(
                Candidate(
                    provider,
                    wants.accelerator,
                    wants.vcpus,
                    wants.memory_gb,
                    wants.max_node_hourly_cost,
                )
            )
        return Fallback(candidates, spec.allocation)

    def shell(
        self,
        paths: Paths,
        spec: FallbackSpec,
        nodes: Sequence[NodeRecord],
        node: int,
        command: str,
    ) -> ShellCommand:
        """The shell of the candidate whose nodes these are (the first that knows them)."""
        errors = []
        for one in spec.specs():
            try:
                return backend_for(one).shell(paths, one, nodes, node, command)
            except ConfigurationError as e:
                errors.append(str(e))
        raise ConfigurationError("; ".join(errors) or "no candidate")

    def ssh_login(
        self, paths: Paths, spec: FallbackSpec, nodes: Sequence[NodeRecord], node: int
    ) -> list[str]:
        """The login of the candidate whose nodes these are (the first that knows them)."""
        for one in spec.specs():
            try:
                login = backend_for(one).ssh_login(paths, one, nodes, node)
            except ConfigurationError:
                continue
            if login:
                return login
        return []


FALLBACK = FallbackBackend()
"""A task's candidates (not a ``--provider``: found by its kind, see :func:`backend`)."""
