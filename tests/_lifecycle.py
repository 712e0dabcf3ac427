"""The with-block every test lab shares: ``start()`` on entry (``close()`` at once if it
fails part way, so nothing it made is left), ``close()`` on exit; and the environment a
client of the lab reads (:meth:`Lifecycle.environment`), in ``os.environ`` only inside
that block, or, for a lab that outlives one test (a ``SharedLab``, a module's fixture),
only inside the fixture each test asks for."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Self

from flotilla.plugins._env import environ

MARKET_PREFIXES = ("AWS_", "GOOGLE_", "CLOUDSDK_", "VAST_", "RUNPOD_", "LAMBDA_", "VERDA_")
"""The environment variables a cloud's or market's client reads (its credentials, its API
address): set by the labs (each while a test that asked for it runs), looked at by every
configured-market command."""


def environment(
    env: Mapping[str, str], clear: Sequence[str] = ()
) -> contextlib.AbstractContextManager[None]:
    """``env`` in ``os.environ`` (and ``clear`` out of it) inside the block; afterwards each
    of those variables as it was before (even if the block changed it meanwhile): the
    plugins' own ``environ``."""
    return environ({**dict.fromkeys(clear), **env})


class Lifecycle:
    """Base of a lab: subclasses define ``start`` and ``close`` (idempotent), and
    :meth:`environment` when a client finds the lab through environment variables."""

    _entered: contextlib.ExitStack | None = None

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def environment(self) -> contextlib.AbstractContextManager[None]:
        """What a client of the lab needs in ``os.environ`` (its address, credentials),
        there inside the block only. Nothing by default."""
        return contextlib.nullcontext()

    def started(self) -> Self:
        """Started (closed at once if that fails part way), its environment NOT applied:
        for a lab several tests share, whose fixture for one test applies it."""
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> Self:
        self.started()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self.environment())
        except BaseException:
            self.close()
            raise
        stack.callback(self.close)  # (first: closed in its environment, put back after)
        self._entered = stack
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._entered = self._entered, None
        if stack is None:
            self.close()
        else:
            stack.close()
