"""Mounts: detach every mount under a folder before the folder is removed (standard library
only; the node's agent, the local provider and the command line's cleanup use it)."""

from __future__ import annotations

import os
import shutil
import subprocess


def unmount_under(folder: str) -> list[str]:
    """Detach every mount at or under ``folder`` (deepest first, lazily: at once even if
    busy); the mount points detached. Called before a node's folder is removed, so that
    removing it can never walk into a bucket and delete its objects."""
    try:
        with open("/proc/self/mounts") as f:
            points = [line.split()[1] for line in f if len(line.split()) > 1]
    except OSError:
        return []
    root = os.path.realpath(folder)
    points = [
        p.replace("\\040", " ") for p in points if p == root or p.startswith(root.rstrip("/") + "/")
    ]
    for point in sorted(points, key=len, reverse=True):
        for argv in (["fusermount", "-uz", point], ["umount", "-l", point]):
            if shutil.which(argv[0]) and not subprocess.run(argv, capture_output=True).returncode:
                break
    return points
