"""One interpreter on both sides: every node runs the client's Python minor version.

A function defined in the client's script travels by value (cloudpickle: its byte code),
and byte code runs only on the Python minor version that made it: on another one it may
raise nonsense or crash the interpreter. So no call is sent to a node whose agent runs
another minor version. Every pool start and node replacement, whatever the provider
(``flotilla launch``/``exec`` and managed jobs too), passes :func:`settle` once the agents'
HELLOs are in, before any configuration or task is sent:

* the node's minor version is the client's: nothing to do;
* the user named the interpreter (the provider's ``python=``): refused, a ProvisionError;
* otherwise the agent looks for one on its node (:mod:`flotilla._node.interpreter`), with
  ``Image(python="3.X")`` installs one with uv if none is found, and becomes it; the
  console says which; none: a ProvisionError naming both versions and the ways out.

``Image(python=...)`` of another minor version than the client's is refused by
:func:`check_image` when the pool is made, before anything is provisioned.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigurationError, ProvisionError
from .._image import Image
from .._redaction import plain_env
from .._wire.bodies import Hello
from .._wire.frames import Kind
from .node import Node

MIRROR_VAR = "UV_PYTHON_INSTALL_MIRROR"
"""Where ``uv python install`` downloads from (an ``Image.env`` entry is passed on)."""


def client_minor() -> str:
    """This client's Python minor version ("3.11")."""
    return "%d.%d" % sys.version_info[:2]  # noqa: UP031


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def check_image(image: Image) -> None:
    """Refuse an Image asking for another Python minor version than the client's: the
    client's functions could not run there (ConfigurationError, before anything starts)."""
    if image.python is not None and _minor(image.python) != client_minor():
        raise ConfigurationError(
            f"Image(python={image.python!r}) but this client runs Python "
            f"{_client_version()}: functions travel to the nodes as byte code, which only "
            f"the same Python minor version runs. Use Image(python={client_minor()!r}), or run "
            f"this client on Python {_minor(image.python)}"
        )


@dataclass(frozen=True)
class Policy:
    """What a pool allows when a node's Python is another minor version.

    Attributes:
        pinned: the user named the interpreter (provider's ``python=``): only check it.
        install: ``Image(python=...)`` was given: installing one (uv) is allowed.
        mirror: ``UV_PYTHON_INSTALL_MIRROR`` from the Image's env ("" for the node's own).
        home: where nodes keep flotilla's tools (uv is installed there if missing).
        provider: the provider's name, for the error's advice (``SSH(python=...)``).
    """

    pinned: bool
    install: bool
    mirror: str
    home: str
    provider: str

    @classmethod
    def of(cls, provider: Any, image: Image) -> Policy:
        mirror = plain_env(image.env).get(MIRROR_VAR, "")
        name = type(provider).__name__
        return cls(
            bool(getattr(provider, "python_pinned", False)),
            image.python is not None,
            mirror,
            str(provider.home),
            name,
        )


async def settle(
    nodes: list[Node], policy: Policy, say: Callable[[str], None], timeout: float
) -> None:
    """Make every node of ``nodes`` (their HELLOs received) run the client's Python minor
    version, or raise ProvisionError (see the module docstring)."""
    await asyncio.gather(*(_settle(n, policy, say, timeout) for n in nodes))


async def _settle(node: Node, policy: Policy, say: Callable[[str], None], timeout: float) -> None:
    first = node.hello_info.copy()
    if _minor(str(first.get("python_version", ""))) == client_minor():
        return
    if policy.pinned:
        raise _refusal(node, first, policy, "")
    assert node.loop is not None
    node.hello = node.loop.create_future()
    request = {
        "version": client_minor(),
        "install": policy.install,
        "mirror": policy.mirror or None,
        "home": policy.home,
    }
    node.send_control(Kind.PYTHON, body=json.dumps(request).encode())
    try:
        async with asyncio.timeout(timeout):
            info = await node.hello
    except TimeoutError:
        raise ProvisionError(
            f"{node.name}: looking for Python {client_minor()} took more than {timeout:.0f} s "
            "(Options(start_timeout=...) sets the limit)"
        ) from None
    search = info.get("python_search")
    if search is not None or _minor(str(info.get("python_version", ""))) != client_minor():
        looked = search["looked"] if search else []
        raise _refusal(node, first, policy, "; ".join(looked) or "nothing found")
    how = "installed" if info.get("switched_from", {}).get("installed") else "found"
    say(
        f"{node.name}: runs on Python {info['python_version']} ({info['python']}), {how} on "
        f"the node: its {first.get('python')} is Python {first.get('python_version')}, and "
        f"functions travel as byte code of this client's Python {client_minor()}"
    )


def _client_version() -> str:
    return "%d.%d.%d" % sys.version_info[:3]  # noqa: UP031


def _refusal(node: Node, hello: Hello, policy: Policy, looked: str) -> ProvisionError:
    """The error for a node without the client's Python minor version: both versions and
    the three ways out."""
    have, python, want = hello.get("python_version", "?"), hello.get("python", "?"), client_minor()
    if policy.pinned:
        why = f"its interpreter was named with {policy.provider}(python=...)"
    elif policy.install:
        why = f"none was found on the node, nor installed (looked at: {looked})"
    else:
        why = f"none was found on the node (looked at: {looked})"
    return ProvisionError(
        f"{node.name}: the node runs Python {have} ({python}) but this client runs Python "
        f"{_client_version()}, and functions travel as byte code that only the same Python "
        f"minor version runs; no task was sent. A Python {want} is needed on the node: "
        f"{why}. Ways out: name one with {policy.provider}(python='/path/to/python{want}'); "
        f"let flotilla install one with Image(python={want!r}) (uv python install; without "
        f"python=, which also lets flotilla look for one on the node); or run this client "
        f"on Python {_minor(have)}"
    )
