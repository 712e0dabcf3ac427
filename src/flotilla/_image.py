"""``Image``: what every node's Python environment contains.

An Image is frozen and has a content hash. Each node builds it once per hash and
interpreter (under ``~/.flotilla/envs/<hash>-<interpreter key>`` or the provider's work
directory: the key covers the interpreter's path, version and platform and the packages it
already has, since the build installs only what is missing) and later pools reuse it, so a
second pool with the same Image and interpreter runs no installer at all. The node side is
``flotilla._node.build``; the includes archive comes from ``flotilla._archive``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._archive import Source, glob_excludes
from ._archive import build as build_archive
from ._errors import ConfigurationError
from ._redaction import Secret, shown_env
from .metrics import DEFAULT, resolve

DEFAULT_EXCLUDES = (
    ".git",
    "__pycache__",
    "*.pyc",
    ".venv",
    "venv",
    ".venv-*",
    "env",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "node_modules",
    ".tox",
)


def _tuple(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise ConfigurationError(f"Image.{name} must be a list of strings, got {value!r}") from None
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ConfigurationError(
                f"Image.{name} entries must be non-empty strings, got {item!r}"
            )
    return items


def check_env(env: Mapping[str, Any], where: str) -> None:
    """Raise ConfigurationError unless ``env`` is a mapping of variable names to strings
    (or ``Secret``) that a process environment can hold (no NUL byte)."""
    if not isinstance(env, Mapping):
        raise ConfigurationError(f"{where} must be a dict of name -> value, got {env!r}")
    for k, v in env.items():
        if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ConfigurationError(f"{where}: {k!r} is not a valid environment variable name")
        raw = v.value if isinstance(v, Secret) else v
        if not isinstance(raw, str):
            raise ConfigurationError(
                f"{where}[{k!r}] must be a string (or flotilla.Secret), got {type(raw).__name__}"
            )
        if "\0" in raw:  # the value itself is not shown: it may be a secret
            raise ConfigurationError(
                f"{where}[{k!r}] contains a NUL byte, which no process environment can hold"
            )


_PIP_URL = ("git+", "hg+", "svn+", "bzr+", "http://", "https://", "file:")
"""Requirements given as a URL (not a PEP 508 specifier): passed to the installer as is."""


def check_requirement(text: str) -> None:
    """Raise ConfigurationError unless ``text`` is one requirement: a PEP 508 specifier
    (``numpy``, ``torch>=2.3``, ``pkg @ https://...``) or a URL. Installer options
    (``--index-url``, ``-r file``) are refused: they would change how every requirement is
    installed (``Image.pip_indexes`` adds an index)."""
    from packaging.requirements import InvalidRequirement, Requirement

    if text.startswith("-"):
        raise ConfigurationError(
            f"Image.pip: {text!r} is an installer option, not a requirement; list requirements "
            "only (extra indexes go in Image.pip_indexes, a requirements file's lines in pip=)"
        )
    if any(c in text for c in "\0\n\r"):
        raise ConfigurationError(f"Image.pip: {text!r} must be one requirement on one line")
    if text.startswith(_PIP_URL):
        return
    try:
        Requirement(text)
    except InvalidRequirement as e:
        msg = f"Image.pip: {text!r} is not a requirement specifier: {e}"
        raise ConfigurationError(msg) from None


@dataclass(frozen=True)
class PipIndex:
    """A package index that serves only the named packages (Skyward's ``PipIndex``), in
    ``Image(pip_indexes=[...])`` beside plain URLs: ``PipIndex(url, packages=["torch"])``
    takes torch from ``url`` and everything else from the other indexes. Without
    ``packages``, a plain extra index.
    """

    url: str
    packages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.strip():
            raise ConfigurationError(f"PipIndex: {self.url!r} is not an index URL")
        object.__setattr__(self, "packages", _tuple(self.packages, "PipIndex.packages"))


@dataclass(frozen=True)
class Image:
    """A node environment.

    Attributes:
        python: required Python version on the nodes ("3.11"); None accepts the node's.
        pip: requirements ("numpy", "torch>=2.3"); those the node already satisfies are
            not installed again.
        pip_indexes: extra package index URLs, searched before PyPI; a :class:`PipIndex`
            with packages is scoped to them (moved to ``pip_index_packages``).
        apt: Debian packages, installed only when missing.
        env: environment variables for every task process; wrap secrets in ``Secret``.
        includes: local files, folders and packages shipped to every node and importable
            there (on ``sys.path``).
        excludes: glob patterns left out of ``includes`` (added to the defaults: .git,
            __pycache__, virtualenvs...).
        setup: shell commands run once per environment build, after the installs.
        pip_index_packages: index URL -> the packages (names) taken from that index, and
            only those: such an index is not searched for the image's other requirements
            (they are installed in a separate installer call). The torch plugin scopes
            PyTorch's wheel index to torch, torchvision and torchaudio so.
        metrics: Skyward's: the metrics every node samples (``flotilla.metrics``); not
            given: ``metrics.Default()`` (unless ``Compute(metrics=...)`` says); None:
            none.
    """

    python: str | None = None
    pip: tuple[str, ...] = ()
    pip_indexes: tuple[str | PipIndex, ...] = ()
    apt: tuple[str, ...] = ()
    env: Mapping[str, str | Secret] = field(default_factory=dict)
    includes: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    pip_index_packages: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    metrics: Any = field(default=DEFAULT, compare=False)

    def __post_init__(self) -> None:
        if self.metrics is not DEFAULT:
            object.__setattr__(self, "metrics", resolve(self.metrics))
        if not isinstance(self.pip_index_packages, Mapping):
            raise ConfigurationError(
                "Image.pip_index_packages must be a dict of index URL -> package names, "
                f"got {self.pip_index_packages!r}"
            )
        indexes: Any = self.pip_indexes
        if isinstance(indexes, str | PipIndex):
            indexes = (indexes,)
        try:
            indexes = tuple(indexes)
        except TypeError:
            raise ConfigurationError(
                f"Image.pip_indexes must be a list of URLs or PipIndex, got {indexes!r}"
            ) from None
        plain: list[Any] = []
        scoped_by_index: dict[str, tuple[str, ...]] = dict(self.pip_index_packages)
        for index in indexes:
            if isinstance(index, PipIndex) and index.packages:
                have = _tuple(scoped_by_index.get(index.url, ()), "pip_index_packages")
                scoped_by_index[index.url] = (*have, *index.packages)
            else:
                plain.append(index.url if isinstance(index, PipIndex) else index)
        object.__setattr__(self, "pip_indexes", plain)
        object.__setattr__(self, "pip_index_packages", scoped_by_index)
        for name in ("pip", "pip_indexes", "apt", "includes", "excludes", "setup"):
            object.__setattr__(self, name, _tuple(getattr(self, name), name))
        scoped = {}
        for url, names in self.pip_index_packages.items():
            if not isinstance(url, str) or not url.strip():
                raise ConfigurationError(f"Image.pip_index_packages: {url!r} is not an index URL")
            scoped[url] = _tuple(names, f"pip_index_packages[{url!r}]")
            for name in scoped[url]:
                if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", name):
                    raise ConfigurationError(
                        f"Image.pip_index_packages[{url!r}]: {name!r} is not a package name"
                    )
        object.__setattr__(self, "pip_index_packages", scoped)
        if self.python is not None and not re.fullmatch(r"3\.\d+(\.\d+)?", str(self.python)):
            raise ConfigurationError(f"Image.python must look like '3.11', got {self.python!r}")
        check_env(self.env, "Image.env")
        for requirement in self.pip:
            check_requirement(requirement)
        for pkg in self.apt:
            if not re.fullmatch(r"[a-z0-9][a-z0-9+.\-]*(=[\w.+:~-]+)?", pkg):
                raise ConfigurationError(f"Image.apt: {pkg!r} is not a Debian package name")
        missing = [p for p in self.includes if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(
                f"Image.includes: {', '.join(map(repr, missing))} not found "
                f"(paths are relative to {os.getcwd()})"
            )

    def __repr__(self) -> str:
        shown = shown_env(self.env)
        fields = [f"{n}={getattr(self, n)!r}" for n in ("python", "pip", "pip_indexes", "apt")]
        return f"Image({', '.join(fields)}, env={shown!r}, includes={self.includes!r}, ...)"

    @property
    def needs_build(self) -> bool:
        """Whether nodes have anything to build for this image."""
        return bool(self.pip or self.apt or self.includes or self.setup or self.python)

    def includes_archive(self) -> bytes:
        """A reproducible tar.gz of ``includes`` (empty bytes when there are none): each
        include under its base name, without what ``excludes`` and the defaults match."""
        if not self.includes:
            return b""
        exclude = glob_excludes(DEFAULT_EXCLUDES + self.excludes)
        sources = [Source(p, os.path.basename(os.path.normpath(p)), exclude) for p in self.includes]
        return build_archive(sources, level=1).data

    def build_spec(self, includes: bytes) -> dict[str, Any]:
        """What a node needs to build this image (no env values: they are not built in)."""
        spec: dict[str, Any] = {
            "python": self.python,
            "pip": list(self.pip),
            "pip_indexes": list(self.pip_indexes),
            "apt": list(self.apt),
            "setup": list(self.setup),
            "includes_sha256": hashlib.sha256(includes).hexdigest() if includes else "",
        }
        if self.pip_index_packages:
            spec["pip_index_packages"] = {u: list(n) for u, n in self.pip_index_packages.items()}
        spec["hash"] = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
        return spec


def is_installed(path: str) -> bool:
    """Whether ``path`` belongs to the client's interpreter (its installation, a virtual
    environment) or to a site-packages: not the user's own code."""
    import sys

    real = os.path.realpath(path)
    if "site-packages" in real or "dist-packages" in real:
        return True
    roots = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
    return any(
        real == root or real.startswith(root + os.sep) for root in map(os.path.realpath, roots)
    )


def ship_user_modules() -> list[str]:
    """Pickle the user's own modules by value, for nodes that do not have them.

    A module is the user's when its file lies outside the interpreter's installation and
    outside any site-packages: the project the client runs from. Returns their names.
    """
    import sys

    import cloudpickle

    shipped = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or "." in name or name == "__main__" or name.startswith("flotilla"):
            continue
        if is_installed(file):
            continue
        cloudpickle.register_pickle_by_value(module)
        shipped.append(name)
    return shipped
