"""flotilla's configuration files: defaults per provider and named pools, in layers.

Two YAML files, as SkyPilot layers ``~/.sky/config.yaml`` and a project's ``.sky.yaml``,
and Skyward ``~/.skyward/defaults.toml`` and ``skyward.toml``:

1. the user's, ``$FLOTILLA_HOME/config.yaml`` (``~/.flotilla/config.yaml``);
2. the project's, ``.flotilla.yaml`` in the current folder, over it;
3. (the command line only) a task file's ``config:`` over both, and the flags over all.

Mappings merge key by key (a later layer's value replaces an earlier one's; lists are
replaced, not joined). The keys::

    aws:                      # a provider kind (local, ssh, slurm, aws, k8s or kubernetes,
      region: eu-west-1       #   vast or vastai, container): its settings' defaults, each
      ttl: 1200               #   key a field of the provider's settings class
    pools:
      train:                  # Compute(name="train"): Skyward's named pool
        provider: aws         # a kind; its defaults above, then `settings:` over them
        settings: {instance_type: g5.xlarge}
        nodes: 4              # or [min, max]
        accelerator: A10G:1
        image: {pip: [torch]} # Image's fields
        vcpus: 4              # memory_gb, ttl, allocation, max_hourly_cost: Compute's

A provider's keys are its settings fields (``_providers.options``): there is no per-key code
here. A secret field (an API key) is refused: keep it in the provider's credential file or
environment. Every refusal is a ConfigurationError naming the file, the line, the key and
what is allowed, raised before anything is provisioned.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .._errors import ConfigurationError
from .._system.private import flotilla_home
from .options import options, secrets

PROJECT_FILE = ".flotilla.yaml"
"""The project's configuration file, looked for in the current folder."""

KINDS: Mapping[str, tuple[str, str, str, str]] = {
    "local": ("settings", "LocalSettings", "local", "Local"),
    "ssh": ("settings", "SSHSettings", "ssh", "SSH"),
    "slurm": ("slurm.settings", "SlurmSettings", "slurm", "Slurm"),
    "aws": ("aws.settings", "AWSSettings", "aws", "AWS"),
    "k8s": ("k8s.settings", "KubernetesSettings", "k8s", "Kubernetes"),
    "vast": ("vast.settings", "VastSettings", "vast", "VastAI"),
    "runpod": ("runpod.settings", "RunPodSettings", "runpod", "RunPod"),
    "lambda": ("lambda_cloud.settings", "LambdaSettings", "lambda_cloud", "LambdaCloud"),
    "gcp": ("gcp.settings", "GCPSettings", "gcp", "GCP"),
    "verda": ("verda.settings", "VerdaSettings", "verda", "Verda"),
    "container": ("container.settings", "ContainerSettings", "container", "Container"),
}
"""Provider kind -> (settings module, settings class, provider module, provider class),
modules relative to ``flotilla._providers``: the kinds a configuration file configures
(the command line's ``--provider`` names; a test checks they are the same)."""

ALIASES: Mapping[str, str] = {
    "kubernetes": "k8s",
    "vastai": "vast",
    "lambda_cloud": "lambda",
    "lambdacloud": "lambda",
    "datacrunch": "verda",
}
"""SkyPilot's and Skyward's names of a kind."""

POOL_FIELDS: Mapping[str, str] = {
    "provider": "a provider kind",
    "settings": "a mapping of the provider's settings",
    "nodes": "a whole number >= 1, or [min, max]",
    "accelerator": "an accelerator, e.g. A100:8",
    "image": "a mapping of Image fields (python, pip, apt, env, ...)",
    "vcpus": "a number > 0",
    "memory_gb": "a number > 0",
    "ttl": "seconds, a number >= 0",
    "allocation": "spot, on-demand or spot-if-available",
    "max_hourly_cost": "a number > 0 (USD per hour for the pool)",
}
"""The keys of a named pool: ``Compute``'s arguments of the same names, and what each
takes (``Compute`` checks the values when it is made)."""


GROUP = "flotilla.providers"
"""The entry-point group through which other packages register providers."""


