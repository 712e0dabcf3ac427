"""What the engine plugins (``_ray``, ``_dask``) share: the engine's package is added to the
image, and on the nodes of a cluster pool the engine's daemons run around each executor
process (the plugin's ``_node``)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from .._info import InstanceInfo
from ._base import Plugin
from ._extend import extend


class EnginePlugin(Plugin):
    """Base class of the engine plugins; see the module docstring."""

    requires_cluster = True
    forms_group = True

    def requirement(self) -> str:
        """The engine's pip requirement."""
        raise NotImplementedError

    def transform(self, image: Any, cluster: Any) -> Any:
        """Add the engine to the image (installed with the node's own pip/uv configuration)."""
        return extend(image, pip=[self.requirement()])

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[None] | None:
        if not info.cluster:
            return None
        return self._node(info)

    def _node(self, info: InstanceInfo) -> AbstractContextManager[None]:
        """The engine's daemons of this node, while its executor process lives."""
        raise NotImplementedError
