"""How many NVIDIA GPUs this machine has (standard library only: it also runs on nodes).

The device nodes ``/dev/nvidia0``, ``/dev/nvidia1``... are counted first: no process to
start, and they are there wherever the driver is loaded on the machine itself. Where none
is visible though GPUs are usable (WSL2, where the GPUs are behind ``/dev/dxg``; a
container whose runtime exposes the GPUs without their device nodes), the GPUs
``nvidia-smi -L`` lists are counted (its ``GPU N: ...`` lines; the MIG devices under a GPU
are not more GPUs).
"""

from __future__ import annotations

import glob
import shutil
import subprocess

NVIDIA_SMI_TIMEOUT = 30.0
"""Seconds ``nvidia-smi -L`` may take (a driver that is still loading answers slowly)."""


def gpu_count() -> int:
    """The NVIDIA GPUs of this machine: its ``/dev/nvidia<N>`` device nodes, else the GPUs
    ``nvidia-smi -L`` lists (0 without either)."""
    devices = glob.glob("/dev/nvidia[0-9]*")
    if devices:
        return len(devices)
    return len(listed_gpus())


def listed_gpus() -> list[str]:
    """The ``GPU N: ...`` lines of ``nvidia-smi -L`` ([] when it is not installed, fails or
    hangs)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return []
    try:
        done = subprocess.run(
            [tool, "-L"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if done.returncode != 0:
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.startswith("GPU ")]
