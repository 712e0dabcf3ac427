"""Which EC2 instance type, zones and AMI a pool gets.

The smallest type offered in the region that satisfies the request (GPU name and count,
vCPUs, memory), from DescribeInstanceTypes (narrowed server-side by filters: GPU families,
or the few vCPU sizes at or above the request) and DescribeInstanceTypeOfferings (the zones
that offer it). "Smallest" is by GPU count, vCPUs, memory, then name: the API has no
prices, and among equal sizes the name order prefers the older, cheaper families (c5 before
c6i). Only current-generation x86_64 types are chosen (``instance_type=`` takes any); the
AMI comes from AWS's public SSM parameters for that architecture.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from ..._accelerators import Accelerator
from ..._errors import ConfigurationError
from ..base import PoolSpec
from .api import Api, error_code
from .settings import AWSSettings

logger = logging.getLogger("flotilla.aws")

DEFAULT_VCPUS = 2.0
DEFAULT_MEMORY_GB = 4.0
"""What a pool gets when it asks for neither vCPUs nor memory nor a GPU."""
VCPU_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 36, 48, 64, 72, 96, 128, 192, 224, 256, 384, 448)
"""The vCPU counts EC2 types come in; a request is looked up among the next few."""
_LOOKAHEAD = 4

UBUNTU_AMI = "/aws/service/canonical/ubuntu/server/24.04/stable/current/{arch}/hvm/ebs-gp3/ami-id"
GPU_AMI = (
    "/aws/service/deeplearning/ami/{arch}/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
)
"""SSM public parameters: Ubuntu 24.04 (Python 3.12) for CPU types, the Deep Learning Base
AMI (NVIDIA driver, CUDA) on Ubuntu 24.04 for GPU types."""


@dataclass(frozen=True)
class InstanceChoice:
    """The instance type a pool runs on.

    Attributes:
        instance_type: e.g. ``c5.large``.
        vcpus: its vCPUs.
        memory_gb: its memory in GiB.
        gpus: its GPUs (0 when none).
        gpu_name: their model ("" when none).
        arch: ``x86_64`` or ``arm64``.
        spot: whether the type supports spot.
        zones: zones of the region that offer it, in order of preference.
    """

    instance_type: str
    vcpus: int
    memory_gb: float
    gpus: int
    gpu_name: str
    arch: str
    spot: bool
    zones: tuple[str, ...]

    def describe(self) -> str:
        gpu = f", {self.gpus} x {self.gpu_name}" if self.gpus else ""
        return f"{self.instance_type} ({self.vcpus} vCPU, {self.memory_gb:g} GiB{gpu})"


def _fact(t: dict[str, Any]) -> tuple[str, int, float, int, str, str]:
    gpus = t.get("GpuInfo", {}).get("Gpus", [])
    count = sum(int(g.get("Count", 0)) for g in gpus)
    name = gpus[0].get("Name", "") if gpus else ""
    archs = t.get("ProcessorInfo", {}).get("SupportedArchitectures", [])
    arch = "x86_64" if "x86_64" in archs else (archs[0] if archs else "x86_64")
    return (
        t["InstanceType"],
        int(t["VCpuInfo"]["DefaultVCpus"]),
        t["MemoryInfo"]["SizeInMiB"] / 1024,
        count,
        name,
        arch,
    )


def _fits(
    t: dict[str, Any], acc: Accelerator | None, vcpus: float, memory_gb: float, spot: bool
) -> bool:
    _, cpus, mem, gpus, gpu_name, arch = _fact(t)
    if arch != "x86_64" or t.get("BareMetal") or not t.get("CurrentGeneration", True):
        return False
    if spot and "spot" not in t.get("SupportedUsageClasses", ["spot"]):
        return False
    if any(t.get(k) for k in _OTHER_ACCELERATORS):
        return False
    if acc is not None and (gpus < acc.count or gpu_name.upper() != acc.name.upper()):
        return False
    return cpus >= vcpus and mem >= memory_gb


def _efa(t: dict[str, Any]) -> bool:
    return bool(t.get("NetworkInfo", {}).get("EfaSupported"))


def _size_key(t: dict[str, Any]) -> tuple[int, int, float, str]:
    name, cpus, mem, gpus, _, _ = _fact(t)
    return (gpus, cpus, mem, name)


def choose(
    api: Api,
    instance_type: str | None,
    acc: Accelerator | None,
    vcpus: float | None,
    memory_gb: float | None,
    spot: bool,
    zone: str | None,
    efa: bool = False,
) -> InstanceChoice:
    """The instance type for a pool (see the module docstring; ``efa``: one with Elastic
    Fabric Adapter support); ConfigurationError when the region has none that fits, naming
    the request."""
    if instance_type is not None:
        try:
            found = api.raw("ec2", "describe_instance_types", InstanceTypes=[instance_type])
        except Exception as e:
            if error_code(e).startswith("InvalidInstanceType") or error_code(e) == (
                "InvalidParameterValue"
            ):
                raise ConfigurationError(
                    f"AWS(instance_type={instance_type!r}): no such instance type in "
                    f"{api.region} ({error_code(e)}): see "
                    "https://aws.amazon.com/ec2/instance-types/"
                ) from e
            raise
        chosen = found["InstanceTypes"][0]
        _, cpus, mem, gpus, gpu_name, _ = _fact(chosen)
        if acc is not None and (gpus < acc.count or gpu_name.upper() != acc.name.upper()):
            have = f"{gpus} x {gpu_name}" if gpus else "no GPU"
            raise ConfigurationError(
                f"AWS(instance_type={instance_type!r}) has {have} but the pool asks for "
                f"accelerator {acc}: drop one of them or pick a type with that GPU"
            )
        if efa and not _efa(chosen):
            raise ConfigurationError(
                f"AWS(instance_type={instance_type!r}) has no EFA but network_tier='best' "
                "asks for it: pick an EFA-capable type (p4d, p5, c5n...) or drop one of them"
            )
        if (vcpus and cpus < vcpus) or (memory_gb and mem < memory_gb):
            raise ConfigurationError(
                f"AWS(instance_type={instance_type!r}) has {cpus} vCPU and {mem:g} GiB but the "
                f"pool asks for vcpus={vcpus}, memory_gb={memory_gb}: pick a larger type"
            )
        zones = _zones(api, instance_type, zone)
    else:
        chosen, zones = _smallest_offered(
            api, _smallest(api, acc, vcpus, memory_gb, spot, efa), zone
        )
    name, cpus, mem, gpus, gpu_name, arch = _fact(chosen)
    return InstanceChoice(
        name,
        cpus,
        mem,
        gpus,
        gpu_name,
        arch,
        "spot" in chosen.get("SupportedUsageClasses", ["spot"]),
        zones,
    )


def _smallest_offered(
    api: Api, candidates: list[dict[str, Any]], zone: str | None
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The first of ``candidates`` (smallest first) that a zone of the region offers, and
    its zones (a type of the catalog may not be offered in this region: hpc7a, trn2...)."""
    for t in candidates[:-1]:
        try:
            return t, _zones(api, t["InstanceType"], zone)
        except ConfigurationError:
            continue
    return candidates[-1], _zones(api, candidates[-1]["InstanceType"], zone)


