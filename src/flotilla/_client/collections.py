"""A pool's distributed collections by name: ``pool.dict(...)``, ``pool.counter(...)``...
(the methods :class:`~flotilla.Compute` takes from :class:`PoolCollections`)."""

from __future__ import annotations

from .._collections import (
    NOT_CLUSTER,
    Barrier,
    Consistency,
    Counter,
    Dict,
    Lock,
    Queue,
    Registry,
    Set,
    count_parties,
)
from .._errors import ClusterRequiredError
from .._providers.base import Options
from .store import Store


class PoolCollections:
    """The collections of a pool whose ``_store`` holds them (see ``store.py``)."""

    options: Options
    _store: Store

    def _collections_store(self) -> Store:
        if not self.options.cluster:
            raise ClusterRequiredError(NOT_CLUSTER)
        return self._store

    def dict(self, name: str, *, consistency: Consistency | None = None) -> Dict:
        """The pool's distributed dict ``name`` (``sky.dict``)."""
        return Dict(name, self._collections_store(), consistency)

    def counter(self, name: str, *, consistency: Consistency | None = None) -> Counter:
        """The pool's distributed counter ``name`` (``sky.counter``)."""
        return Counter(name, self._collections_store(), consistency)

    def set(self, name: str, *, consistency: Consistency | None = None) -> Set:
        """The pool's distributed set ``name`` (``sky.set``)."""
        return Set(name, self._collections_store(), consistency)

    def queue(self, name: str) -> Queue:
        """The pool's distributed queue ``name`` (``sky.queue``)."""
        return Queue(name, self._collections_store())

    def barrier(self, name: str, n: int | None = None, *, parties: int | None = None) -> Barrier:
        """The pool's barrier ``name`` for ``n`` (or ``parties``) parties (``sky.barrier``)."""
        return Barrier(name, count_parties(n, parties), self._collections_store())

    def lock(self, name: str, *, ttl: float | None = None, timeout: float | None = None) -> Lock:
        """The pool's distributed lock ``name`` (``sky.lock``)."""
        return Lock(name, self._collections_store(), ttl, timeout)

    def registry(self, name: str) -> Registry:
        """The pool's registry ``name`` (``sky.registry``)."""
        return Registry(name, self._collections_store())
