"""The GPU-only parts of Skyward's API without a GPU: ``plugins.mig``, ``plugins.mps``,
``plugins.cuml`` and fractional accelerator counts.

What is observed here: the API (arguments refused before anything starts), the images the
plugins ask for, and the environment contract of every worker process, with stand-in
``nvidia-smi`` and ``nvidia-cuda-mps-control`` on PATH that print what real ones print (MIG
devices) and log how they were called, and a stand-in ``cuml`` package. What needs a GPU
(MIG partitions made, an MPS daemon serving CUDA, cuML on a GPU, a provider's slice of a
GPU) is not tested (docs/providers.md, "GPU sharing").
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

import flotilla as sky
from flotilla._errors import ConfigurationError
from flotilla._image import Image
from flotilla._info import InstanceInfo
from flotilla._providers.base import Options, PoolSpec

MIG_LIST = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5b3e5c-0000-1111-2222-333344445555)
  MIG 3g.40gb     Device  0: (UUID: MIG-11111111-aaaa-5bbb-8ccc-000000000001)
  MIG 3g.40gb     Device  1: (UUID: MIG-22222222-aaaa-5bbb-8ccc-000000000002)
"""


def _tool(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def nvidia(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Stand-in NVIDIA tools on PATH; their calls are logged to ``tmp_path/calls``."""
    log = tmp_path / "calls"
    logger = f"import sys\nopen({str(log)!r}, 'a').write(' '.join(sys.argv) + '\\n')\n"
    _tool(tmp_path / "bin", "nvidia-smi", logger + f"print({MIG_LIST!r}, end='')\n")
    _tool(tmp_path / "bin", "nvidia-cuda-mps-control", logger)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return log


def _info(worker: int, node: int = 0) -> InstanceInfo:
    return InstanceInfo(
        node=node,
        total_nodes=1,
        is_head=node == 0,
        head_addr="",
        head_port=0,
        accelerators=1,
        peers=(),
        pool_id="p",
        worker=worker,
        workers_per_node=2,
    )


def _spec(concurrency: int) -> PoolSpec:
    options = Options(worker=sky.Worker(concurrency=concurrency))
    return PoolSpec("p", 1, None, None, (), options)


# -- MIG ------------------------------------------------------------------------------------
def test_mig_gives_each_worker_its_own_instance(nvidia: Path) -> None:
    plugin = sky.plugins.mig("3g.40gb")
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    seen = []
    for worker in (0, 1):
        cm = plugin.around_process(_info(worker))
        assert cm is not None
        with cm:
            seen.append(os.environ["CUDA_VISIBLE_DEVICES"])
        assert "CUDA_VISIBLE_DEVICES" not in os.environ  # restored when the process ends
    assert seen == [
        "MIG-11111111-aaaa-5bbb-8ccc-000000000001",
        "MIG-22222222-aaaa-5bbb-8ccc-000000000002",
    ]
    assert nvidia.read_text().split("\n")[0].endswith("nvidia-smi -L")


def test_mig_a_worker_without_an_instance_is_an_error(nvidia: Path) -> None:
    with pytest.raises(ConfigurationError, match="worker 2 of node 0 has no MIG instance"):
        sky.plugins.mig("3g.40gb").around_process(_info(2))


def test_mig_partitions_once_per_worker_slot_when_the_node_is_built() -> None:
    image = sky.plugins.mig("1g.10gb").transform(Image(setup=("echo hi",)), _spec(3))
    assert image.setup == (
        "echo hi",
        "nvidia-smi -mig 1",
        *["nvidia-smi mig -cgi 1g.10gb -C"] * 3,
    )
    assert image.env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert sky.plugins.mig("1g.10gb").transform(None, _spec(1)).setup[-1].endswith("-C")


@pytest.mark.parametrize("profile", ["", "big", "3g", 3])
def test_mig_refuses_a_bad_profile(profile: object) -> None:
    with pytest.raises(ConfigurationError, match="MIG profile"):
        sky.plugins.mig(profile)  # type: ignore[arg-type]


# -- MPS ------------------------------------------------------------------------------------
def test_mps_sets_its_variables_and_starts_the_daemon(nvidia: Path) -> None:
    plugin = sky.plugins.mps(active_thread_percentage=25, pinned_memory_limit="0=2G")
    cm = plugin.around_process(_info(0))
    assert cm is not None
    with cm:
        env = {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}
        assert Path("/tmp/nvidia-mps").is_dir() and Path("/tmp/nvidia-mps-log").is_dir()
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_LOG_DIRECTORY": "/tmp/nvidia-mps-log",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G",
    }
    assert not any(k.startswith("CUDA_MPS_") for k in os.environ)
    assert nvidia.read_text().strip().endswith("nvidia-cuda-mps-control -d")
    assert set(sky.plugins.mps().env()) == {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"active_thread_percentage": 0},
        {"active_thread_percentage": 101},
        {"pinned_memory_limit": "2G"},
    ],
)
def test_mps_refuses_bad_limits(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError, match=r"plugins\.mps"):
        sky.plugins.mps(**kwargs)  # type: ignore[arg-type]


# -- cuML -----------------------------------------------------------------------------------
def test_cuml_installs_from_nvidias_index_only_its_package() -> None:
    image = sky.plugins.cuml().transform(Image(pip=("pandas",)), _spec(1))
    assert image.pip == ("pandas", "cuml-cu12")
    # a scoped index (PipIndex): NVIDIA's index serves cuml-cu12 and nothing else
    assert image.pip_index_packages == {"https://pypi.nvidia.com": ("cuml-cu12",)}
    assert image.pip_indexes == ()
    with pytest.raises(ConfigurationError, match="CUDA suffix"):
        sky.plugins.cuml("12")


def test_cuml_accelerates_sklearn_in_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "pkg" / "cuml"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "accel.py").write_text("installed = []\ndef install():\n    installed.append(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    assert sky.plugins.cuml().around_process(_info(0)) is None
    import cuml.accel  # type: ignore[import-not-found]

    assert cuml.accel.installed == [1]
    for name in ("cuml.accel", "cuml"):
        sys.modules.pop(name, None)


def test_gpu_plugins_travel_pickled() -> None:
    import pickle

    for plugin in (sky.plugins.mig("1g.10gb"), sky.plugins.mps(50), sky.plugins.cuml()):
        assert repr(pickle.loads(pickle.dumps(plugin))) == repr(plugin)


# -- fractional accelerators ----------------------------------------------------------------
def test_fractional_counts_are_skywards() -> None:
    half = sky.accelerators.L4(count=0.5)
    assert (half.count, half.fractional, half.whole, str(half)) == (0.5, True, 1, "L4:0.5")
    assert sky.accelerators.A100(count=8.0).count == 8
    assert str(sky.Compute(accelerator="L4:0.25", nodes=1).accelerator) == "L4:0.25"
    for bad in (1.5, 0, -0.5, True, "half"):
        with pytest.raises(ConfigurationError):
            sky.accelerators.L4(count=bad)  # type: ignore[arg-type]


def test_a_fractional_count_is_refused_where_the_provider_has_none(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no fractional accelerators"):
        sky.Compute(
            provider=sky.Local(workdir=str(tmp_path)),
            nodes=1,
            accelerator=sky.accelerators.L4(count=0.5),
        ).open()
    assert not any(tmp_path.iterdir())  # nothing started
