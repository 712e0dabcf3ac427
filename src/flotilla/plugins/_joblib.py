"""joblib and scikit-learn with the pool's nodes standing in for their worker processes.

Inside the pool's ``with`` block, ``joblib.Parallel(n_jobs=-1)(...)`` and every scikit-learn
estimator or search run with ``n_jobs=-1`` send their batches to the pool's nodes instead of
forking local processes: the plugin registers a joblib backend named ``"flotilla"`` and makes
it the default while the pool runs (``around_pool``). Each batch joblib hands a worker is one
single call on the pool (the least busy node); ``n_jobs=-1`` means one worker per process of
the pool. The nodes need joblib (and scikit-learn) to unpickle the batches: ``transform``
adds them to the Image.

Client side only; joblib is imported when a pool with the plugin opens.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ._base import Plugin
from ._extend import extend
from ._versions import requirement

BACKEND = "flotilla"
"""The joblib backend's name (``joblib.parallel_config(backend="flotilla")``)."""


def run_batch(batch: Callable[[], Any]) -> Any:
    """A joblib batch, run on a node (sent by reference)."""
    return batch()


@dataclass(frozen=True)
class JoblibPlugin(Plugin):
    """See :func:`flotilla.plugins.joblib`."""

    version: str = "latest"
    sklearn: str | None = None  # scikit-learn's version when the sklearn plugin made it

    name = "joblib"

    def __post_init__(self) -> None:
        self.requirements()  # a bad version is an error now, not on the nodes

    def requirements(self) -> list[str]:
        reqs = [requirement("joblib", self.version, "joblib version")]
        if self.sklearn is not None:
            reqs.append(requirement("scikit-learn", self.sklearn, "scikit-learn version"))
        return reqs

    def transform(self, image: Any, cluster: Any) -> Any:
        """Add joblib (and scikit-learn) to the image."""
        return extend(image, pip=self.requirements())

    def around_pool(self, pool: Any) -> Any:
        """joblib's default backend is the pool while it runs."""
        return _joblib_on(pool, strip_warning_filters=self.sklearn is not None)


@contextmanager
def _joblib_on(pool: Any, strip_warning_filters: bool) -> Iterator[None]:
    import joblib

    backend = _backend_class()
    joblib.register_parallel_backend(BACKEND, lambda **kw: backend(pool, **kw))
    saved = list(warnings.filters)
    if strip_warning_filters:
        # scikit-learn's Parallel ships the caller's warning filters inside every batch; a
        # filter whose category comes from a package the nodes lack would make the batch
        # fail to unpickle there. Keep the standard library's while the pool runs.
        warnings.filters = [f for f in warnings.filters if _stdlib(f[2])]
    try:
        with joblib.parallel_config(backend=BACKEND):
            yield
    finally:
        warnings.filters = saved


def _stdlib(category: Any) -> bool:
    root = str(getattr(category, "__module__", "builtins")).split(".")[0]
    return root in sys.stdlib_module_names or root == "builtins"


_backend: type | None = None


def _backend_class() -> type:
    """The joblib backend class (defined on first use: joblib is imported only then)."""
    global _backend
    if _backend is not None:
        return _backend
    from joblib._parallel_backends import SequentialBackend
    from joblib.parallel import ParallelBackendBase

    from .._client.function import Function, PendingCall  # client side only

    batch_call = Function(run_batch)

    class FlotillaBackend(ParallelBackendBase):  # type: ignore[misc]
        """Sends each batch to the pool as a single call."""

        supports_retrieve_callback = True
        supports_timeout = True
        uses_threads = False

        def __init__(self, pool: Any, nesting_level: int | None = None, **kwargs: Any) -> None:
            super().__init__(nesting_level=nesting_level, **kwargs)
            self.pool = pool
            self.futures: set[Future[Any]] = set()

        def effective_n_jobs(self, n_jobs: int | None) -> int:
            if n_jobs == 0:
                raise ValueError("n_jobs == 0 in Parallel has no meaning")
            per_node = getattr(self.pool, "workers_per_node", self.pool.procs_per_node)
            slots = max(1, int(self.pool.nodes) * int(per_node))  # every worker slot
            if n_jobs is None:
                return slots
            return max(1, slots + 1 + n_jobs) if n_jobs < 0 else n_jobs  # -1: every slot

        def configure(self, n_jobs: int = 1, parallel: Any = None, **kwargs: Any) -> int:
            self.parallel = parallel
            return self.effective_n_jobs(n_jobs)

        def submit(
            self, func: Callable[[], Any], callback: Callable[[Any], None] | None = None
        ) -> Future[Any]:
            future: Future[Any] = self.pool.submit(PendingCall(batch_call, (func,), {}))
            self.futures.add(future)
            future.add_done_callback(self.futures.discard)
            if callback is not None:
                future.add_done_callback(callback)
            return future

        def retrieve_result_callback(self, out: Future[Any]) -> Any:
            return out.result()

        def get_nested_backend(self) -> tuple[Any, int | None]:
            return SequentialBackend(nesting_level=(self.nesting_level or 0) + 1), None

        def abort_everything(self, ensure_ready: bool = True) -> None:
            for future in list(self.futures):
                future.cancel()

    _backend = FlotillaBackend
    return _backend
