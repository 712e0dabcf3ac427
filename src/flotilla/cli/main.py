"""The ``flotilla`` command: run task files (SkyPilot format) on named multi-node clusters.

    flotilla launch task.yaml -c dev --nodes 3     start cluster dev, sync, setup, run
    flotilla exec dev task.yaml | 'CMD'            sync the workdir and run (no setup)
    flotilla status                                clusters: provider, nodes, state, age, idle
    flotilla queue dev                             the cluster's jobs
    flotilla logs dev [JOB] [--follow] [--node K]  a job's output, kept per node
    flotilla cancel dev JOB                        stop a job on every node
    flotilla ssh dev [--node K] [CMD]              a shell in a node's working directory
    flotilla down dev                              stop everything, remove the cluster

Commands that only talk to a running cluster import nothing heavy (no asyncio, no pool
machinery): the cluster daemon (``daemon``) does the work and streams the output back.

Where things are: ``parser`` (the commands and their flags), ``cmd_run`` (launch, exec),
``cmd_jobs`` (queue, logs, cancel), ``cmd_clusters`` (status, down, ssh), ``clusters``
(reaching a cluster's daemon), ``console`` (what is printed), ``backends`` (one module per
provider kind, listed in ``backends.registry``), ``daemon`` and ``jobs`` (the daemon's side).
"""

from __future__ import annotations

import contextlib
import os
import sys

from .._errors import ConfigurationError, FlotillaError
from .console import CLIError, say
from .parser import build_parser


def main(argv: list[str] | None = None) -> int:
    """The ``flotilla`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    after: list[str] = []
    if "--" in argv:  # `flotilla ssh NAME --node 1 -- CMD ARGS`: CMD is not parsed
        cut = argv.index("--")
        argv, after = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if after:
        if not getattr(args, "takes_rest", False):
            parser.error("`--` is only for `flotilla ssh NAME -- CMD`")
        args.remote = [*args.remote, *after]
    try:
        return int(args.func(args))
    except CLIError as e:
        say(f"error: {e}")
        return e.code
    except ConfigurationError as e:
        say(f"error: {e}")
        return 2
    except FlotillaError as e:
        say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
