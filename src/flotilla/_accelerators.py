"""Accelerator specs: ``accelerator="A100"``, ``"A100:8"`` or ``accelerators.A100(count=8)``."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import ConfigurationError

_CUDA = {
    "A100",
    "A10",
    "A10G",
    "A40",
    "H100",
    "H200",
    "L4",
    "L40S",
    "T4",
    "V100",
    "RTX4090",
    "RTX3090",
    "B200",
    "GH200",
    "P100",
    "K80",
}


@dataclass(frozen=True, slots=True)
class Accelerator:
    """An accelerator type and how many a node has.

    Attributes:
        name: the type, e.g. "A100" or "MI300X".
        count: accelerators per node.
        cuda: whether it runs CUDA (selects CUDA wheels and the nccl backend).
    """

    name: str
    count: int = 1
    cuda: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigurationError("an accelerator needs a name, e.g. 'A100'")
        if not isinstance(self.count, int) or self.count < 1:
            raise ConfigurationError(
                f"accelerator count must be a positive integer, got {self.count!r}"
            )

    def __str__(self) -> str:
        return f"{self.name}:{self.count}"


def parse_accelerator(spec: str | Accelerator | None) -> Accelerator | None:
    """``"A100:8"`` -> Accelerator("A100", 8); None stays None."""
    if spec is None or isinstance(spec, Accelerator):
        return spec
    if not isinstance(spec, str):
        raise ConfigurationError(
            f"accelerator must be a string like 'A100:8' or an Accelerator, got {spec!r}"
        )
    name, _, count = spec.partition(":")
    try:
        n = int(count) if count else 1
    except ValueError:
        raise ConfigurationError(
            f"accelerator {spec!r}: the count after ':' must be an integer"
        ) from None
    name = name.strip()
    return Accelerator(name, n, cuda=name.upper() in _CUDA)


def _factory(name: str, cuda: bool = True) -> type:
    def make(count: int = 1) -> Accelerator:
        return Accelerator(name, count, cuda)

    make.__name__ = make.__qualname__ = name
    make.__doc__ = f"The {name} accelerator, ``count`` per node."
    return make  # type: ignore[return-value]


class accelerators:
    """Constructors for common accelerators: ``accelerators.A100(count=8)``."""

    A100 = staticmethod(_factory("A100"))
    H100 = staticmethod(_factory("H100"))
    H200 = staticmethod(_factory("H200"))
    L4 = staticmethod(_factory("L4"))
    L40S = staticmethod(_factory("L40S"))
    T4 = staticmethod(_factory("T4"))
    V100 = staticmethod(_factory("V100"))
    A10G = staticmethod(_factory("A10G"))
    B200 = staticmethod(_factory("B200"))
    MI300X = staticmethod(_factory("MI300X", cuda=False))