@functools.cache
def entry_points() -> dict[str, Any]:
    """Name -> entry point of every provider other packages register (looked up only when
    a name flotilla does not know is met)."""
    from importlib.metadata import entry_points as found

    return {ep.name: ep for ep in found(group=GROUP)}


def settings_class(kind: str) -> type[Any]:
    """The settings dataclass of a provider kind (its light module only)."""
    module, name, _, _ = KINDS[ALIASES.get(kind, kind)]
    return getattr(importlib.import_module(f"flotilla._providers.{module}"), name)  # type: ignore[no-any-return]


def provider_class(kind: str) -> type[Any]:
    """The provider class of a kind (imports the provider)."""
    _, _, module, name = KINDS[ALIASES.get(kind, kind)]
    return getattr(importlib.import_module(f"flotilla._providers.{module}"), name)  # type: ignore[no-any-return]


def user_file() -> Path:
    """The user's configuration file: ``$FLOTILLA_HOME/config.yaml``."""
    return flotilla_home() / "config.yaml"


def project_file(folder: str | os.PathLike[str] | None = None) -> Path:
    """The project's configuration file in ``folder`` (default: the current one)."""
    return Path(folder or os.getcwd()) / PROJECT_FILE


@dataclass(frozen=True)
class Pool:
    """A named pool of a configuration (``pools: {NAME: ...}``), checked.

    Attributes:
        name: its name.
        provider: its provider kind (canonical: ``k8s``, ``vast``).
        settings: the provider's settings: the kind's defaults with the pool's over them.
        arguments: ``Compute``'s other arguments it gives (``nodes``, ``image``...).
        where: ``file:line`` of its definition.
    """

    name: str
    provider: str
    settings: Mapping[str, Any]
    arguments: Mapping[str, Any]
    where: str

    def make_provider(self) -> Any:
        """The pool's provider, made of its settings."""
        cls = provider_class(self.provider)
        try:
            return cls.from_settings(settings_class(self.provider)(**self.settings))
        except ConfigurationError as e:
            raise ConfigurationError(f"{self.where}: pools.{self.name}: {e}") from None

    def image(self) -> Any:
        """The pool's ``image`` as an :class:`~flotilla.Image` (None: it gives none)."""
        if "image" not in self.arguments:
            return None
        return _image(self.arguments["image"], f"{self.where}: pools.{self.name}.image")


@dataclass(frozen=True)
class Config:
    """The merged configuration of every layer.

    Attributes:
        providers: kind -> its settings' defaults (canonical kinds).
        pools: name -> its :class:`Pool`.
        files: the files read, lowest layer first (those that exist).
        origin: ``kind.field`` / ``pools.NAME`` -> ``file:line`` of the layer that set it.
    """

    providers: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    pools: Mapping[str, Pool] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    origin: Mapping[str, str] = field(default_factory=dict)

    def defaults(self, kind: str) -> dict[str, Any]:
        """A provider kind's settings defaults (empty when none are configured)."""
        return dict(self.providers.get(ALIASES.get(kind, kind), {}))

    def pool(self, name: str) -> Pool:
        """The pool named ``name``; a ConfigurationError naming the ones there are."""
        if name not in self.pools:
            where = " or ".join(self.files) if self.files else _looked()
            there = ", ".join(sorted(self.pools)) or "none"
            raise ConfigurationError(
                f"no pool named {name!r} in {where} (pools there: {there}); define it under "
                f"`pools: {{{name}: {{provider: KIND, ...}}}}`"
            )
        return self.pools[name]


def _looked() -> str:
    return f"{user_file()} nor {project_file()} (neither exists)"


def load(folder: str | os.PathLike[str] | None = None) -> Config:
    """The configuration of the user's file and the project's (in ``folder``, default the
    current one), checked; files that do not exist are skipped."""
    layers = [read(path) for path in (user_file(), project_file(folder)) if path.is_file()]
    return merge(layers)


@dataclass(frozen=True)
class Layer:
    """One file's checked content (see :func:`read`)."""

    path: str
    data: Mapping[str, Any]
    lines: Mapping[str, int]


