"""A node's GPUs: its ``/dev/nvidia<N>`` device nodes, else the GPUs ``nvidia-smi -L``
lists (``flotilla._system.gpus``), checked against a stand-in ``nvidia-smi`` on ``PATH``
that prints what the real one prints; a task file's ``accelerators`` on the local
provider then runs with that many GPUs per node."""

from __future__ import annotations

import glob
import os
import stat
import sys
from pathlib import Path

import pytest
from test_cli import CLI, node_lines
from test_cli import cli as cli  # the fixture

from flotilla._system.gpus import gpu_count

pytestmark = pytest.mark.skipif(
    bool(glob.glob("/dev/nvidia[0-9]*")),
    reason="this machine has NVIDIA device nodes: they are counted, not the stand-in's list",
)

TWO_T4 = """\
GPU 0: Tesla T4 (UUID: GPU-6f1c2a3b-0000-1111-2222-333344445550)
GPU 1: Tesla T4 (UUID: GPU-6f1c2a3b-0000-1111-2222-333344445551)
"""
A100_MIG = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5b3e5c-0000-1111-2222-333344445555)
  MIG 3g.40gb     Device  0: (UUID: MIG-11111111-aaaa-5bbb-8ccc-000000000001)
  MIG 3g.40gb     Device  1: (UUID: MIG-22222222-aaaa-5bbb-8ccc-000000000002)
"""


def stand_in_nvidia_smi(bin_dir: Path, listing: str, code: int = 0) -> str:
    """An ``nvidia-smi`` in ``bin_dir`` that prints ``listing`` for ``-L``; the PATH that
    finds it first."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text(
        f"#!{sys.executable}\nimport sys\n"
        f"if sys.argv[1:] != ['-L']:\n    sys.exit(2)\n"
        f"print({listing!r}, end='')\nsys.exit({code})\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_gpus_listed_by_nvidia_smi_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", stand_in_nvidia_smi(tmp_path / "bin", TWO_T4))
    assert gpu_count() == 2
    monkeypatch.setenv("PATH", stand_in_nvidia_smi(tmp_path / "mig", A100_MIG))
    assert gpu_count() == 1  # its MIG devices are not more GPUs


def test_no_gpu_when_nvidia_smi_fails_or_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_driver = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    monkeypatch.setenv("PATH", stand_in_nvidia_smi(tmp_path / "bin", no_driver, code=9))
    assert gpu_count() == 0
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_count() == 0


def test_a_task_needing_gpus_runs_where_nvidia_smi_lists_them(cli: CLI, tmp_path: Path) -> None:
    """No /dev/nvidia* here: the local provider's check and the nodes' own count (the job's
    GPU check) both take the GPUs the stand-in lists."""
    cli.env["PATH"] = stand_in_nvidia_smi(tmp_path / "bin", TWO_T4)
    task = cli.task(
        "gpus.yaml",
        """\
        resources:
          accelerators: T4:2
        run: echo "GPUS $SKYPILOT_NUM_GPUS_PER_NODE"
        """,
    )
    done = cli.ok("launch", "--down", "-c", "gpus", task)
    assert node_lines(done.stdout, "GPUS") == {0: "2"}
    cli.env["PATH"] = stand_in_nvidia_smi(tmp_path / "one", TWO_T4.splitlines()[0] + "\n")
    refused = cli("launch", "--down", "-c", "gpus", task)
    assert refused.returncode != 0
    assert "needs 2 GPU(s) per node but this machine has 1" in refused.stderr, refused.stderr
