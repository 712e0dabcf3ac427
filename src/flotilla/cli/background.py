"""Starting the command line's background processes: a cluster's daemon (``launch``) and a
managed job's controller (``jobs launch``).

Each is ``python -m MODULE ... --ready-fd W`` in its own session (Ctrl-C in the terminal
does not reach it; it outlives the command), with this flotilla first on its import path
and its output appended to a log file. It writes one byte to ``W`` once it is ready; end of
file instead means it exited first, and the caller reports its log.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
"""The folder holding this ``flotilla`` package: first on the background process's path."""


class Background:
    """A background process being started.

    Attributes:
        proc: the process.
        ready_fd: the read end of its ready pipe (closed by :meth:`wait_ready`).
    """

    def __init__(
        self, module: str, args: Sequence[str], log: Path, cwd: Path, stdin: bytes | None = None
    ) -> None:
        """Start ``python -m module *args --ready-fd W`` in ``cwd``, appending its output to
        ``log``; ``stdin``, when given, is written to its standard input (then closed)."""
        env = dict(os.environ)
        env.pop("COMPUTE_POOL", None)
        env["PYTHONPATH"] = os.pathsep.join(
            [PACKAGE_ROOT, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        )
        self.ready_fd, write_fd = os.pipe()
        try:
            with open(log, "ab") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", module, *args, "--ready-fd", str(write_fd)],
                    stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                    stdout=out,
                    stderr=out,
                    pass_fds=(write_fd,),
                    start_new_session=True,
                    cwd=cwd,
                    env=env,
                )
        except BaseException:
            os.close(self.ready_fd)
            raise
        finally:
            os.close(write_fd)
        if stdin is not None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError), self.proc.stdin:  # gone: wait_ready says so
                self.proc.stdin.write(stdin)

    def wait_ready(self) -> bool:
        """Wait until the process is ready (True) or has exited (False; its exit status is
        then in ``proc.returncode``). A ready process lives on in its own session."""
        try:
            ready = os.read(self.ready_fd, 1)
        except OSError:
            ready = b""
        finally:
            os.close(self.ready_fd)
        if not ready:
            self.proc.wait()
            return False
        self.proc.returncode = 0  # it lives on in its own session: no ResourceWarning
        return True