def read(path: str | os.PathLike[str]) -> Layer:
    """One configuration file, checked (every key, every provider setting's type)."""
    import yaml

    from .yamlsafe import MAX_BYTES, YamlRefused, compose

    where = os.fspath(path)
    try:
        with open(where, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ConfigurationError(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        root = compose(data)
    except YamlRefused as e:
        raise ConfigurationError(f"{where}:{e.line}: {e.message}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else 0
        raise ConfigurationError(f"{where}:{line}: invalid YAML: {e.problem or e}") from None
    except yaml.YAMLError as e:
        raise ConfigurationError(f"{where}: invalid YAML: {e}") from None
    reader = _Reader(where)
    if root is not None and not isinstance(root, yaml.MappingNode):
        raise ConfigurationError(f"{where}: must be a mapping (key: value lines)")
    value = {} if root is None else reader.mapping(root, "")
    checked = check(value, where, reader.lines)
    return Layer(where, checked, reader.lines)


class _Reader:
    """Plain values of a composed YAML tree, with each key's line (``a.b.c`` -> line)."""

    def __init__(self, path: str) -> None:
        import yaml

        self.yaml = yaml
        self.path = path
        self.lines: dict[str, int] = {}
        self.constructor = yaml.SafeLoader("")

    def mapping(self, node: Any, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = self.constructor.construct_object(key_node, deep=True)
            full = f"{name}.{key}" if name else str(key)
            line = int(key_node.start_mark.line) + 1
            if key in out:
                raise ConfigurationError(f"{self.path}:{line}: {full}: given twice")
            self.lines[full] = line
            if isinstance(value_node, self.yaml.MappingNode):
                out[key] = self.mapping(value_node, full)
            else:
                out[key] = self.constructor.construct_object(value_node, deep=True)
        return out


def check(data: Mapping[str, Any], path: str, lines: Mapping[str, int]) -> dict[str, Any]:
    """A file's ``data`` checked: kinds' sections (aliases made canonical, lists as
    tuples) and pools; a ConfigurationError names the file, line, key and what is
    allowed."""

    def at(key: str) -> str:
        line = lines.get(key, 0)
        return f"{path}:{line}: {key}" if line else f"{path}: {key}"

    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "pools":
            out["pools"] = {
                name: _check_pool(name, pool, at)
                for name, pool in _section(value, "pools", at).items()
            }
            continue
        kind = ALIASES.get(key, key)
        if kind not in KINDS:
            allowed = ", ".join([*KINDS, *ALIASES, "pools"])
            raise ConfigurationError(f"{at(key)}: unknown key (allowed: {allowed})")
        if kind in out:
            raise ConfigurationError(f"{at(key)}: the {kind} provider is configured twice")
        out[kind] = check_settings(kind, _section(value, key, at), key, at)
    return out


def _section(value: Any, key: str, at: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{at(key)}: must be a mapping (key: value lines), got {kind_of(value)}"
        )
    return dict(value)


def check_settings(kind: str, values: Mapping[str, Any], prefix: str, at: Any) -> dict[str, Any]:
    """A provider's settings from a file: every key a field of its settings class, not a
    secret, of the field's type (lists as tuples); then the values the settings class
    itself checks, when no required field is missing."""
    cls = settings_class(kind)
    known = {o.name: o for o in options(cls, kind)}
    hidden = secrets(cls)
    out: dict[str, Any] = {}
    for name, value in values.items():
        key = f"{prefix}.{name}"
        if name in hidden:
            raise ConfigurationError(
                f"{at(key)}: a secret, never kept in a configuration file: give it through "
                "the provider's credential file or environment"
            )
        option = known.get(name)
        if option is None:
            usable = ", ".join(n for n in known if n not in hidden)
            raise ConfigurationError(
                f"{at(key)}: the {kind} provider has no such setting (it has: {usable})"
            )
        if option.choices and value not in option.choices:
            raise ConfigurationError(
                f"{at(key)}: {value!r} is not allowed (allowed: {', '.join(option.choices)})"
            )
        if not _fits(option.type, value):
            raise ConfigurationError(
                f"{at(key)}: must be {_describe(option.type)}, got {kind_of(value)}"
            )
        out[name] = _tuples(value)
    try:
        cls(**out)
    except ConfigurationError as e:  # (a TypeError too: first)
        named = [n for n in out if f"{n}=" in str(e)]
        raise ConfigurationError(
            f"{at(f'{prefix}.{named[0]}' if named else prefix)}: {e}"
        ) from None
    except TypeError:
        pass  # a required field (SSH's hosts) is given where the pool is made
    return out


def _check_pool(name: str, pool: Any, at: Any) -> dict[str, Any]:
    key = f"pools.{name}"
    values = _section(pool, key, at)
    for field_name in values:
        if field_name not in POOL_FIELDS:
            allowed = ", ".join(POOL_FIELDS)
            raise ConfigurationError(
                f"{at(f'{key}.{field_name}')}: unknown key (allowed: {allowed})"
            )
    kind = values.get("provider")
    if kind is None:
        raise ConfigurationError(f"{at(key)}: a pool needs `provider:` (one of {', '.join(KINDS)})")
    if ALIASES.get(kind, kind) not in KINDS:
        raise ConfigurationError(
            f"{at(f'{key}.provider')}: unknown provider {kind!r} (allowed: "
            f"{', '.join([*KINDS, *ALIASES])})"
        )
    values["provider"] = ALIASES.get(kind, kind)
    if "settings" in values:
        section = _section(values["settings"], f"{key}.settings", at)
        values["settings"] = check_settings(values["provider"], section, f"{key}.settings", at)
    if "image" in values:
        _image(_section(values["image"], f"{key}.image", at), at(f"{key}.image"))
    for number in ("vcpus", "memory_gb", "max_hourly_cost", "ttl"):
        value = values.get(number)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ConfigurationError(
                f"{at(f'{key}.{number}')}: must be {POOL_FIELDS[number]}, got {kind_of(value)}"
            )
    nodes = values.get("nodes")
    if nodes is not None and not _nodes_ok(nodes):
        raise ConfigurationError(
            f"{at(f'{key}.nodes')}: must be {POOL_FIELDS['nodes']}, got {kind_of(nodes)}"
        )
    for text in ("accelerator", "allocation"):
        value = values.get(text)
        if value is not None and not isinstance(value, str):
            raise ConfigurationError(
                f"{at(f'{key}.{text}')}: must be {POOL_FIELDS[text]}, got {kind_of(value)}"
            )
    return values


def _nodes_ok(nodes: Any) -> bool:
    def whole(n: Any) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 1

    if isinstance(nodes, list):
        return len(nodes) == 2 and all(whole(n) for n in nodes) and nodes[0] <= nodes[1]
    return whole(nodes)


def _image(values: Mapping[str, Any], where: str) -> Any:
    from .._image import Image

    known = [f.name for f in fields(Image) if f.name != "metrics"]
    for name in values:
        if name not in known:
            raise ConfigurationError(
                f"{where}.{name}: Image has no such field (it has: {', '.join(known)})"
            )
    try:
        return Image(**{k: _tuples(v) for k, v in values.items()})
    except (ConfigurationError, TypeError, ValueError) as e:
        raise ConfigurationError(f"{where}: {e}") from None


def merge(layers: Sequence[Layer]) -> Config:
    """The layers merged, later ones over earlier ones, key by key."""
    providers: dict[str, dict[str, Any]] = {}
    raw_pools: dict[str, dict[str, Any]] = {}
    origin: dict[str, str] = {}
    for layer in layers:

        def where(key: str, layer: Layer = layer) -> str:
            line = layer.lines.get(key, 0)
            return f"{layer.path}:{line}" if line else layer.path

        for kind, values in layer.data.items():
            if kind == "pools":
                for name, pool in values.items():
                    merged = raw_pools.setdefault(name, {})
                    settings = {**merged.get("settings", {}), **pool.get("settings", {})}
                    merged.update(pool)
                    merged["settings"] = settings
                    origin[f"pools.{name}"] = where(f"pools.{name}")
                    for key in pool:
                        origin[f"pools.{name}.{key}"] = where(f"pools.{name}.{key}")
                    for key in pool.get("settings", {}):
                        full = f"pools.{name}.settings.{key}"
                        origin[full] = where(full)
                continue
            providers.setdefault(kind, {}).update(values)
            for key in values:
                origin[f"{kind}.{key}"] = where(_original(layer, kind, key))
    pools = {
        name: Pool(
            name=name,
            provider=raw["provider"],
            settings={**providers.get(raw["provider"], {}), **raw.get("settings", {})},
            arguments={k: v for k, v in raw.items() if k not in ("provider", "settings")},
            where=origin[f"pools.{name}"],
        )
        for name, raw in raw_pools.items()
    }
    return Config(providers, pools, tuple(layer.path for layer in layers), origin)


def _original(layer: Layer, kind: str, key: str) -> str:
    """The key as the file spelled it (``kubernetes.context`` for ``k8s.context``)."""
    for name in (kind, *(a for a, k in ALIASES.items() if k == kind)):
        if f"{name}.{key}" in layer.lines:
            return f"{name}.{key}"
    return f"{kind}.{key}"


# -- values against a settings field's type ----------------------------------------------------
def _arms(hint: Any) -> list[Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return list(typing.get_args(hint))
    return [hint]


def _fits(hint: Any, value: Any) -> bool:
    """Whether a YAML value can be a field of type ``hint`` (a path may be a string, a
    tuple a list; anything else unknown is left to the settings class)."""
    for arm in _arms(hint):
        origin = typing.get_origin(arm) or arm
        args = typing.get_args(arm)
        if arm is type(None):
            ok = value is None
        elif arm is bool:
            ok = isinstance(value, bool)
        elif arm is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif arm is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif arm is str or origin is os.PathLike:
            ok = isinstance(value, str)
        elif origin is typing.Literal:
            ok = value in args
        elif isinstance(origin, type) and issubclass(origin, Mapping):
            ok = isinstance(value, Mapping) and (
                len(args) != 2 or all(_fits(args[1], v) for v in value.values())
            )
        elif isinstance(origin, type) and issubclass(origin, Sequence):
            item = args[0] if args else Any
            ok = isinstance(value, list) and all(_fits(item, v) for v in value)
        elif dataclasses.is_dataclass(arm):
            ok = False  # an object (SSHHost): a file gives its text form
        else:
            ok = True  # Any: the settings class checks it
        if ok:
            return True
    return False


def _describe(hint: Any) -> str:
    words = []
    for arm in _arms(hint):
        origin = typing.get_origin(arm) or arm
        args = typing.get_args(arm)
        if arm is type(None):
            words.append("null")
        elif arm is bool:
            words.append("true or false")
        elif arm is int:
            words.append("a whole number")
        elif arm is float:
            words.append("a number")
        elif arm is str or origin is os.PathLike:
            words.append("a string")
        elif origin is typing.Literal:
            words.append("one of " + ", ".join(map(repr, args)))
        elif isinstance(origin, type) and issubclass(origin, Mapping):
            words.append("a mapping")
        elif isinstance(origin, type) and issubclass(origin, Sequence):
            item = _describe(args[0]) if args else "values"
            words.append(f"a list of ({item})")
    return " or ".join(dict.fromkeys(words)) or "a value"


def kind_of(value: object) -> str:
    """What a configuration value is, for messages: ``a string ('x')``, ``a list``..."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return type(value).__name__


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def shown(config: Config) -> dict[str, Any]:
    """The merged configuration as plain data (``flotilla config show``)."""
    out: dict[str, Any] = {k: dict(v) for k, v in config.providers.items()}
    if config.pools:
        out["pools"] = {
            name: {"provider": p.provider, **dict(p.arguments), "settings": dict(p.settings)}
            for name, p in config.pools.items()
        }
    return {k: _plain(v) for k, v in out.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    return value
