"""The command line's backends (provider kinds), and the only place that lists them.

A backend is one module in this folder that defines:

- a :class:`~.base.ProviderSpec` subclass: a frozen dataclass with ``kind = "NAME"`` (a
  ClassVar: ``--provider NAME`` and ``"kind"`` in the state file) and one documented field
  per provider option (the state file keeps them; ``__post_init__`` checks them);
- a :class:`~.base.Backend` subclass over that spec, whose typed members are
  ``spec_type``, ``summary`` (``--help`` text), ``flags`` (:class:`~.base.Flag` s added to
  ``flotilla launch``), ``shares_filesystem``, ``honours`` and ``hint_reason`` (which task
  ``resources`` it acts on), ``spec_from_args(args)`` (flags -> spec),
  ``check_resources(task, spec, nodes)`` and ``check_nodes(spec, nodes)`` (task-file checks),
  ``make_provider(spec, nodes_dir)`` (spec -> a ``flotilla`` provider, imported there),
  ``on_up``/``on_down`` (hooks when the cluster is up / taken down) and
  ``shell(paths, spec, nodes, node, command)`` (``flotilla ssh``);
- ``BACKEND``: its one instance.

Adding a provider kind (SLURM, AWS...) is adding such a module and its ``BACKEND`` to
:data:`BACKENDS` below; nothing else in the command line names provider kinds.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ..._errors import ConfigurationError
from . import local, ssh
from .base import Backend, ProviderSpec

BACKENDS: tuple[Backend[Any], ...] = (local.BACKEND, ssh.BACKEND)
"""Every backend, the default (used when the command line names none) first."""

DEFAULT = BACKENDS[0]


def kinds() -> list[str]:
    """The names of every backend, as ``--provider`` takes them."""
    return [b.kind for b in BACKENDS]


def backend(kind: str) -> Backend[Any]:
    """The backend named ``kind``; a ConfigurationError listing the known ones otherwise."""
    for b in BACKENDS:
        if b.kind == kind:
            return b
    raise ConfigurationError(f"unknown provider {kind!r}: flotilla has {', '.join(kinds())}")


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
        choices=kinds(),
        help="where nodes run: "
        + "; ".join(f"{b.kind}: {b.summary}" for b in BACKENDS)
        + f" (default: {DEFAULT.kind})",
    )
    for b in BACKENDS:
        b.add_flags(parser)


def spec_from_args(args: argparse.Namespace) -> ProviderSpec | None:
    """The provider the command line asks for: ``--provider``, else the backend whose flags
    were given; None when it asks for nothing in particular. A backend's flag given with
    another backend is a ConfigurationError."""
    given = {b.kind: b.given_flags(args) for b in BACKENDS}
    chosen: str | None = args.provider
    if chosen is None:
        implied = [kind for kind, flags in given.items() if flags]
        if not implied:
            return None
        chosen = implied[0]
    for kind, flags in given.items():
        if kind != chosen and flags:
            raise ConfigurationError(
                f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} for --provider {kind}"
                + (f", not {chosen}" if args.provider else "")
            )
    spec: ProviderSpec = backend(chosen).spec_from_args(args)
    return spec
