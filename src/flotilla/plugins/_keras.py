"""The Keras 3 plugin: the backend chosen before Keras is imported, data parallelism."""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigurationError
from .._info import InstanceInfo
from ._base import Plugin
from ._env import environ
from ._extend import extend
from ._jax import check_cluster, distributed, is_distributed

KERAS_BACKENDS = ("jax", "torch", "tensorflow")


def common_seed(info: InstanceInfo) -> int:
    """A random seed that is the same on every node of a pool (and differs between pools)."""
    return int.from_bytes(hashlib.sha256(info.pool_id.encode()).digest()[:4], "little")


@dataclass(frozen=True)
class KerasPlugin(Plugin):
    """See :func:`flotilla.plugins.keras`."""

    backend: str = "jax"

    name = "keras"

    @property
    def forms_group(self) -> bool:  # type: ignore[override]
        """With JAX, the processes of a pool of several form one distributed runtime."""
        return self.backend == "jax"

    def __post_init__(self) -> None:
        if self.backend not in KERAS_BACKENDS:
            raise ConfigurationError(
                f"keras backend must be one of {', '.join(KERAS_BACKENDS)}, got {self.backend!r}"
            )

    def transform(self, image: Any, cluster: Any) -> Any:
        """Add ``keras`` to the image (the backend's own plugin installs the backend)."""
        if self.backend == "jax":
            check_cluster(self.name, cluster)
        return extend(image, pip=["keras"])

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[None]:
        """Set ``KERAS_BACKEND``; with JAX on several nodes, a global ``DataParallel``."""
        return self._session(info)

    @contextmanager
    def _session(self, info: InstanceInfo) -> Iterator[None]:
        with environ({"KERAS_BACKEND": self.backend}):
            loaded = sys.modules.get("keras")
            if loaded is not None and loaded.backend.backend() != self.backend:
                raise RuntimeError(
                    f"plugins.keras(backend={self.backend!r}): keras was already imported "
                    f"with the {loaded.backend.backend()!r} backend; put the keras plugin "
                    "before any plugin that imports keras"
                )
            if self.backend != "jax" or not is_distributed(info):
                yield
                return
            with distributed(info):  # a no-op when plugins.jax() initialised it already
                keras: Any = importlib.import_module("keras")
                # Replicas must start from identical weights: one seed on every node, as
                # keras.distribution.initialize() does (the function may set its own).
                keras.utils.set_random_seed(common_seed(info))
                dist = keras.distribution
                previous = dist.distribution()
                # Each node feeds its own part of the data (flotilla.shard), so keras must not
                # shard it again (its auto-sharding needs a tf.data.Dataset).
                parallel = dist.DataParallel(devices=dist.list_devices(), auto_shard_dataset=False)
                dist.set_distribution(parallel)
                try:
                    yield
                finally:
                    dist.set_distribution(previous)
