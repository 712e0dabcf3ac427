"""Skyward's PipIndex in Image(pip_indexes=[...]): an index scoped to some packages
becomes Image.pip_index_packages (searched for those packages only, see _node/build.py)."""

from __future__ import annotations

import pytest

import flotilla as sky

TORCH = "https://download.pytorch.org/whl/cpu"


def test_a_pip_index_with_packages_is_scoped_to_them() -> None:
    image = sky.Image(
        pip=["torch", "numpy"],
        pip_indexes=["https://mirror.example/simple", sky.PipIndex(TORCH, packages=["torch"])],
    )
    assert image.pip_indexes == ("https://mirror.example/simple",)
    assert image.pip_index_packages == {TORCH: ("torch",)}
    assert image.build_spec(b"")["pip_index_packages"] == {TORCH: ["torch"]}


def test_a_pip_index_without_packages_is_a_plain_index() -> None:
    assert sky.Image(pip_indexes=[sky.PipIndex(TORCH)]).pip_indexes == (TORCH,)
    assert sky.Image(pip_indexes=sky.PipIndex(TORCH)).pip_indexes == (TORCH,)  # type: ignore[arg-type]


def test_pip_indexes_add_to_pip_index_packages() -> None:
    image = sky.Image(
        pip_indexes=[sky.PipIndex(TORCH, packages=("torchvision",))],
        pip_index_packages={TORCH: ("torch",)},
    )
    assert image.pip_index_packages == {TORCH: ("torch", "torchvision")}


def test_bad_pip_indexes_are_refused() -> None:
    with pytest.raises(sky.ConfigurationError, match="index URL"):
        sky.PipIndex("")
    with pytest.raises(sky.ConfigurationError, match="not a package name"):
        sky.Image(pip_indexes=[sky.PipIndex(TORCH, packages=["to rch"])])
    with pytest.raises(sky.ConfigurationError, match="pip_indexes"):
        sky.Image(pip_indexes=3)  # type: ignore[arg-type]
