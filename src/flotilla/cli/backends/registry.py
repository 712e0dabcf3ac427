"""The command line's backends (provider kinds), and the only place that lists them.

A backend is one module in this folder (see ``local.py``, ``ssh.py``) that defines:

1. a :class:`~.base.ProviderSpec` subclass: a frozen dataclass with ``kind = "NAME"`` (a
   ClassVar: ``--provider NAME``, ``"kind"`` in the state file) and one documented field
   per provider option (kept in the state file; ``__post_init__`` checks them);
2. a :class:`~.base.Backend` subclass over that spec (``Backend[MySpec]``), whose typed
   members are

   - ``spec_type``: the spec class; ``summary``: one line for ``--help``;
   - ``flags``: its ``flotilla launch`` flags (:class:`~.base.Flag`), and
     ``spec_from_args(args) -> spec``; ``with_task(spec, task) -> spec`` adds what a task
     file's ``resources`` ask for;
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
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError
from . import aws, k8s, local, plugin, slurm, ssh
from .base import Backend, ProviderSpec, infra_name

if TYPE_CHECKING:
    from ..taskfile import Task

BACKENDS: tuple[Backend[Any], ...] = (
    local.BACKEND,
    ssh.BACKEND,
    slurm.BACKEND,
    aws.BACKEND,
    k8s.BACKEND,
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
    spec = replace(spec, settings=(*spec.settings, *b.given_settings(args)))
    if task is not None:
        spec = b.with_task(spec, task)
    return spec