def _smallest(
    api: Api,
    acc: Accelerator | None,
    vcpus: float | None,
    memory_gb: float | None,
    spot: bool,
    efa: bool,
) -> list[dict[str, Any]]:
    """The types that fit, smallest first (from the first size batch that has any)."""
    if acc is None and vcpus is None and memory_gb is None:
        vcpus, memory_gb = DEFAULT_VCPUS, DEFAULT_MEMORY_GB
    want_cpus, want_mem = float(vcpus or 0), float(memory_gb or 0)
    base = [{"Name": "processor-info.supported-architecture", "Values": ["x86_64"]}]
    if efa:
        base.append({"Name": "network-info.efa-supported", "Values": ["true"]})
    if acc is not None:
        # every EC2 type with GPUs is a p* or g* type (GPU names cannot be filtered on)
        batches = [[*base, {"Name": "instance-type", "Values": ["p*", "g*"]}]]
    else:
        sizes = [s for s in VCPU_SIZES if s >= want_cpus]
        batches = [
            [*base, {"Name": "vcpu-info.default-vcpus", "Values": [str(s) for s in chunk]}]
            for chunk in (sizes[i : i + _LOOKAHEAD] for i in range(0, len(sizes), _LOOKAHEAD))
        ]
    for filters in batches:
        fitting = [
            t
            for t in _describe_types(api, filters)
            if _fits(t, acc, want_cpus, want_mem, spot) and (_efa(t) or not efa)
        ]
        if fitting:
            return sorted(fitting, key=_size_key)
    what = []
    if acc is not None:
        what.append(f"accelerator {acc}")
    if vcpus:
        what.append(f"vcpus={vcpus:g}")
    if memory_gb:
        what.append(f"memory_gb={memory_gb:g}")
    market = "spot " if spot else ""
    if efa:
        market += "EFA-capable "
    raise ConfigurationError(
        f"no current-generation x86_64 {market}instance type in {api.region} has "
        f"{', '.join(what)}: lower the request, try another region (AWS(region=...)), or "
        "name a type with AWS(instance_type=...)"
    )


CATALOG_TTL = 86400.0
"""Seconds a region's instance type list is reused from the local cache."""
_KEPT = (
    "InstanceType",
    "VCpuInfo",
    "MemoryInfo",
    "GpuInfo",
    "ProcessorInfo",
    "BareMetal",
    "CurrentGeneration",
    "SupportedUsageClasses",
    "NetworkInfo",
    "NeuronInfo",
    "InferenceAcceleratorInfo",
    "FpgaInfo",
)
_OTHER_ACCELERATORS = ("NeuronInfo", "InferenceAcceleratorInfo", "FpgaInfo")
"""Trainium/Inferentia, Elastic Inference and FPGA types: never chosen unasked."""
_catalog: dict[str, list[dict[str, Any]]] = {}


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "flotilla", "aws")


