"""NVIDIA GPU sharing plugins (Skyward's ``mig``, ``mps`` and ``cuml``).

The environment contract, per worker (task slot) process, is what Skyward sets:

* ``mig``: the node's GPUs are split into MIG instances of ``profile`` when its environment
  is built (``nvidia-smi -mig 1``, then one ``nvidia-smi mig -cgi PROFILE -C`` per worker
  slot); each worker process gets ``CUDA_VISIBLE_DEVICES=<the MIG-... UUID at its slot>``,
  read from ``nvidia-smi -L``, before its first task; ``NVIDIA_VISIBLE_DEVICES=all``.
* ``mps``: ``CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps``,
  ``CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log`` (made), and when given
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``; the
  control daemon is started (``nvidia-cuda-mps-control -d``) once per node, before the
  processes' first task.
* ``cuml``: installs ``cuml-<cuda>`` from NVIDIA's index (only that package from there)
  and runs ``cuml.accel.install()`` in each process (scikit-learn calls go to the GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigurationError, check_number
from .._info import InstanceInfo
from ._base import Plugin
from ._env import environ

MIG_UUID = re.compile(r"\b(MIG-[0-9a-fA-F-]+)")
MPS_PIPE = "/tmp/nvidia-mps"
MPS_LOG = "/tmp/nvidia-mps-log"


def _image(image: Any) -> Any:
    from .._image import Image

    return Image() if image is None else image


def _slots(cluster: Any) -> int:
    worker = getattr(getattr(cluster, "options", None), "worker", None)
    return int(getattr(worker, "concurrency", 1) or 1)


def mig_devices() -> list[str]:
    """The MIG device UUIDs ``nvidia-smi -L`` lists, in its order."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigurationError(f"plugins.mig(): nvidia-smi -L failed: {e}") from e
    return MIG_UUID.findall(out)


@dataclass(frozen=True)
class MigPlugin(Plugin):
    """``plugins.mig(profile)``: each worker process on its own MIG instance."""

    name = "mig"
    profile: str

    def __post_init__(self) -> None:
        profile = self.profile
        if not isinstance(profile, str) or not re.fullmatch(r"\d+g\.\d+gb(\+me)?", profile):
            raise ConfigurationError(
                f"plugins.mig(profile={profile!r}): a MIG profile name, e.g. '1g.10gb' or '3g.40gb'"
            )

    def transform(self, image: Any, cluster: Any) -> Any:
        image = _image(image)
        create = [f"nvidia-smi mig -cgi {self.profile} -C" for _ in range(_slots(cluster))]
        return dataclasses.replace(
            image,
            env={**image.env, "NVIDIA_VISIBLE_DEVICES": "all"},
            setup=(*image.setup, "nvidia-smi -mig 1", *create),
        )

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[Any] | None:
        devices = mig_devices()
        slot = info.worker
        if slot >= len(devices):
            raise ConfigurationError(
                f"plugins.mig(): worker {slot} of node {info.node} has no MIG instance "
                f"(nvidia-smi -L lists {len(devices)}: {', '.join(devices) or 'none'})"
            )
        return environ({"CUDA_VISIBLE_DEVICES": devices[slot]})


@dataclass(frozen=True)
class MpsPlugin(Plugin):
    """``plugins.mps(...)``: the worker processes share each GPU through MPS."""

    name = "mps"
    active_thread_percentage: int | None = None
    pinned_memory_limit: str | None = None

    def __post_init__(self) -> None:
        pct, pinned_memory_limit = self.active_thread_percentage, self.pinned_memory_limit
        check_number(
            pct,
            f"plugins.mps(active_thread_percentage={pct!r}): an integer from 1 to 100",
            whole=True,
            at_least=1,
            at_most=100,
            or_none=True,
        )
        if pinned_memory_limit is not None and not re.fullmatch(
            r"\d+=\d+[KMG]?(,\d+=\d+[KMG]?)*", str(pinned_memory_limit)
        ):
            raise ConfigurationError(
                f"plugins.mps(pinned_memory_limit={pinned_memory_limit!r}): DEVICE=SIZE[,...] "
                "as CUDA_MPS_PINNED_DEVICE_MEM_LIMIT takes it, e.g. '0=2G'"
            )

    def env(self) -> dict[str, str]:
        """The ``CUDA_MPS_*`` variables of every worker process."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE, "CUDA_MPS_LOG_DIRECTORY": MPS_LOG}
        if self.active_thread_percentage is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.active_thread_percentage)
        if self.pinned_memory_limit is not None:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = self.pinned_memory_limit
        return env

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[Any] | None:
        return self._setup()

    @contextlib.contextmanager
    def _setup(self) -> Iterator[None]:
        env = self.env()
        with environ(env):
            for folder in (MPS_PIPE, MPS_LOG):
                os.makedirs(folder, exist_ok=True)
            # one daemon per node: a second start finds it running and exits non-zero
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True, timeout=60)
            yield


@dataclass(frozen=True)
class CumlPlugin(Plugin):
    """``plugins.cuml(cuda)``: RAPIDS cuML, and scikit-learn accelerated by it."""

    name = "cuml"
    cuda: str = "cu12"

    def __post_init__(self) -> None:
        if not isinstance(self.cuda, str) or not re.fullmatch(r"cu\d+", self.cuda):
            raise ConfigurationError(
                f"plugins.cuml(cuda={self.cuda!r}): a CUDA suffix, e.g. 'cu12'"
            )

    @property
    def package(self) -> str:
        return f"cuml-{self.cuda}"

    def transform(self, image: Any, cluster: Any) -> Any:
        from .._image import PipIndex

        image = _image(image)
        index = PipIndex(url="https://pypi.nvidia.com", packages=(self.package,))
        return dataclasses.replace(
            image,
            pip=(*image.pip, self.package),
            pip_indexes=(*image.pip_indexes, index),
        )

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[Any] | None:
        import cuml.accel  # type: ignore[import-not-found]

        cuml.accel.install()
        return None
