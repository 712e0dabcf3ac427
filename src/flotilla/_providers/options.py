"""A provider's options have one source: its frozen settings dataclass.

A field of the settings class is one option: its name is the provider's keyword
(``AWS(region=...)``) and the task file's ``config:`` key (``config: {aws: {region: ...}}``),
its type and default are the option's, its documentation is its ``Attributes:`` entry in the
class docstring. What the command line and SkyPilot task files need beyond that is the
field's metadata, given with :func:`option`:

- ``flag``: the ``flotilla launch`` flag, when it is not ``--KIND-FIELD`` (``--region``);
- ``task``: where a task file's ``resources`` give it (:class:`From`), e.g. ``image_id``;
- ``secret``: never a flag, a task-file value or shown in clear (an API key);
- ``choices`` / ``parse``: the values a flag takes / how a flag's text becomes the value.

Everything else is derived here: the provider's constructor (:func:`provider_init`,
:func:`make_settings`), and, for the command line, :func:`options` (name, type, default,
doc, flag) and :func:`task_values` (the ``resources`` mapping). Light to import: every
command of the command line reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import shlex
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Concatenate, ParamSpec, TypeVar

from .._errors import ConfigurationError, check_number

META = "flotilla"
"""The key of a settings field's metadata that :func:`option` fills."""

P = ParamSpec("P")
S = TypeVar("S")


@dataclass(frozen=True)
class From:
    """Where a SkyPilot task file's ``resources`` give a settings field.

    Attributes:
        sources: ``resources`` fields, the first one set wins; ``"infra"`` is the part
            after ``NAME/`` of an ``infra`` that names this provider (``us-east-1`` of
            ``aws/us-east-1``).
        convert: turns the ``resources`` value into the field's (default: as it is).
        always: SkyPilot's meaning differs from the field's default: ``convert`` is
            applied to None too when the task sets none of the sources (``use_spot``
            unset means on-demand in a task file). The one place where a task file's
            default is not the settings field's; say so in the field's doc.
    """

    sources: tuple[str, ...]
    convert: Callable[[Any], Any] | None = None
    always: bool = False


@dataclass(frozen=True)
class _Meta:
    flag: str | None = None
    task: From | None = None
    secret: bool = False
    choices: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None


MARKETS = ("on-demand", "spot", "spot-if-available")
"""The markets a cloud's ``allocation`` setting takes (AWS, RunPod, GCP): on-demand, spot,
or spot falling back to on-demand."""

MARKET_OF_TASK = From(("use_spot",), lambda spot: "spot" if spot else "on-demand", always=True)
"""A task file's ``allocation``, as SkyPilot reads ``use_spot``: no ``use_spot`` is on-demand
(a provider's own default, e.g. AWS's ``spot-if-available``, is not SkyPilot's)."""


