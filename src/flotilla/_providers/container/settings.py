"""The Container provider's settings: one frozen object, checked when made (before anything
starts). Light to import: the command line derives its options from it."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from ..._errors import ConfigurationError, check_text
from ..options import From, docker_image, option

BINARIES = ("docker", "podman")
"""The container engines whose command lines the provider speaks."""

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = (
    r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
    r"(?::[0-9]+)?"
)
IMAGE_REFERENCE = re.compile(
    rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
)
"""An image reference as the OCI distribution spec defines it (``[host[:port]/]name[:tag]
[@digest]``); the engines refuse anything else."""
_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")
"""A container or network name, as docker and podman accept them."""


def python_version() -> str:
    """The client's Python minor version, Skyward's ``{python_version}`` in image names."""
    return "%d.%d" % sys.version_info[:2]  # noqa: UP031


@dataclass(frozen=True)
class ContainerSettings:
    """Where and how the Container provider runs a pool's containers; checked when made.

    Attributes:
        image: the nodes' image (default: ``python:<client's X.Y>-slim``); it needs a Python
            of the client's minor version, no SSH daemon. ``{python_version}`` in it is
            replaced by the client's ``X.Y`` (Skyward's form).
        binary: the container engine's command: ``docker`` or ``podman`` (a path to one
            works too).
        network: a network every pool shares (created when missing, never removed); None:
            each pool makes its own and removes it at the end.
        container_prefix: the start of the containers' names (default ``flotilla``).
        python: the interpreter in the image (default ``python3``); given, it is only
            checked to be the client's minor version.
        workdir: folder in the containers for flotilla's files and the agents' working
            directory.
        rootfs: podman only: a root filesystem folder to run instead of an image
            (``podman run --rootfs DIR:O``: each container writes to an overlay of its
            own, the folder is never changed); no registry is needed.
        volumes: bind mounts, ``HOST:CONTAINER[:OPTIONS]`` (``-v``), in every container.
        run_args: more arguments of every ``run`` (e.g. ``--ulimit nofile=1024:1024``,
            ``--device ...``), before the image.
        binary_args: arguments of the engine itself, before every subcommand (e.g.
            podman's ``--runtime runc``).
    """

    image: str | None = option(None, task=From(("image_id",), docker_image))
    binary: str = "docker"
    network: str | None = None
    container_prefix: str | None = None
    python: str | None = None
    workdir: str = "/tmp/flotilla"
    rootfs: str | None = None
    volumes: tuple[str, ...] = ()
    run_args: tuple[str, ...] = ()
    binary_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in ("volumes", "run_args", "binary_args"):
            value = getattr(self, key)
            if isinstance(value, list):  # a list, or a flag's words
                object.__setattr__(self, key, tuple(value))
            value = getattr(self, key)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ConfigurationError(
                    f"Container({key}=...) must be a list of non-empty strings, got {value!r}"
                )
        if not isinstance(self.binary, str) or not self.binary.strip():
            raise ConfigurationError(
                f"Container(binary=...) must be 'docker' or 'podman', got {self.binary!r}"
            )
        if self.engine not in BINARIES:
            raise ConfigurationError(
                f"Container(binary={self.binary!r}): flotilla speaks the command lines of "
                f"{' and '.join(BINARIES)} (a path to one of them works too)"
            )
        for key in ("python", "workdir"):
            value = getattr(self, key)
            message = f"Container({key}=...) must be a non-empty string, got {value!r}"
            check_text(value, message, or_none=True)
        if self.image is not None and (
            not isinstance(self.image, str) or not IMAGE_REFERENCE.fullmatch(self.image_name)
        ):
            raise ConfigurationError(
                f"Container(image={self.image!r}) is not an image name "
                "([registry/]name[:tag][@digest], lowercase name, e.g. "
                "'python:3.11-slim' or 'ghcr.io/org/img:v1')"
            )
        for key in ("network", "container_prefix"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not _NAME.fullmatch(value)):
                raise ConfigurationError(
                    f"Container({key}={value!r}): letters, digits, '_', '.' and '-' only, "
                    "starting with a letter or digit"
                )
        if self.rootfs is not None:
            if not isinstance(self.rootfs, str) or not self.rootfs.startswith("/"):
                raise ConfigurationError(
                    f"Container(rootfs=...) must be an absolute folder path, got {self.rootfs!r}"
                )
            if self.image is not None:
                raise ConfigurationError("Container(): give image= or rootfs=, not both")
            if self.engine != "podman":
                raise ConfigurationError(
                    f"Container(rootfs=...) runs `podman run --rootfs`; {self.binary!r} has "
                    "no such option (use binary='podman')"
                )
        for volume in self.volumes:
            parts = volume.split(":")
            if len(parts) not in (2, 3) or not parts[0] or not parts[1].startswith("/"):
                raise ConfigurationError(
                    f"Container(volumes=[{volume!r}]): each is HOST:CONTAINER[:OPTIONS] "
                    "with an absolute CONTAINER path"
                )

    @property
    def engine(self) -> str:
        """``docker`` or ``podman``: the command line ``binary`` speaks."""
        return self.binary.rstrip("/").rsplit("/", 1)[-1]

    @property
    def image_name(self) -> str:
        """The image to run, ``{python_version}`` replaced."""
        image = self.image or "python:{python_version}-slim"
        return image.replace("{python_version}", python_version())

    @property
    def prefix(self) -> str:
        return self.container_prefix or "flotilla"
