"""Hugging Face Accelerate: its launch environment in every process, the group formed once.

Not ``accelerate launch``: that wrapper spawns the training processes itself and exits with
them, the opposite of an executor that lives for many tasks. The plugin does what the
launcher would have done: the torch plugin's ranks and process group (one process per
accelerator by default, ``num_processes`` across the cluster), plus the ``ACCELERATE_*`` /
``FSDP_*`` variables that ``accelerate``'s config would give, set before any task can touch
``PartialState`` (its first use freezes the distributed type).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._errors import ConfigurationError
from .._info import InstanceInfo
from ._env import environ, unless_set
from ._extend import extend
from ._torch import TorchPlugin

_FSDP = {
    "sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "backward_prefetch": "FSDP_BACKWARD_PREFETCH",
    "state_dict_type": "FSDP_STATE_DICT_TYPE",
    "offload_params": "FSDP_OFFLOAD_PARAMS",
    "sync_module_states": "FSDP_SYNC_MODULE_STATES",
    "use_orig_params": "FSDP_USE_ORIG_PARAMS",
    "cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "forward_prefetch": "FSDP_FORWARD_PREFETCH",
    "activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "min_num_params": "FSDP_MIN_NUM_PARAMS",
}
_DEEPSPEED = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
}
_KNOWN = {"fsdp", "deepspeed", "mixed_precision"}


def accelerate_env(config: Mapping[str, Any]) -> dict[str, str]:
    """The variables ``accelerate`` reads, from a config shaped like ``accelerate config``'s
    YAML (``fsdp: {...}``, ``deepspeed: {...}``, ``mixed_precision``)."""
    unknown = sorted(set(config) - _KNOWN)
    if unknown:
        raise ConfigurationError(
            f"accelerate config: unknown key(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(_KNOWN))} (topology comes from the pool, not the config)"
        )
    env: dict[str, str] = {}
    for section, flag, names in (
        ("fsdp", "ACCELERATE_USE_FSDP", _FSDP),
        ("deepspeed", "ACCELERATE_USE_DEEPSPEED", _DEEPSPEED),
    ):
        values = config.get(section)
        if values is None:
            continue
        if not isinstance(values, Mapping):
            raise ConfigurationError(f"accelerate config: {section} must be a mapping")
        env[flag] = "true"
        for key, value in values.items():
            env[names.get(key) or str(key).upper()] = _text(value)
    if config.get("mixed_precision"):
        env["ACCELERATE_MIXED_PRECISION"] = str(config["mixed_precision"])
    return env


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class AcceleratePlugin(TorchPlugin):
    """See :func:`flotilla.plugins.accelerate`."""

    config: Mapping[str, Any] = field(default_factory=dict, hash=False)

    name = "accelerate"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.config, Mapping):
            raise ConfigurationError(
                f"accelerate config must be a mapping, got {type(self.config).__name__}"
            )
        accelerate_env(self.config)  # a bad config is an error now, not on the nodes

    def transform(self, image: Any, cluster: Any) -> Any:
        """torch (as the torch plugin adds it) and accelerate."""
        return extend(super().transform(image, cluster), pip=["accelerate"])

    def around_process(self, info: InstanceInfo) -> AbstractContextManager[None] | None:
        return self._launched(info)

    @contextmanager
    def _launched(self, info: InstanceInfo) -> Iterator[None]:
        import torch

        env = accelerate_env(self.config)
        if not torch.cuda.is_available():  # as `accelerate launch` on a machine without GPUs
            env.update(unless_set({"ACCELERATE_USE_CPU": "true"}))
        with ExitStack() as stack:
            stack.enter_context(environ(env))
            group = super().around_process(info)  # the ranks and the process group
            if group is not None:
                stack.enter_context(group)
            yield
