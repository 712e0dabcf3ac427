"""Adding packages, indexes and environment variables to an ``Image`` from ``transform``.

An image is a frozen dataclass with (at least) ``pip``, ``pip_indexes`` and ``env`` fields
(``flotilla.Image``). :func:`extend` returns a copy with entries appended, keeping
everything the image already has and never listing a package or an index twice.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .._errors import ConfigurationError

_NAME = re.compile(r"\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")


def package_name(requirement: str) -> str:
    """The normalised name in a pip requirement: ``"Torch_Vision>=1"`` -> ``"torch-vision"``
    (PEP 503, as pip compares names). Not a requirement (a path, a URL): itself, lowered."""
    from packaging.utils import canonicalize_name  # client side only (see _versions)

    m = _NAME.match(requirement)
    if m is None:
        return requirement.strip().lower()
    return canonicalize_name(m.group(1))


def merge_requirements(existing: Iterable[str], added: Iterable[str]) -> tuple[str, ...]:
    """``existing`` followed by the ``added`` requirements it does not name yet.

    A package the image already lists with a version, extras or marker is kept as the image
    has it (the user's choice wins); one it lists as a bare name (``"torch"``) is refined in
    place by a more specific added requirement (``"torch==2.3.0"``).
    """
    out = list(existing)
    for req in added:
        name = package_name(req)
        index = next((i for i, r in enumerate(out) if package_name(r) == name), None)
        if index is None:
            out.append(req)
        elif out[index].strip().lower() == name and req.strip().lower() != name:
            out[index] = req
    return tuple(out)


def merge_indexes(existing: Iterable[str], added: Iterable[str]) -> tuple[str, ...]:
    """``existing`` followed by the ``added`` index URLs it lacks (trailing '/' ignored)."""
    out = list(existing)
    seen = {url.rstrip("/") for url in out}
    for url in added:
        if url.rstrip("/") not in seen:
            out.append(url)
            seen.add(url.rstrip("/"))
    return tuple(out)


def image_class() -> type[Any] | None:
    """``flotilla.Image`` if this version of flotilla has it, else None."""
    flotilla = importlib.import_module("flotilla")
    cls = getattr(flotilla, "Image", None)
    return cls if isinstance(cls, type) else None


def extend(
    image: Any,
    pip: Iterable[str] = (),
    pip_indexes: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    index_packages: Mapping[str, Iterable[str]] | None = None,
) -> Any:
    """A copy of ``image`` with ``pip``, ``pip_indexes`` and ``env`` added.

    ``image`` None (the provider's default environment) becomes a default ``flotilla.Image``
    with the additions, so that the nodes still get the packages; without an ``Image`` type
    in this version of flotilla, None is returned unchanged. Variables the image's ``env``
    already sets are kept. ``index_packages`` scopes indexes to packages (see
    ``Image.pip_index_packages``; where this version's Image has no such field, the
    indexes are left unscoped).
    """
    pip, pip_indexes = tuple(pip), tuple(pip_indexes)
    if not (pip or pip_indexes or env):
        return image
    if image is None:
        cls = image_class()
        if cls is None:
            return None
        image = cls()
    if not dataclasses.is_dataclass(image) or isinstance(image, type):
        raise ConfigurationError(
            f"a plugin cannot add packages to image {image!r}: expected a flotilla.Image "
            "(a dataclass with pip, pip_indexes and env fields)"
        )
    changes: dict[str, Any] = {}
    if pip:
        changes["pip"] = merge_requirements(image.pip, pip)  # type: ignore[attr-defined]
    if pip_indexes:
        changes["pip_indexes"] = merge_indexes(image.pip_indexes, pip_indexes)  # type: ignore[attr-defined]
    if env:
        changes["env"] = {**env, **image.env}  # type: ignore[attr-defined]
    if index_packages and hasattr(image, "pip_index_packages"):
        scoped = {u: tuple(n) for u, n in image.pip_index_packages.items()}
        for url, names in index_packages.items():
            scoped[url] = tuple(dict.fromkeys([*scoped.get(url, ()), *names]))
        changes["pip_index_packages"] = scoped
    return dataclasses.replace(image, **changes)
