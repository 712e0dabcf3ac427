"""The functions every system runs: plain, standard-library-only module-level functions.

They live in their own small module so that every system (flotilla's executors, Ray and
Dask workers, multiprocessing children) imports the same code by reference, and so that
importing it costs nothing on a worker.
"""

from __future__ import annotations

import os
import time
from typing import Any


def noop(x: object = None) -> object:
    return x


def total(arr: Any) -> float:
    """Sum of a numpy array (numpy is imported by the array's unpickling)."""
    return float(arr.sum())


def whoami(delay: float = 0.0) -> tuple[int, int]:
    """(pid, parent pid) of the process running the task, after ``delay`` seconds.

    A delay makes concurrent calls overlap, so that they land on different workers.
    """
    time.sleep(delay)
    return os.getpid(), os.getppid()
