"""Accelerator specs: ``accelerator="A100"``, ``"A100:8"`` or ``accelerators.A100(count=8)``."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import ConfigurationError, check_number

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
        count: accelerators per node: a positive integer, or (Skyward's fractional
            accelerators) a fraction of one, ``0 < count < 1`` (``L4(count=0.5)``: half an
            L4, a slice the provider carves out, never rounded up to a whole one).
        cuda: whether it runs CUDA (selects CUDA wheels and the nccl backend).
    """

    name: str
    count: int | float = 1
    cuda: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigurationError("an accelerator needs a name, e.g. 'A100'")
        count = self.count
        check_number(
            count,
            f"accelerator count must be a positive integer or a fraction of one "
            f"(0 < count < 1), got {count!r}",
            above=0,
        )
        if isinstance(count, float) and count.is_integer() and count >= 1:
            object.__setattr__(self, "count", int(count))
        elif isinstance(count, float) and count > 1:
            raise ConfigurationError(
                f"accelerator count {count!r}: a fractional count is a part of one "
                "accelerator (0 < count < 1, e.g. 0.5); more than one is a whole number"
            )

    @property
    def fractional(self) -> bool:
        """A slice of one accelerator (``count < 1``)."""
        return self.count < 1

    @property
    def whole(self) -> int:
        """Devices a node sees: ``count``, or 1 for a slice (it appears as one device)."""
        return max(1, int(self.count))

    def __str__(self) -> str:
        return f"{self.name}:{self.count:g}"


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
        n: int | float = (int(count) if count.strip().isdigit() else float(count)) if count else 1
    except ValueError:
        raise ConfigurationError(
            f"accelerator {spec!r}: the count after ':' must be a number (8, or 0.5 for half)"
        ) from None
    name = name.strip()
    return Accelerator(name, n, cuda=name.upper() in _CUDA)


def _factory(name: str, cuda: bool = True) -> type:
    def make(count: int | float = 1) -> Accelerator:
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
