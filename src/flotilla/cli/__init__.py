"""The ``flotilla`` command line (see ``main``)."""

from .main import main

__all__ = ["main"]
