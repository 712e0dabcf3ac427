"""Skyward's guide programs run on flotilla with only the import and the provider changed.

The guides are Skyward's (github.com/gabfssilva/skyward, ``guides/*.py``, MIT licence,
copyright (c) 2026 Gabriel Francisco). They are not copied into this repository: this
module reads them from a Skyward checkout named by ``SKYWARD_GUIDES`` (its ``guides``
folder) and skips without one. Each program is changed in exactly two ways before it runs,
and ``adapt`` checks that nothing else differs:

- ``import skyward as sky`` becomes ``import flotilla as sky``;
- ``provider=sky.AWS()`` (RunPod, VastAI...) becomes ``provider=sky.Local()``, and
  ``sky.Container()`` becomes the container lab's podman settings (``tests/_container.py``:
  a root filesystem built here, since no registry is reachable).

Each test asserts the outcome the guide states (its printed results). The guides that need
a GPU, MIG, a cloud account or a download (model hubs, MNIST) are set aside and listed in
``SET_ASIDE``; ``06_pytorch_distributed.py`` asks for a T4 but trains on CPU where there is
none, so it also runs here with its ``accelerator=`` line dropped (a third change, said in
its test). Guides that take minutes at their own sizes and have no size parameter (09, 10,
14) run only with ``FLOTILLA_SLOW_GUIDES=1``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _container import ContainerLab, container_lab_fixture  # noqa: F401 - the fixture

SRC = Path(__file__).resolve().parent.parent / "src"
GUIDES = Path(os.environ.get("SKYWARD_GUIDES", "")) if os.environ.get("SKYWARD_GUIDES") else None
SLOW = os.environ.get("FLOTILLA_SLOW_GUIDES") == "1"

SET_ASIDE = {
    "04_gpu_accelerators.py": "GPU (accelerator=T4 and CUDA checks)",
    "07_keras_training.py": "GPU (accelerator=T4) and MNIST download",
    "08_huggingface_finetuning.py": "GPU, and a model and data set from the Hugging Face hub",
    "12_multi_provider.py": "cloud accounts and GPUs (VastAI, AWS, RunPod, Verda)",
    "15_torch_model_roundtrip.py": "MNIST download and torch from the PyTorch wheel index",
    "16_cuml_acceleration.py": "GPU (cuML)",
    "17_s3_volumes.py": "a cloud account (Hyperstack object storage)",
    "18_nvidia_mig.py": "GPU with MIG",
    "19_fsdp_huggingface.py": "GPUs, and a model and data set from the Hugging Face hub",
    "20_fractional_gpus.py": "GPU (fractional accelerators)",
}

pytestmark = pytest.mark.skipif(
    GUIDES is None or not GUIDES.is_dir(),
    reason="SKYWARD_GUIDES names no folder (a Skyward checkout's guides/); the guides are "
    "Skyward's and are not copied here",
)

_PROVIDER = re.compile(r"provider=sky\.(AWS|GCP|RunPod|VastAI|Hyperstack|Verda|Lambda)\(\)")
_ACCELERATOR = re.compile(r"^\s*accelerator=sky\.accelerators\.\w+\(.*\),\s*$")


def adapt(source: str, provider: str, *, drop_accelerator: bool = False) -> str:
    """The guide with the import and the provider changed, and nothing else."""
    lines = source.splitlines(keepends=True)
    out = []
    imports = providers = 0
    for line in lines:
        if line.strip() == "import skyward as sky":
            line = line.replace("import skyward as sky", "import flotilla as sky")
            imports += 1
        elif _PROVIDER.search(line) or "sky.Container()" in line:
            line = _PROVIDER.sub(f"provider={provider}", line)
            line = line.replace("sky.Container()", provider)
            providers += 1
        elif drop_accelerator and _ACCELERATOR.match(line):
            continue
        out.append(line)
    assert imports == 1, "the guide has no `import skyward as sky`"
    assert providers >= 1, "the guide names no provider"
    assert "skyward" not in "".join(out).replace("Skyward", ""), "skyward is still used"
    return "".join(out)


def run_guide(name: str, tmp_path: Path, provider: str, timeout: float, **kw: bool) -> str:
    assert GUIDES is not None
    program = tmp_path / name
    program.write_text(adapt((GUIDES / name).read_text(), provider, **kw))
    env = {**os.environ, "PYTHONPATH": str(SRC), "NO_COLOR": "1"}
    proc = subprocess.run(
        [sys.executable, str(program)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def container(lab: ContainerLab) -> str:
    return f"sky.Container(**{lab.settings()!r})"


def test_set_aside_guides_are_the_rest() -> None:
    """Every guide is either run by a test here or set aside with a reason."""
    assert GUIDES is not None
    run_here = {
        "01_hello_skyward.py",
        "02_parallel_execution.py",
        "03_broadcast.py",
        "05_data_sharding.py",
        "06_pytorch_distributed.py",
        "09_scikit_grid_search.py",
        "10_joblib_concurrency.py",
        "11_local_containers.py",
        "13_streaming.py",
        "14_worker_executors.py",
        "21_standalone_workers.py",
    }
    assert sorted(p.name for p in GUIDES.glob("*.py")) == sorted(run_here | set(SET_ASIDE))


def test_01_hello(tmp_path: Path) -> None:
    out = run_guide("01_hello_skyward.py", tmp_path, "sky.Local()", 60)
    assert "2 + 3 = 5\n" in out
    assert "Stats: {'count': 5, 'sum': 15, 'mean': 3.0}\n" in out


def test_02_parallel_execution(tmp_path: Path) -> None:
    out = run_guide("02_parallel_execution.py", tmp_path, "sky.Local()", 60)
    assert "Chunk sums: (6, 15, 24)\n" in out
    assert "Products: 6, 20\n" in out
    assert "Mixed: sum=6, product=200, factorial=120\n" in out
    got = sorted(int(v) for v in re.findall(r"Got: (\d+)", out))
    assert got == [0, 1000, 2000, 3000, 4000]


def test_03_broadcast(tmp_path: Path) -> None:
    out = run_guide("03_broadcast.py", tmp_path, "sky.Local()", 60)
    nodes = re.findall(r"Node (\d): (\d+) items", out)
    assert nodes == [(str(k), "250") for k in range(4)]
    assert "Total: 499500 (expected: 499500)" in out


def test_05_data_sharding(tmp_path: Path) -> None:
    out = run_guide("05_data_sharding.py", tmp_path, "sky.Local()", 90)
    assert re.findall(r"Node (\d): (\d+) samples", out) == [(str(k), "250") for k in range(4)]
    for k in range(4):
        assert f"Node {k}: list=list, tuple=tuple, array=ndarray" in out


def test_06_pytorch_ddp_on_cpu(tmp_path: Path) -> None:
    """Asks for a T4; with its `accelerator=` line dropped it trains with DDP on CPU."""
    out = run_guide(
        "06_pytorch_distributed.py", tmp_path, "sky.Local()", 110, drop_accelerator=True
    )
    assert len(re.findall(r"Epoch \d/5: loss=", out)) == 5  # the head's lines only
    head = re.search(r"Node 0 \(HEAD\): loss=([\d.]+), acc=([\d.]+)%", out)
    worker = re.search(r"Node 1 \(WORKER\): loss=([\d.]+), acc=([\d.]+)%", out)
    assert head and worker
    assert head.groups() == worker.groups()  # all-reduced: the same numbers on both


def test_11_local_containers(tmp_path: Path, container_lab: ContainerLab) -> None:
    out = run_guide("11_local_containers.py", tmp_path, container(container_lab), 110)
    lines = out.splitlines()
    assert lines[0].startswith("Hello from ")
    assert lines[1] == "it works"
    assert lines[2:5] == [f"  Node {k}/3 (head={k == 0})" for k in range(3)]
    assert lines[5] == "  Total: 4950"


def _check_streaming(out: str) -> None:
    fib = [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
    assert "Fibonacci (first 10):\n" + "".join(f"  {v}\n" for v in fib) in out
    means = "".join(f"  after {i} values: {(i + 1) / 2:.2f}\n" for i in range(1, 6))
    assert means in out
    averages = [1.0, 1.5, 2.0, 3.0, 4.0, 5.0]
    assert "window=3) of 1..6:\n" + "".join(f"  {v:.2f}\n" for v in averages) in out


def test_13_streaming_in_a_container(tmp_path: Path, container_lab: ContainerLab) -> None:
    _check_streaming(run_guide("13_streaming.py", tmp_path, container(container_lab), 110))


def test_13_streaming_on_the_local_provider(tmp_path: Path) -> None:
    _check_streaming(run_guide("13_streaming.py", tmp_path, "sky.Local()", 60))


def test_21_standalone_workers(tmp_path: Path) -> None:
    out = run_guide("21_standalone_workers.py", tmp_path, "sky.Local()", 110)
    chunks = re.findall(r"Chunk (\d): node=(\d) elapsed=", out)
    assert sorted(int(c) for c, _ in chunks) == list(range(8))
    assert {int(n) for _, n in chunks} == {0, 1, 2, 3}  # spread over the 4 nodes


@pytest.mark.skipif(not SLOW, reason="~4 min at the guide's own size: FLOTILLA_SLOW_GUIDES=1")
@pytest.mark.timeout(900)
def test_09_scikit_grid_search(tmp_path: Path) -> None:
    out = run_guide("09_scikit_grid_search.py", tmp_path, "sky.Local()", 900)
    assert "Total candidates: 21, fits: 105\n" in out
    best = re.search(r"Best: (\w+), CV=([\d.]+)%, Test=([\d.]+)%", out)
    assert best and float(best.group(2)) > 90


@pytest.mark.skipif(not SLOW, reason="100 workers, 2000 tasks of 5 s: FLOTILLA_SLOW_GUIDES=1")
@pytest.mark.timeout(900)
def test_10_joblib_concurrency(tmp_path: Path) -> None:
    out = run_guide("10_joblib_concurrency.py", tmp_path, "sky.Local()", 900)
    assert "Tasks: 2000 | Nodes: 10 | Concurrency: 10\n" in out
    assert re.search(r"Total time: [\d.]+s", out)


@pytest.mark.skipif(not SLOW, reason="2 x 20 tasks of 10 s on 6 slots: FLOTILLA_SLOW_GUIDES=1")
@pytest.mark.timeout(900)
def test_14_worker_executors(tmp_path: Path) -> None:
    out = run_guide("14_worker_executors.py", tmp_path, "sky.Local()", 600)
    for executor in ("thread", "process"):
        done = re.findall(rf"\[{executor}\] Task (\d+): [\d,]+ iters in (\d+\.\d)s", out)
        assert sorted(int(t) for t, _ in done) == list(range(20))
        assert all(float(s) >= 10.0 for _, s in done)
