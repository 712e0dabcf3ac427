"""``python -m flotilla.cli.rsh NODE.CLUSTER COMMAND...``: the remote shell ``flotilla
rsync`` gives rsync (``rsync -e``). rsync runs it with the host part of ``NODE.CLUSTER:PATH``
and the command to start on the other side (``rsync --server ...``); it runs that command
on the node through the backend's shell channel (``cmd_files.node_shell``), in the node's
working directory, its stdin and stdout rsync's connection."""

from __future__ import annotations

import shlex
import sys

from .cmd_files import Remote, exec_shell, node_shell


def main(argv: list[str]) -> int:
    if len(argv) < 2 or "." not in argv[0]:
        print("usage: python -m flotilla.cli.rsh NODE.CLUSTER COMMAND...", file=sys.stderr)
        return 2
    node, _, cluster = argv[0].partition(".")
    exec_shell(node_shell(Remote(cluster, int(node), ""), shlex.join(argv[1:])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
