"""The with-block every test lab shares: ``start()`` on entry (``close()`` at once if it
fails part way, so nothing it made is left), ``close()`` on exit."""

from __future__ import annotations

from typing import Self


class Lifecycle:
    """Base of a lab: subclasses define ``start`` and ``close`` (idempotent)."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