def _describe_types(api: Api, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The instance types ``filters`` select; cached for a day in this process and on
    disk (the catalog changes rarely, and listing it costs seconds)."""
    endpoint = str(api.client("ec2").meta.endpoint_url)
    # the kept fields are in the key: a cache written with fewer fields is not read
    identity = [endpoint, api.region, filters, _KEPT]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]
    if key in _catalog:
        return _catalog[key]
    path = os.path.join(_cache_dir(), f"types-{api.region}-{key}.json")
    try:
        if time.time() - os.stat(path).st_mtime < CATALOG_TTL:
            with open(path) as f:
                types: list[dict[str, Any]] = json.load(f)
            _catalog[key] = types
            return types
    except (OSError, ValueError):
        pass
    types = [{k: t[k] for k in _KEPT if k in t} for t in _list_types(api, filters)]
    _catalog[key] = types
    _store(path, types)
    return types


def _store(path: str, types: list[dict[str, Any]]) -> None:
    """Write the cache file atomically (0600 in a 0700 folder); stale files go."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        for name in os.listdir(folder):
            old = os.path.join(folder, name)
            if time.time() - os.stat(old).st_mtime > CATALOG_TTL:
                os.unlink(old)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".types-")
        with os.fdopen(fd, "w") as f:
            json.dump(types, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("cannot cache the instance types in %s: %s", folder, e)


def _list_types(api: Api, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    token = ""
    while True:
        page = api.call(
            "ec2",
            "describe_instance_types",
            "list instance types",
            Filters=filters,
            MaxResults=100,
            **({"NextToken": token} if token else {}),
        )
        out += page.get("InstanceTypes", [])
        token = page.get("NextToken", "")
        if not token:
            return out


def _zones(api: Api, instance_type: str, zone: str | None) -> tuple[str, ...]:
    offers = api.call(
        "ec2",
        "describe_instance_type_offerings",
        "list the zones that offer the instance type",
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": [instance_type]}],
    )
    zones = sorted({o["Location"] for o in offers.get("InstanceTypeOfferings", [])})
    if zone is not None:
        zones = [z for z in zones if z == zone]
    if not zones:
        where = f"zone {zone}" if zone else f"any zone of {api.region}"
        raise ConfigurationError(
            f"instance type {instance_type} is not offered in {where}: pick another type or region"
        )
    return tuple(zones)


def default_ami(api: Api, choice: InstanceChoice) -> str:
    """The AMI id of AWS's public SSM parameter for ``choice`` (see the module docstring)."""
    arch = "amd64" if choice.arch == "x86_64" else "arm64"
    name = GPU_AMI.format(arch=choice.arch) if choice.gpus else UBUNTU_AMI.format(arch=arch)
    try:
        return str(api.raw("ssm", "get_parameter", Name=name)["Parameter"]["Value"])
    except Exception as e:
        if error_code(e) == "ParameterNotFound":
            raise ConfigurationError(
                f"no default AMI in {api.region}: the public SSM parameter {name} does not "
                "exist there; pass AWS(ami='ami-...')"
            ) from e
        from .api import translate

        raise translate(e, "look up the default AMI") from e


def check_ami(api: Api, ami: str, choice: InstanceChoice) -> dict[str, Any]:
    """The image ``ami``; ConfigurationError when it does not exist or cannot run ``choice``."""
    images = api.call("ec2", "describe_images", f"look up AMI {ami}", ImageIds=[ami])["Images"]
    if not images:
        raise ConfigurationError(
            f"AMI {ami} does not exist in {api.region} (or is not shared with this account): "
            "pass AWS(ami=...) naming an AMI of this region"
        )
    image: dict[str, Any] = images[0]
    arch = image.get("Architecture", choice.arch)
    if arch != choice.arch:
        raise ConfigurationError(
            f"AMI {ami} is for {arch} but {choice.instance_type} is {choice.arch}: pass an "
            f"{choice.arch} AMI or another instance type"
        )
    return image


def choose_for(
    api: Api, settings: AWSSettings, spec: PoolSpec
) -> tuple[InstanceChoice, dict[str, Any]]:
    """The instance choice for a pool of ``spec`` with ``settings`` (see :func:`choose`) and
    its AMI's description (``settings.ami``, or the default for the choice; checked)."""
    choice = choose(
        api,
        settings.instance_type,
        spec.accelerator,
        spec.vcpus,
        spec.memory_gb,
        settings.allocation == "spot",
        None,
        efa=settings.network_tier == "best",
    )
    ami = settings.ami or default_ami(api, choice)
    return choice, check_ami(api, ami, choice)
