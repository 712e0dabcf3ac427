"""The ``flotilla`` command: run task files (SkyPilot format) on named multi-node clusters.

    flotilla launch task.yaml -c dev --nodes 3     start cluster dev, sync, setup, run
    flotilla exec dev task.yaml | 'CMD'            sync the workdir and run (no setup)
    flotilla status                                clusters: provider, nodes, state, age, idle
    flotilla queue dev                             the cluster's jobs
    flotilla logs dev [JOB] [--node K]             a job's output, followed (--no-follow)
    flotilla cancel dev JOB... | -a [-y]           stop jobs on every node
    flotilla ssh dev [--node K] [--] [CMD...]      a shell in a node's working directory
    flotilla down dev... | -a [-y]                 stop everything, remove the clusters
    flotilla jobs launch|queue|logs|cancel ...     managed jobs: recovered when nodes are lost

Exit status: the job's own, or one of ``conventions.EXIT_CODES`` for flotilla's own.

Commands that only talk to a running cluster import nothing heavy (no asyncio, no pool
machinery): the cluster daemon (``daemon``) does the work and streams the output back. A
run builds and imports only the command it names (``parser.build_parser``): the backends,
the server and the observers load when a command needs them.

Where things are: ``parser`` (the commands and their flags), ``cmd_run`` (launch, exec),
``cmd_jobs`` (queue, logs, cancel), ``cmd_clusters`` (status, down, ssh), ``clusters``
(reaching a cluster's daemon), ``console`` (what is printed), ``backends`` (one module per
provider kind, listed in ``backends.registry``), ``daemon`` and ``jobs`` (the daemon's side),
``managed`` (``flotilla jobs``: managed jobs and their controller).
"""

from __future__ import annotations

import contextlib
import os
import sys

from .._errors import ConfigurationError, FlotillaError, ProvisionError, WorkerDiedError
from .console import CLIError, say
from .conventions import (
    EXIT_FLOTILLA,
    EXIT_INTERRUPTED,
    EXIT_LOST,
    EXIT_PROVISION,
    EXIT_USAGE,
    split_command,
)
from .parser import build_parser, command_of, command_options


def main(argv: list[str] | None = None) -> int:
    """The ``flotilla`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    after: list[str] = []
    parser = build_parser(command_of(argv))  # that command's modules only
    valued = command_options(parser, argv[0]) if argv else None
    if valued is not None:  # `flotilla ssh NAME --node 1 CMD ARGS`: CMD is not parsed
        parsed, after = split_command(argv[1:], valued)
        argv = [argv[0], *parsed]
    elif "--" in argv and argv[0] != "exec":  # exec: argparse's `--`, words of the command
        cut = argv.index("--")
        argv, after = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if after and getattr(args, "takes_options", False):  # `rsync SRC DST -- RSYNC FLAGS`
        args.options = after
    elif after:
        if not getattr(args, "takes_rest", False):
            parser.error("`--` is only for `flotilla ssh NAME -- CMD` and `rsync SRC DST -- ...`")
        args.remote = [*args.remote, *after]
    try:
        return int(args.func(args))
    except CLIError as e:
        say(f"error: {e}")
        return e.code
    except ConfigurationError as e:
        say(f"error: {e}")
        return EXIT_USAGE
    except ProvisionError as e:
        say(f"error: {e}")
        return EXIT_PROVISION
    except WorkerDiedError as e:  # a node lost under the command
        say(f"error: {e}")
        return EXIT_LOST
    except FlotillaError as e:
        say(f"error: {e}")
        return EXIT_FLOTILLA
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