def option(
    default: Any = MISSING,
    *,
    default_factory: Callable[[], Any] | Any = MISSING,
    flag: str | None = None,
    task: From | str | None = None,
    secret: bool = False,
    choices: Sequence[str] = (),
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A settings field with the command line's and task files' metadata (see the module's
    docstring). ``task`` may be a ``resources`` field's name for ``From((name,))``."""
    source = From((task,)) if isinstance(task, str) else task
    meta = {META: _Meta(flag, source, secret, tuple(choices), parse)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta, repr=not secret)
    return field(default=default, metadata=meta, repr=not secret)


@dataclass(frozen=True)
class Option:
    """One option of a provider, as the command line shows and parses it.

    Attributes:
        name: the settings field (the provider's keyword, the ``config:`` key).
        type: the field's type.
        default: its default (``MISSING``: required).
        doc: its documentation, on one line.
        flag: its ``flotilla launch`` flag (None: a secret, which has none).
        task: where a task file's ``resources`` give it (None: only ``config:``).
        secret: never a flag nor shown in clear.
        choices: the values allowed ('': any).
        parse: a flag's text -> the value.
    """

    name: str
    type: Any
    default: Any
    doc: str
    flag: str | None
    task: From | None
    secret: bool
    choices: tuple[str, ...]
    parse: Callable[[str], Any]

    @property
    def mapping(self) -> bool:
        """A mapping (kept as (key, value) pairs in a cluster's state, see the command
        line's ``ProviderSpec``)."""
        return self.parse is _pairs

    @property
    def switch(self) -> bool:
        """A bool: its flag takes no value and sets the value its default is not."""
        return self.type is bool

    @property
    def help(self) -> str:
        doc = self.doc.replace("``", "")
        if self.switch:
            return f"turns off: {doc}" if self.default else doc
        if self.default in (MISSING, None, (), {}) or "default" in doc:
            return doc
        value = self.default
        words = " ".join(map(str, value)) if isinstance(value, tuple | list) else value
        return f"{doc} (default: {words})"


_READ: dict[tuple[type[Any], str], tuple[Option, ...]] = {}


def options(settings_type: type[Any], kind: str) -> tuple[Option, ...]:
    """Every option of a settings class; a flag is ``--KIND-FIELD`` unless the field's
    metadata names another. Read once per class."""
    key = (settings_type, kind)
    if key not in _READ:
        _READ[key] = _options(settings_type, kind)
    return _READ[key]


def _options(settings_type: type[Any], kind: str) -> tuple[Option, ...]:
    docs = field_docs(settings_type)
    hints = typing.get_type_hints(settings_type)
    out = []
    for f in fields(settings_type):
        meta = f.metadata.get(META) or _Meta()
        kind_of = hints[f.name]
        default: Any = f.default
        if f.default_factory is not MISSING:
            default = f.default_factory()
        secret = f.name in secrets(settings_type)  # never on a command line (ps shows it)
        flag = None if secret else meta.flag or f"--{kind}-{f.name.replace('_', '-')}"
        out.append(
            Option(
                name=f.name,
                type=kind_of,
                default=default,
                doc=docs.get(f.name, f.name.replace("_", " ")),
                flag=flag,
                task=meta.task,
                secret=secret,
                choices=meta.choices,
                parse=meta.parse or _parser(kind_of),
            )
        )
    return tuple(out)


def _parser(kind: Any) -> Callable[[str], Any]:
    """How a flag's text becomes a value of type ``kind``: numbers as numbers, a sequence
    as words (as a shell splits them), a mapping as ``KEY=VALUE,...``, else the text."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        kind = args[0]  # X | None
    origin = typing.get_origin(kind) or kind
    if kind is int:
        return int
    if kind is float:
        return float
    if isinstance(origin, type) and issubclass(origin, Mapping):
        return _pairs
    if isinstance(origin, type) and issubclass(origin, Sequence) and origin is not str:
        return shlex.split
    return str


def _pairs(text: str) -> dict[str, str]:
    out = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
        out[key.strip()] = value.strip()
    return out


def field_docs(cls: type[Any]) -> dict[str, str]:
    """Field -> its documentation, from the ``Attributes:`` section of ``cls``'s docstring
    (on one line)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    _, _, section = doc.partition("Attributes:\n")
    docs: dict[str, str] = {}
    name = ""
    for line in section.splitlines():
        entry = re.match(r"    (\w+): (.*)", line)
        if entry:
            name = entry[1]
            docs[name] = entry[2].strip()
        elif name and line.startswith("        "):
            docs[name] += " " + line.strip()
        else:
            break
    return docs


def task_values(
    settings_type: type[Any], infra: str | None, resources: Mapping[str, Any]
) -> dict[str, Any]:
    """The settings a task file's ``resources`` give (see :class:`From`): ``infra`` is the
    part after the provider's name in ``resources.infra`` (None: it names another, or
    none)."""
    out: dict[str, Any] = {}
    for f in fields(settings_type):
        meta = f.metadata.get(META)
        source = meta.task if meta is not None else None
        if source is None:
            continue
        value = None
        for name in source.sources:
            given = infra if name == "infra" else resources.get(name)
            if given not in (None, (), {}, ""):
                value = given
                break
        if value is None and not source.always:
            continue
        out[f.name] = source.convert(value) if source.convert else value
    return out


def docker_image(image_id: str) -> str:
    """A task file's ``image_id`` as a container image (SkyPilot writes ``docker:IMAGE``)."""
    return image_id.removeprefix("docker:")


def secrets(settings_type: type[Any]) -> frozenset[str]:
    """The fields never shown in clear: marked ``secret``, or named like a secret
    (``api_key``, ``token``: a provider from another package that marked nothing)."""
    from .._redaction import looks_secret

    return frozenset(
        f.name
        for f in fields(settings_type)
        if getattr(f.metadata.get(META), "secret", False) or looks_secret(f.name)
    )


def shown(settings: Any) -> dict[str, Any]:
    """Every field of a settings object, JSON-ready, secrets as ``***`` when set."""
    hidden = secrets(type(settings))
    out: dict[str, Any] = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        if f.name in hidden:
            value = None if value is None else "***"
        out[f.name] = _plain(value)
    return out


def changed(settings: Any) -> dict[str, Any]:
    """The fields of a settings object that differ from their defaults (a provider's
    ``repr``), never a secret one."""
    hidden = secrets(type(settings))
    out: dict[str, Any] = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if f.name not in hidden and value != default:
            out[f.name] = value
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# -- the provider's constructor ----------------------------------------------------------------
def check_rented(settings: Any, provider: str, image: str) -> None:
    """The checks the settings of the providers of rented containers (Vast, RunPod) share,
    in a ``__post_init__``: ``api_key`` None or a non-empty string, ``image`` a name
    (``image`` says of what), ``ttl`` positive seconds, ``workdir`` absolute or under ``~``;
    ``ttl`` and ``connect_timeout`` are made floats. ``provider`` is named in the errors."""
    key = settings.api_key
    if key is not None and (not isinstance(key, str) or not key):
        raise ConfigurationError(f"{provider}(api_key=...): a non-empty string")
    if not isinstance(settings.image, str) or not settings.image.strip():
        raise ConfigurationError(f"{provider}(image={settings.image!r}): {image}")
    ttl = settings.ttl
    check_number(ttl, f"{provider}(ttl={ttl!r}): a positive number of seconds", above=0)
    if not isinstance(settings.workdir, str) or not settings.workdir.startswith(("/", "~")):
        raise ConfigurationError(
            f"{provider}(workdir={settings.workdir!r}): an absolute folder, or one under ~"
        )
    object.__setattr__(settings, "ttl", float(ttl))
    object.__setattr__(settings, "connect_timeout", float(settings.connect_timeout))


def make_settings(
    settings_type: type[S],
    owner: str,
    settings: S | None,
    args: tuple[Any, ...],
    kw: dict[str, Any],
) -> S:
    """The settings of ``owner(*args, settings=settings, **kw)``: ``settings`` as it is (the
    keywords replacing its fields), else the settings class made of ``args`` and ``kw``.
    A keyword that is no field is a ConfigurationError naming the ones there are."""
    known = [f.name for f in fields(settings_type)]  # type: ignore[arg-type]
    unknown = sorted(set(kw) - set(known))
    if unknown:
        raise ConfigurationError(
            f"{owner}() got an unexpected keyword argument {unknown[0]!r} (its settings: "
            f"{', '.join(known)})"
        )
    if settings is None:
        return settings_type(*args, **kw)
    if not isinstance(settings, settings_type):
        raise ConfigurationError(
            f"{owner}(settings=...) must be a {settings_type.__name__}, got "
            f"{type(settings).__name__}"
        )
    if args:
        raise ConfigurationError(f"{owner}(): give settings= or the settings' fields, not both")
    return replace(settings, **kw) if kw else settings  # type: ignore[type-var]


def provider_init(
    settings_type: Callable[P, Any],
) -> Callable[[Callable[[Any], None]], Callable[Concatenate[Any, P], None]]:
    """A provider's constructor derived from its settings class: the decorated
    ``__init__(self)`` holds only what the provider sets beyond its settings, and becomes
    ``__init__(self, *args, settings=None, **options)``, which first sets ``settings``
    (``Provider.make_settings``: ``settings=``, its fields replaced by ``options``, else the
    settings class made of ``args`` and ``options``; a keyword that is no field is a
    ConfigurationError naming the fields) and ``home`` (the settings' ``workdir`` where
    they have one), then runs it. The provider's ``settings_type`` is ``settings_type``.

    Type checkers and ``help()`` see the settings class's fields as the constructor's
    keywords (``help()`` also shows ``settings=``; a type checker cannot be told of it:
    ``Provider.from_settings`` is the typed spelling)."""

    def typed(setup: Callable[[Any], None]) -> Callable[Concatenate[Any, P], None]:
        def init(self: Any, *args: Any, settings: Any = None, **options: Any) -> None:
            self.settings = self.make_settings(settings, args, options)
            self.home = getattr(self.settings, "workdir", None) or self.home
            setup(self)

        functools.update_wrapper(init, setup)
        name = getattr(settings_type, "__name__", "the settings")
        init.__doc__ = (
            f"Args: the fields of :class:`{name}` (checked when the provider is made), or "
            f"``settings=`` a {name} (the keywords given replace its fields)."
        )
        init.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [
                inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
                *inspect.signature(settings_type).parameters.values(),
                inspect.Parameter(
                    "settings",
                    inspect.Parameter.KEYWORD_ONLY,
                    default=None,
                    annotation=settings_type,
                ),
            ]
        )
        init.settings_type = settings_type  # type: ignore[attr-defined]
        return init  # type: ignore[return-value]

    return typed
