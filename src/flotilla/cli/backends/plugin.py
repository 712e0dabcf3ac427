"""Providers from other packages on the command line: ``flotilla launch --provider NAME``.

A package makes its provider known through the entry-point group ``flotilla.providers``
(``NAME = "package.module:ProviderClass"``, see ``docs/providers.md``). Its options are its
settings dataclass's fields (:attr:`flotilla.providers.Provider.settings_type`), given as
``--provider-option FIELD=VALUE`` (repeated) and converted to the field's type as the
built-in providers' flags are. Entry points are looked up only when ``--provider`` names a
kind flotilla does not have, so that other commands start as fast as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..._errors import ConfigurationError
from ..._providers.config_files import GROUP as GROUP
from ..._providers.config_files import entry_points as entry_points
from .base import Backend, Flag, ProviderSpec, ShellCommand

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths

OPTION = Flag(
    "--provider-option",
    "FIELD=VALUE: a setting of a provider from another package (repeat for more)",
    metavar="FIELD=VALUE",
)


@functools.cache
def plugin_backend(kind: str) -> PluginBackend | None:
    """The backend of the provider registered as ``kind``, or None."""
    point = entry_points().get(kind)
    if point is None:
        return None
    provider = point.load()
    settings = getattr(provider, "settings_type", None)
    if settings is None or not dataclasses.is_dataclass(settings):
        raise ConfigurationError(
            f"provider {kind!r} ({point.value}) has no settings_type: a provider for the "
            "command line needs a settings dataclass (see docs/providers.md)"
        )
    spec_type: type[PluginSpec] = dataclass(frozen=True)(
        type(f"{kind}Spec", (PluginSpec,), {"kind": kind})
    )
    summary = (provider.__doc__ or "a provider from another package").strip().splitlines()[0]
    members = {
        "spec_type": spec_type,
        "settings_type": settings,
        "summary": summary,
        "provider": provider,
    }
    backend: PluginBackend = type(f"{kind}Backend", (PluginBackend,), members)()
    return backend


@dataclass(frozen=True)
class PluginSpec(ProviderSpec):
    """A provider from another package: its settings are all in ``settings``."""


class PluginBackend(Backend[PluginSpec]):
    """The command line's side of a provider from another package."""

    provider: ClassVar[type[Provider]]

    def spec_from_args(self, args: argparse.Namespace) -> PluginSpec:
        return self.spec_type(settings=self.settings(getattr(args, OPTION.dest, None) or []))

    def settings(self, options: Sequence[str]) -> tuple[tuple[str, Any], ...]:
        """``FIELD=VALUE`` options as (field, value) of the provider's settings, each
        converted as a built-in provider's flag for that field would be."""
        known = {o.name: o for o in self.options() if o.flag is not None}
        out: list[tuple[str, Any]] = []
        for text in options:
            name, sep, value = text.partition("=")
            option = known.get(name.strip())
            if not sep or option is None:
                raise ConfigurationError(
                    f"--provider-option {text!r}: use FIELD=VALUE with FIELD one of "
                    f"{', '.join(known)}"
                )
            if option.switch:
                out.append((option.name, value.strip().lower() in ("1", "true", "yes")))
            else:
                out.append((option.name, option.parse(value)))
        return tuple(out)

    def make_provider(self, spec: PluginSpec, nodes_dir: Path) -> Provider:
        return self.provider.from_settings(self.settings_of(spec))

    def shell(
        self, paths: Paths, spec: PluginSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        raise ConfigurationError(
            f"`flotilla ssh` does not reach the nodes of a {self.kind} cluster (a provider "
            "from another package)"
        )
