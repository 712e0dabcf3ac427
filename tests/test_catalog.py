"""The accelerator catalog (Skyward's factories, variants and aliases) and how it reads
each provider's GPU names; Skyward's multi-provider spelling: ``Spec``,
``Compute(*specs, selection=)``, ``Compute(region=, disk_gb=)``, the per-node cost cap."""

from __future__ import annotations

import pytest
from _vast import VastLab, vast_lab_fixture  # noqa: F401 - the vast_lab fixture

import flotilla as sky
from flotilla._accelerators import CATALOG, identify, offered_as, unknown_name
from flotilla._errors import ConfigurationError, ProvisionError


def test_the_catalog_has_skywards_models_and_factories() -> None:
    assert len(CATALOG) >= 115
    acc = sky.accelerators
    assert acc.A100(8, memory="40GB") == sky.Accelerator("A100", 8, True, "40GB", None)
    assert acc.H100(form_factor="sxm").form_factor == "SXM"
    assert acc.RTX_4090().name == "RTX 4090" and acc.RTX_5090().cuda
    assert acc.MI300X().cuda is False and acc.TPUv5e().name == "TPUv5e"
    assert acc.RTX_A6000().name == "RTX A6000" and acc.L40S(count=0.5).fractional
    with pytest.raises(ConfigurationError, match="comes with 40GB, 80GB"):
        acc.A100(memory="60GB")
    with pytest.raises(ConfigurationError, match="comes as SXM, PCIe, NVL"):
        acc.H100(form_factor="OAM")
    assert acc.Custom("My-GPU", 2).name == "My-GPU"


@pytest.mark.parametrize(
    ("provider", "name", "model", "memory", "form"),
    [
        ("runpod", "NVIDIA A100-SXM4-80GB", "A100", 80, "SXM"),
        ("runpod", "NVIDIA A100 80GB PCIe", "A100", 80, "PCIe"),
        ("runpod", "NVIDIA H100 80GB HBM3", "H100", 80, "SXM"),
        ("runpod", "NVIDIA GeForce RTX 4090", "RTX 4090", None, None),
        ("runpod", "NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", None, None),
        ("runpod", "AMD Instinct MI300X OAM", "MI300X", 192, None),
        ("lambda", "gpu_8x_a100_80gb_sxm4", "A100", 80, "SXM"),
        ("lambda", "gpu_1x_a100", "A100", 40, "PCIe"),
        ("lambda", "gpu_1x_h100_pcie", "H100", None, "PCIe"),
        ("lambda", "gpu_1x_a6000", "RTX A6000", None, None),
        ("lambda", "gpu_1x_rtx6000", "Quadro RTX 6000", None, None),
        ("lambda", "gpu_1x_gh200", "GH200", None, None),
        ("vast", "A100 SXM4", "A100", None, "SXM"),
        ("vast", "Tesla T4", "T4", None, None),
        ("vast", "H100 NVL", "H100", None, "NVL"),
        ("vast", "RTX 4070 Ti Super", "RTX 4070 Ti Super", None, None),
        ("gcp", "nvidia-tesla-a100", "A100", 40, "SXM"),
        ("gcp", "nvidia-l4", "L4", None, None),
    ],
)
def test_each_providers_names_are_read(
    provider: str, name: str, model: str, memory: int | None, form: str | None
) -> None:
    found, mem, ff = identify(name, provider)
    assert (found.name if found else None, mem, ff) == (model, memory, form)


def test_an_accelerator_matches_its_variants_only() -> None:
    a100_80 = sky.accelerators.A100(memory="80GB")
    assert offered_as(a100_80, "NVIDIA A100-SXM4-80GB", "runpod")
    assert not offered_as(a100_80, "gpu_1x_a100", "lambda")  # a 40 GB one
    assert offered_as(sky.accelerators.A100(), "gpu_1x_a100", "lambda")
    sxm = sky.accelerators.H100(form_factor="SXM")
    assert offered_as(sxm, "NVIDIA H100 80GB HBM3", "runpod")
    assert not offered_as(sxm, "NVIDIA H100 PCIe", "runpod")
    assert not offered_as(sky.accelerators.A10(), "NVIDIA A100 80GB PCIe")
    assert offered_as(sky.Accelerator("My-GPU"), "my gpu")  # a name of no catalog entry


def test_an_unknown_name_lists_the_nearest_and_what_is_offered() -> None:
    text = unknown_name("A1000", "RunPod", {"runpod": ["NVIDIA A100 80GB PCIe"]})
    assert "not a name flotilla's catalog knows; nearest: A100" in text
    assert "runpod offers NVIDIA A100 80GB PCIe" in text


# -- Skyward's multi-provider spelling --------------------------------------------------------
def test_specs_make_a_fallback_in_selection_order(vast_lab: VastLab) -> None:
    """The first spec wants A100s at most $1/h a node: Vast's A100s cost $2, so it is
    skipped (nothing rented) and the second spec's T4 is chosen; the specs' nodes=2 is the
    pool's size."""
    vast_lab.add_machines(2, gpu_name="A100 SXM4", dph_total=2.0)
    vast_lab.add_machines(2, gpu_name="Tesla T4", dph_total=0.3)
    with sky.Compute(
        sky.Spec(sky.VastAI(), "A100", nodes=2, max_hourly_cost=1.0),
        sky.Spec(sky.VastAI(), sky.accelerators.T4(), nodes=2),
        selection="first",
        options=sky.Options(cluster=False),
    ) as pool:
        assert pool.size.desired == 2
        chosen = pool.provider.chosen  # type: ignore[attr-defined]
        assert chosen.accelerator.name == "T4"
    gpus = {i.machine.spec.gpu_name for i in vast_lab.instances.values()}
    rented = [p for m, p in vast_lab.requests if m == "PUT" and "/asks/" in p]
    assert len(rented) == 2 and gpus <= {"Tesla T4"}


def test_region_and_disk_go_to_the_providers_settings(vast_lab: VastLab) -> None:
    spec = sky.Spec(sky.VastAI(), region="SE", disk_gb=55)
    pool = sky.Compute(spec, options=sky.Options(cluster=False))
    settings = pool.provider.provider.settings  # type: ignore[attr-defined]
    assert settings.regions == ("SE",) and settings.disk_gb == 55.0
    direct = sky.Compute(provider=sky.VastAI(), region="US", disk_gb=30)
    assert direct.provider.settings.regions == ("US",)  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match="has no choice of architecture"):
        sky.Compute(provider=sky.VastAI(), architecture="arm64")
    with pytest.raises(ConfigurationError, match="has no region setting"):
        sky.Compute(provider=sky.Local(), region="us-east-1")
    with pytest.raises(ConfigurationError, match="different pool sizes"):
        sky.Compute(sky.Spec(sky.VastAI(), nodes=1), sky.Spec(sky.VastAI(), nodes=2))
    with pytest.raises(ConfigurationError, match="selection='fastest'"):
        sky.Compute(sky.Spec(sky.VastAI()), selection="fastest")


def test_the_per_node_cap_refuses_before_renting(vast_lab: VastLab) -> None:
    vast_lab.add_machines(2, dph_total=3.0)
    with (
        pytest.raises(ProvisionError, match=r"max_node_hourly_cost=\$2.00/h a node"),
        sky.Compute(
            provider=sky.VastAI(), max_node_hourly_cost=2.0, options=sky.Options(cluster=False)
        ),
    ):
        pass
    assert not [p for m, p in vast_lab.requests if m == "PUT"]
