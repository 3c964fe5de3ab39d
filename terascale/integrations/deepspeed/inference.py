"""``deepspeed.init_inference``: a model ready to run forward and ``generate``.

DeepSpeed's inference engine puts a model on the device in the requested dtype, shards
it over a tensor-parallel group (AutoTP) and, with ``replace_with_kernel_inject``, swaps
its layers for fused CUDA kernels. Here:

- dtype and device: the model is cast to ``dtype`` and moved to the accelerator's current
  device (unless ``keep_module_on_host``);
- ``tensor_parallel.tp_size`` (or the older ``mp_size``) > 1: the model is sharded over the
  tensor-parallel group (``tensor_parallel.tp_group``, or all ranks) with terascale's AutoTP
  (:func:`terascale.parallel.tensor.auto_tp.auto_tp`: GPT-2 and Llama-family models);
- ``replace_with_kernel_inject``: terascale has no fused inference kernels, so the model's
  own layers run; the outputs are what the kernels compute up to rounding, only slower.
  This is said once in the log.

What needs DeepSpeed's kernels or checkpoint formats (``checkpoint`` in DeepSpeed's
sharded inference layout, ``quant``, ``enable_cuda_graph`` with injected kernels, MoE
inference) is refused with a ValueError naming the key.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

logger = logging.getLogger("terascale")

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "int8": torch.int8}  # fmt: skip


class DeepSpeedTPConfig(BaseModel):
    """``tensor_parallel``: the tensor-parallel size and group of an inference model."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, populate_by_name=True)
    enabled: bool = True
    tp_size: int = Field(1, ge=1)
    tp_grain_size: int = Field(1, ge=1)
    mpu: Any = None
    tp_group: Any = None


