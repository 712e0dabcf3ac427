"""Accelerator specs and the catalog: ``accelerator="A100"``, ``"A100:8"``,
``accelerators.A100(count=8, memory="40GB")``, ``accelerators.H100(form_factor="SXM")``.

The catalog (:data:`CATALOG`) is Skyward's (its accelerators/catalog.py and
factories.py): every model with its memory, maker and architecture, its memory variants
and form factors, and the other names it goes by. One factory per model is on
:class:`accelerators` (``RTX_4090``, ``MI300X``, ``TPUv5e``...).

Providers name their GPUs their own way (RunPod ``NVIDIA A100-SXM4-80GB``, Lambda
``gpu_8x_a100_80gb_sxm4``, Vast ``A100 SXM4``, AWS ``A100``, GCP ``nvidia-tesla-a100``):
:func:`identify` reads any of them as (model, memory, form factor), and
:func:`offered_as` says whether a provider's GPU is what an :class:`Accelerator` asks for
(the same model; the memory and form factor too when the accelerator names them). Names no
rule reads are listed in :data:`PROVIDER_NAMES`. An accelerator whose name is in no
catalog entry still works with a provider that offers it under that name;
:func:`unknown_name` is the error when no provider does, with the nearest names.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from ._errors import ConfigurationError, check_number


@dataclass(frozen=True, slots=True)
class Model:
    """One accelerator model of the catalog.

    Attributes:
        name: its name in flotilla (and Skyward), e.g. "A100", "RTX 4090".
        memory_gb: its memory (the default variant's).
        maker: "NVIDIA", "AMD", "Intel", "AWS", "Google".
        architecture: "Ampere", "Hopper", "CDNA3", "TPU"...
        memories: the memory variants sold (GB), when there are several.
        form_factors: the form factors sold ("SXM", "PCIe", "NVL"), when several.
        aliases: other names it goes by ("A6000" for "RTX A6000").
    """

    name: str
    memory_gb: int
    maker: str = "NVIDIA"
    architecture: str = ""
    memories: tuple[int, ...] = ()
    form_factors: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()

    @property
    def cuda(self) -> bool:
        return self.maker == "NVIDIA"

    @property
    def factory(self) -> str:
        """Its factory's name on :class:`accelerators` ("RTX_4090")."""
        return re.sub(r"[^A-Za-z0-9]+", "_", self.name).strip("_")


def _m(
    name: str,
    memory: int,
    arch: str,
    maker: str = "NVIDIA",
    memories: tuple[int, ...] = (),
    forms: tuple[str, ...] = (),
    aliases: tuple[str, ...] = (),
) -> Model:
    return Model(name, memory, maker, arch, memories, forms, aliases)


_MODELS: tuple[Model, ...] = (
    # NVIDIA datacenter
    _m("K80", 12, "Kepler"),
    _m("P4", 8, "Pascal"),
    _m("P40", 24, "Pascal"),
    _m("P100", 16, "Pascal"),
    _m("V100", 32, "Volta", memories=(16, 32), forms=("SXM", "PCIe")),
    _m("T4", 16, "Turing"),
    _m("T4G", 16, "Turing"),
    _m("A2", 16, "Ampere"),
    _m("A10", 24, "Ampere"),
    _m("A10G", 24, "Ampere"),
    _m("A16", 16, "Ampere"),
    _m("A30", 24, "Ampere"),
    _m("A40", 48, "Ampere"),
    _m("A100", 80, "Ampere", memories=(40, 80), forms=("SXM", "PCIe")),
    _m("A100X", 80, "Ampere"),
    _m("A800", 80, "Ampere"),
    _m("L4", 24, "Ada Lovelace"),
    _m("L40", 48, "Ada Lovelace"),
    _m("L40S", 48, "Ada Lovelace"),
    _m("H100", 80, "Hopper", memories=(80, 94), forms=("SXM", "PCIe", "NVL")),
    _m("H200", 141, "Hopper", forms=("SXM", "NVL")),
    _m("GH200", 96, "Hopper"),
    _m("B100", 192, "Blackwell"),
    _m("B200", 192, "Blackwell"),
    _m("B300", 288, "Blackwell"),
    _m("GB200", 384, "Blackwell"),
    _m("GB300", 288, "Blackwell"),
    # NVIDIA consumer
    *(
        _m(f"GTX {n}", mem, "Pascal")
        for n, mem in (
            ("1050", 2),
            ("1050 Ti", 4),
            ("1060", 6),
            ("1070", 8),
            ("1070 Ti", 8),
            ("1080", 8),
            ("1080 Ti", 11),
        )
    ),
    _m("Titan Xp", 12, "Pascal"),
    *(
        _m(f"GTX {n}", mem, "Turing")
        for n, mem in (("1650", 4), ("1660", 6), ("1660 Super", 6), ("1660 Ti", 6))
    ),
    *(
        _m(f"RTX {n}", mem, "Turing")
        for n, mem in (
            ("2060", 6),
            ("2060 Super", 8),
            ("2070", 8),
            ("2070 Super", 8),
            ("2080", 8),
            ("2080 Super", 8),
            ("2080 Ti", 11),
        )
    ),
    _m("Titan RTX", 24, "Turing"),
    *(
        _m(f"RTX {n}", mem, "Ampere")
        for n, mem in (
            ("3050", 8),
            ("3060", 12),
            ("3060 Ti", 8),
            ("3060 Laptop", 6),
            ("3070", 8),
            ("3070 Ti", 8),
            ("3080", 10),
            ("3080 Ti", 12),
            ("3090", 24),
            ("3090 Ti", 24),
        )
    ),
    *(
        _m(f"RTX {n}", mem, "Ada Lovelace")
        for n, mem in (
            ("4060", 8),
            ("4060 Ti", 8),
            ("4070", 12),
            ("4070 Super", 12),
            ("4070 Ti", 12),
            ("4070 Ti Super", 16),
            ("4080", 16),
            ("4080 Super", 16),
            ("4090", 24),
            ("4090D", 24),
        )
    ),
    *(
        _m(f"RTX {n}", mem, "Blackwell")
        for n, mem in (
            ("5060", 8),
            ("5060 Ti", 16),
            ("5070", 12),
            ("5070 Ti", 16),
            ("5080", 16),
            ("5090", 32),
        )
    ),
    _m("CMP 50HX", 10, "Turing"),
    # NVIDIA workstation
    _m("Quadro P2000", 5, "Pascal"),
    _m("Quadro P4000", 8, "Pascal"),
    _m("Titan V", 12, "Volta"),
    _m("Quadro RTX 4000", 8, "Turing"),
    _m("Quadro RTX 5000", 16, "Turing"),
    _m("Quadro RTX 6000", 24, "Turing", aliases=("RTX6000",)),
    _m("Quadro RTX 8000", 48, "Turing"),
    _m("RTX A2000", 12, "Ampere", aliases=("A2000",)),
    _m("RTX A4000", 16, "Ampere", aliases=("A4000",)),
    _m("RTX A4500", 20, "Ampere", aliases=("A4500",)),
    _m("RTX A5000", 24, "Ampere", aliases=("A5000",)),
    _m("RTX A5000 Pro", 24, "Ampere"),
    _m("RTX A6000", 48, "Ampere", aliases=("A6000",)),
    _m("RTX 2000 Ada", 16, "Ada Lovelace"),
    _m("RTX 4000 Ada", 20, "Ada Lovelace"),
    _m("RTX 4500 Ada", 24, "Ada Lovelace"),
    _m("RTX 5000 Ada", 32, "Ada Lovelace"),
    _m("RTX 5880 Ada", 48, "Ada Lovelace"),
    _m("RTX 6000 Ada", 48, "Ada Lovelace"),
    _m("RTX PRO 4000", 24, "Blackwell"),
    _m("RTX PRO 4500", 32, "Blackwell"),
    _m("RTX PRO 5000", 48, "Blackwell"),
    _m("RTX PRO 6000", 96, "Blackwell"),
    # AMD
    _m("MI50", 16, "CDNA", "AMD"),
    _m("MI100", 32, "CDNA", "AMD"),
    _m("MI210", 64, "CDNA2", "AMD"),
    _m("MI250", 128, "CDNA2", "AMD"),
    _m("MI250X", 128, "CDNA2", "AMD"),
    _m("MI300A", 128, "CDNA3", "AMD"),
    _m("MI300B", 192, "CDNA3", "AMD"),
    _m("MI300X", 192, "CDNA3", "AMD"),
    _m("MI325X", 256, "CDNA3", "AMD"),
    _m("Radeon Pro V520", 8, "RDNA", "AMD", aliases=("RadeonPro-V520",)),
    _m("Radeon Pro V710", 16, "RDNA2", "AMD", aliases=("RadeonPro-V710",)),
    _m("Instinct MI25", 16, "GCN", "AMD"),
    # Intel, AWS, Google
    _m("Gaudi", 32, "Gaudi", "Intel"),
    _m("Gaudi2", 96, "Gaudi", "Intel"),
    _m("Gaudi3", 128, "Gaudi", "Intel"),
    _m("Trainium1", 32, "Trainium", "AWS", aliases=("Trainium",)),
    _m("Trainium2", 64, "Trainium", "AWS"),
    _m("Trainium3", 128, "Trainium", "AWS"),
    _m("Inferentia1", 8, "Inferentia", "AWS", aliases=("Inferentia",)),
    _m("Inferentia2", 32, "Inferentia", "AWS"),
    *(
        _m(f"TPU{v}", mem, "TPU", "Google")
        for v, mem in (("v2", 8), ("v3", 16), ("v4", 32), ("v5e", 16), ("v5p", 95), ("v6", 32))
    ),
    _m("TPUv6e", 32, "TPU", "Google"),
)

CATALOG: dict[str, Model] = {m.name: m for m in _MODELS}
"""Every model, by its name."""

PROVIDER_NAMES: dict[str, dict[str, tuple[str, int | None, str | None]]] = {
    "runpod": {
        "NVIDIA H100 80GB HBM3": ("H100", 80, "SXM"),
        "NVIDIA H100 NVL": ("H100", 94, "NVL"),
        "NVIDIA A100 80GB PCIe": ("A100", 80, "PCIe"),
        "NVIDIA A100-SXM4-80GB": ("A100", 80, "SXM"),
        "NVIDIA H200": ("H200", 141, "SXM"),
        "AMD Instinct MI300X OAM": ("MI300X", 192, None),
    },
    "lambda": {
        "gpu_1x_a100": ("A100", 40, "PCIe"),
        "gpu_1x_a100_sxm4": ("A100", 40, "SXM"),
        "gpu_8x_a100": ("A100", 40, "SXM"),
        "gpu_8x_v100": ("V100", 16, "SXM"),
    },
    "gcp": {
        "nvidia-tesla-a100": ("A100", 40, "SXM"),
        "nvidia-a100-80gb": ("A100", 80, "SXM"),
        "nvidia-h100-80gb": ("H100", 80, "SXM"),
        "nvidia-h100-mega-80gb": ("H100", 80, "SXM"),
        "nvidia-h200-141gb": ("H200", 141, "SXM"),
    },
}
"""Provider GPU names :func:`identify` cannot read from the words (a memory or form factor
the name does not say), per provider: name -> (model, memory GB, form factor)."""

_KEYS: dict[str, str] = {}
for _model in _MODELS:
    for _name in (_model.name, *_model.aliases):
        _KEYS[re.sub(r"[^A-Z0-9]", "", _name.upper())] = _model.name
_NOISE = re.compile(r"\b(nvidia|geforce|tesla|amd|instinct|generation|gpu|hbm3e?|\d+x)\b")
_FORMS = {"sxm": "SXM", "pcie": "PCIe", "nvl": "NVL", "oam": "OAM"}


def _key(text: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", text.upper())


def lookup(name: str) -> Model | None:
    """The catalog's model called ``name`` (any spelling: "rtx-4090", "A6000"), or None."""
    found = _KEYS.get(_key(name))
    return CATALOG[found] if found else None


def identify(text: str, provider: str = "") -> tuple[Model | None, int | None, str | None]:
    """(model, memory GB, form factor) of a provider's GPU name (see the module docstring);
    a model None when the catalog has none of that name, a memory or form factor None when
    the name does not say."""
    known = PROVIDER_NAMES.get(provider, {}).get(text)
    if known is not None:
        return CATALOG[known[0]], known[1], known[2]
    words = text.lower().replace("_", " ").replace("-", " ")
    memory = re.search(r"\b(\d+)\s*gb?\b", words)
    words = re.sub(r"\b\d+\s*gb?\b", " ", words)
    form = None
    for word, name in _FORMS.items():
        if re.search(rf"\b{word}\d*\b", words):
            form = name
            words = re.sub(rf"\b{word}\d*\b", " ", words)
    if re.search(r"\bmega\b", words):
        form, words = "SXM", words.replace("mega", " ")
    words = _NOISE.sub(" ", words)
    return lookup(words), int(memory[1]) if memory else None, form


@dataclass(frozen=True, slots=True)
class Accelerator:
    """An accelerator type and how many a node has.

    Attributes:
        name: the type, e.g. "A100" or "MI300X" (a catalog name or any provider's own).
        count: accelerators per node: a positive integer, or (Skyward's fractional
            accelerators) a fraction of one, ``0 < count < 1`` (``L4(count=0.5)``: half an
            L4, a slice the provider carves out, never rounded up to a whole one).
        cuda: whether it runs CUDA (selects CUDA wheels and the nccl backend).
        memory: the memory variant asked for ("40GB"; "": any).
        form_factor: the form factor asked for ("SXM", "PCIe", "NVL"; None: any).
    """

    name: str
    count: int | float = 1
    cuda: bool = True
    memory: str = ""
    form_factor: str | None = None

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
        if self.memory and not re.fullmatch(r"\d+GB", self.memory):
            raise ConfigurationError(
                f"accelerator {self.name}: memory={self.memory!r}: a size such as '40GB'"
            )

    @property
    def fractional(self) -> bool:
        """A slice of one accelerator (``count < 1``)."""
        return self.count < 1

    @property
    def whole(self) -> int:
        """Devices a node sees: ``count``, or 1 for a slice (it appears as one device)."""
        return max(1, int(self.count))

    @property
    def model(self) -> Model | None:
        """Its catalog entry (None: a name the catalog does not know)."""
        return lookup(self.name)

    @property
    def memory_gb(self) -> int | None:
        return int(self.memory[:-2]) if self.memory else None

    def __str__(self) -> str:
        variant = "".join(f"-{v}" for v in (self.memory, self.form_factor) if v)
        return f"{self.name}{variant}:{self.count:g}"


def offered_as(acc: Accelerator, gpu_name: str, provider: str = "") -> bool:
    """Whether ``provider``'s GPU called ``gpu_name`` is what ``acc`` asks for: the same
    catalog model (or, for a name the catalog does not know, the same name), and the
    memory and form factor ``acc`` names, where the provider's name says them."""
    model, memory, form = identify(gpu_name, provider)
    wanted = acc.model
    if wanted is None:
        return _key(acc.name) == _key(gpu_name)
    if model is None or model.name != wanted.name:
        return False
    if acc.memory_gb is not None and (memory or model.memory_gb) != acc.memory_gb:
        return False
    return acc.form_factor is None or (form or "").upper() == acc.form_factor.upper()


def unknown_name(name: str, where: str, offered: dict[str, list[str]] | None = None) -> str:
    """The message for an accelerator ``name`` nothing offers in ``where``: the nearest
    catalog names, and what each provider of ``offered`` (provider -> its GPU names)
    offers of them."""
    names = sorted({*CATALOG, *(a for m in _MODELS for a in m.aliases)})
    near = difflib.get_close_matches(name, names, n=5, cutoff=0.5) or difflib.get_close_matches(
        name.upper(), [n.upper() for n in names], n=5, cutoff=0.4
    )
    known = lookup(name)
    text = f"no {where} offer is accelerator {name!r}"
    if known is None:
        text += " (not a name flotilla's catalog knows"
        text += f"; nearest: {', '.join(near)})" if near else ")"
    for provider, gpus in (offered or {}).items():
        text += f"; {provider} offers {', '.join(sorted(set(gpus))[:12]) or 'nothing now'}"
    return text


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
    model = lookup(name)
    cuda = model.cuda if model is not None else name.upper() in _CUDA
    return Accelerator(name, n, cuda=cuda)


_CUDA = {"A10G", "RTX4090", "RTX3090"}
"""Names outside the catalog's spelling that run CUDA."""


def _factory(model: Model) -> type:
    def make(
        count: int | float = 1, *, memory: str = "", form_factor: str | None = None
    ) -> Accelerator:
        if memory and model.memories and int(memory.rstrip("GgBb") or 0) not in model.memories:
            raise ConfigurationError(
                f"{model.factory}(memory={memory!r}): the {model.name} comes with "
                f"{', '.join(f'{m}GB' for m in model.memories)}"
            )
        if form_factor and form_factor.upper() not in {f.upper() for f in model.form_factors}:
            forms = ", ".join(model.form_factors) or "one form factor only"
            raise ConfigurationError(
                f"{model.factory}(form_factor={form_factor!r}): the {model.name} comes as {forms}"
            )
        form = next(
            (f for f in model.form_factors if f.upper() == (form_factor or "").upper()), None
        )
        return Accelerator(model.name, count, model.cuda, memory.upper(), form)

    make.__name__ = make.__qualname__ = model.factory
    variants = ""
    if model.memories:
        variants += f"; ``memory``: {', '.join(f'{m}GB' for m in model.memories)}"
    if model.form_factors:
        variants += f"; ``form_factor``: {', '.join(model.form_factors)}"
    make.__doc__ = (
        f"The {model.maker} {model.name} ({model.memory_gb} GB, {model.architecture}), "
        f"``count`` per node{variants}."
    )
    return make  # type: ignore[return-value]


class accelerators:
    """Constructors for every model of the catalog: ``accelerators.A100(count=8)``,
    ``accelerators.A100(memory="40GB")``, ``accelerators.H100(form_factor="SXM")``,
    accelerators.RTX_4090() and accelerators.MI300X() alike; ``accelerators.Custom(name)``
    for any other."""

    @staticmethod
    def Custom(name: str, count: int | float = 1, *, cuda: bool = True) -> Accelerator:
        """An accelerator the catalog does not list, under a provider's own name."""
        return Accelerator(name, count, cuda)


for _model in _MODELS:
    setattr(accelerators, _model.factory, staticmethod(_factory(_model)))
