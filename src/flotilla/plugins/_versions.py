"""Version arguments of the plugins (``version="2.3.0"``, ``">=2.3"``, ``"latest"``).

* ``"latest"``: no constraint (pip picks the newest release).
* A bare version (``"2.3.0"``, ``"2.3.*"``) pins it: ``==2.3.0``.
* A constraint (``">=2.3"``, ``"~=2.4"``, ``"<2.5"``, ``">=2.3,<2.5"``) is passed through.

Anything else is a ValueError when the plugin is created, not on the nodes. The rules are
PEP 440's as ``packaging`` (the library pip vendors) implements them: one parser, so
flotilla and pip cannot disagree on what a version means.
"""

from __future__ import annotations

from .._errors import ConfigurationError


def version_spec(version: str, what: str = "version") -> str:
    """The pip specifier for a plugin's version argument ('' for "latest")."""
    if not isinstance(version, str):
        raise ConfigurationError(f"{what} must be a string such as 'latest', '2.3.0' or '>=2.3'")
    text = "".join(version.split())
    if text == "latest":
        return ""
    spec = "==" + text if text[:1].isdigit() else text
    if not text or not is_valid_specifier(spec):
        raise ConfigurationError(
            f"invalid {what} {version!r}: use 'latest', a version such as '2.3.0', "
            "or a constraint such as '>=2.3', '~=2.4' or '>=2.3,<2.5'"
        )
    return spec


def requirement(package: str, version: str, what: str = "version") -> str:
    """``requirement("torch", "2.3.0")`` -> ``"torch==2.3.0"``; "latest" -> ``"torch"``."""
    return package + version_spec(version, what)


def is_valid_specifier(spec: str) -> bool:
    """Whether ``spec`` (e.g. ``">=2.3,<2.5"``) is a valid pip version specifier.

    Stricter than pip on one point: an empty clause (``">=2.3,"``) is refused as a typo.
    """
    if not spec or spec[0] not in "<>=!~" or not all(spec.split(",")):
        return False
    # here, not at the top: the plugins' modules load on the nodes, which have only the
    # standard library; versions are checked on the client, where the plugin is created
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        SpecifierSet(spec)
    except InvalidSpecifier:
        return False
    return True