class DeepSpeedInferenceConfig(BaseModel):
    """The keys of ``init_inference``'s config (DeepSpeed's names and defaults)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, populate_by_name=True)
    replace_with_kernel_inject: bool = Field(False, validation_alias=AliasChoices("replace_with_kernel_inject",
                                                                                  "kernel_inject"))
    dtype: torch.dtype = torch.float16
    tensor_parallel: DeepSpeedTPConfig = Field(default_factory=DeepSpeedTPConfig,
                                               validation_alias=AliasChoices("tensor_parallel", "tp"))
    enable_cuda_graph: bool = False
    use_triton: bool = False
    triangular_masking: bool = Field(True, validation_alias=AliasChoices("triangular_masking", "tm"))
    return_tuple: bool = True
    training_mp_size: int = 1
    replace_method: str = "auto"
    injection_policy: dict | None = Field(None, validation_alias=AliasChoices("injection_policy", "injection_dict"))
    injection_policy_tuple: tuple | None = None
    config: dict | None = Field(None, validation_alias=AliasChoices("config", "args"))
    max_out_tokens: int = Field(1024, validation_alias=AliasChoices("max_out_tokens", "max_tokens"))
    min_out_tokens: int = Field(1, validation_alias=AliasChoices("min_out_tokens", "min_tokens"))
    transposed_mode: bool = False
    mp_size: int | None = Field(None, ge=1)
    checkpoint: Any = None
    base_dir: str = ""
    save_mp_checkpoint_path: str | None = None
    set_empty_params: bool = False
    keep_module_on_host: bool = False
    quant: dict | None = None
    moe: Any = None
    zero: dict | None = None

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
            return _DTYPES[value.lower().removeprefix("torch.")]
        raise ValueError(f"dtype {value!r}: expected a torch dtype or one of {sorted(_DTYPES)}")


def _refuse_unbuilt(config: DeepSpeedInferenceConfig) -> None:
    reasons = {
        "checkpoint": "DeepSpeed's sharded inference checkpoints are not read; load the weights into the model "
                      "(from_pretrained / load_state_dict) before init_inference",
        "quant": "quantized inference kernels are not built",
        "moe": "MoE inference kernels are not built",
        "save_mp_checkpoint_path": "DeepSpeed's sharded inference checkpoints are not written",
        "use_triton": "Triton inference kernels are not built",
    }
    for key, reason in reasons.items():
        value = getattr(config, key)
        if value not in (None, False, {}) and not (key in ("moe", "quant") and not _moe_enabled(value)):
            raise ValueError(f"init_inference: {key}={value!r}: {reason}")
    if config.dtype == torch.int8:
        raise ValueError("init_inference: dtype int8: quantized inference kernels are not built")


def _moe_enabled(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, dict):
        return bool(value.get("enabled", True))
    return bool(getattr(value, "enabled", True))


class InferenceEngine(torch.nn.Module):
    """The model prepared for inference (see the module docstring); calls go to ``module``."""

    def __init__(self, model: torch.nn.Module, config: DeepSpeedInferenceConfig) -> None:
        super().__init__()
        from terascale.integrations.deepspeed.accelerator import get_accelerator

        _refuse_unbuilt(config)
        self._config = config
        self.module = model
        tp = config.tensor_parallel.tp_size if config.mp_size is None else config.mp_size
        self.mp_world_size = tp
        self.mpu = config.tensor_parallel.mpu
        if config.replace_with_kernel_inject:
            logger.info("init_inference: replace_with_kernel_inject: terascale has no fused inference kernels; "
                        "the model's own layers run (same outputs up to rounding)")  # fmt: skip
        if tp > 1 and config.tensor_parallel.enabled:
            self._shard(tp)
        if config.dtype.is_floating_point:
            self.module.to(config.dtype)
        if not config.keep_module_on_host:
            self.module.to(get_accelerator().current_device_name())
        self.module.eval()

    def _shard(self, tp: int) -> None:
        from terascale.parallel.tensor.auto_tp import auto_tp

        group = self._config.tensor_parallel.tp_group
        if group is None and self.mpu is not None:
            group = self.mpu.get_tensor_model_parallel_group()
        if group is None:
            if not dist.is_initialized():
                raise ValueError(f"init_inference: tensor_parallel.tp_size={tp} needs torch.distributed initialized "
                                 "(deepspeed.init_distributed()) or a tp_group")  # fmt: skip
            if dist.get_world_size() != tp:
                raise ValueError(f"init_inference: tp_size={tp} but the world has {dist.get_world_size()} ranks; "
                                 "pass tensor_parallel.tp_group for a subgroup")  # fmt: skip
            group = dist.group.WORLD
        if dist.get_world_size(group) != tp:
            raise ValueError(f"init_inference: tp_size={tp} but tp_group has {dist.get_world_size(group)} ranks")
        auto_tp(self.module, group)
        self.mp_group = group

    @property
    def config(self) -> DeepSpeedInferenceConfig:
        return self._config

    @property
    def dtype(self) -> torch.dtype:
        return self._config.dtype

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        if not hasattr(self.module, "generate"):
            raise ValueError(f"{type(self.module).__name__} has no generate()")
        return self.module.generate(*inputs, **kwargs)


def init_inference(model: torch.nn.Module, config: dict | str | DeepSpeedInferenceConfig | None = None,
                   **kwargs: Any) -> InferenceEngine:  # fmt: skip
    """DeepSpeed's ``init_inference(model, config=None, **kwargs)``: the config as a dict, a
    JSON file or keyword arguments (both: keys must agree)."""
    if isinstance(config, str):
        import json

        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if isinstance(config, DeepSpeedInferenceConfig):
        if kwargs:
            raise ValueError("init_inference: give a DeepSpeedInferenceConfig or keyword arguments, not both")
        return InferenceEngine(model, config)
    merged = dict(config or {})
    for key, value in kwargs.items():
        if key in merged and merged[key] != value:
            raise ValueError(f"init_inference: {key!r} is {merged[key]!r} in the config and {value!r} as an argument")
        merged[key] = value
    return InferenceEngine(model, DeepSpeedInferenceConfig(**merged))
