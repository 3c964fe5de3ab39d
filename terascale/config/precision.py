"""The precision sections: ``fp16``, ``bf16`` (alias ``bfloat16``) and ``data_types``, and
:func:`cast_module`, which casts a model as they say (``prepare_model`` and the planner's
profile call it; it lives here, below both).

[Note: param_dtype names the mode]
``data_types.param_dtype`` does not choose the parameters' dtype: ``fp16.enabled`` or
``bf16.enabled`` does (fp32 when neither), and the loss scaling, the fp32 masters and the
gradient reduction follow those flags. So, as in DeepSpeed, a ``param_dtype`` that names
another dtype is an error rather than a second way to say it; one that agrees is accepted
and changes nothing. It is checked at ``initialize`` (``Config.require_agreeing_precision``),
on the resolved config, not at load: an integration may give the flags after loading
(Lightning's ``precision``). ``data_types.buffer_dtype`` is the key that acts:

[Note: buffer dtypes]
Only parameters are cast to the compute dtype. Buffers keep the dtype the model was built or
loaded with (a rotary ``inv_freq`` an fp32 model computes positions from stays fp32 under
bf16: cast to bf16 its angles drift by whole radians at long positions), as DeepSpeed's
engine keeps them; the model's own forward casts what it mixes (Hugging Face models do).
``data_types.buffer_dtype`` casts every floating buffer to the dtype it names instead (the
blanket cast of older DeepSpeed releases), in every mode, fp32 included (DeepSpeed reads it
under fp16/bf16 only; here a key that is set is acted on). ``data_types.param_dtype`` changes
nothing: it must name the dtype fp16/bf16 choose (above).
The rule is applied once, by :func:`cast_module` in ``prepare_model`` (and in the planner's
profile, which runs a forward before that). ``zero.Init`` and the ZeRO stages hold
parameters only, so nothing casts buffers again; checkpoints and the 16-bit export
(``terascale/engine/export.py``) keep each buffer in its dtype, while ``full_state_dict``
gives every tensor in fp32, as it says.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn

from terascale.config.section import DtypeName, Section, normalize_dtype_name

BOTH_PRECISIONS = "fp16.enabled and bf16.enabled are both true; enable at most one of them"


def both_precisions_raw(data: dict[str, Any]) -> bool:
    """Whether the raw config ``data`` enables fp16 and bf16 together."""

    def enabled(section: Any) -> bool:
        return isinstance(section, dict) and section.get("enabled") is True

    bf16 = data.get("bf16", data.get("bfloat16"))
    return enabled(data.get("fp16")) and enabled(bf16)


class Fp16Config(Section):
    """``fp16``: fp16 mixed precision with static (``loss_scale`` > 0) or dynamic loss scaling."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0.0, ge=0.0)
    initial_scale_power: int = Field(16, ge=0)
    # Read by dynamic loss scaling only, so checked only where it runs (below): configs with
    # a static scale or fp16 off carry any value, as DeepSpeed accepts. A bool is no number.
    loss_scale_window: int = 1000
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    fp16_master_weights_and_grads: bool = False
    # Older DeepSpeed configs carry this; it selected a fused optimizer wrapper and has no
    # effect on the arithmetic, so it is accepted and not acted on.
    fused_mode: bool = True

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value}")
        return value

    @model_validator(mode="after")
    def _dynamic_scaling_needs_positive_settings(self) -> Fp16Config:
        if self.enabled and self.dynamic_loss_scale:
            for key in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, key) <= 0:
                    raise ValueError(f"{key} must be positive with dynamic loss scaling, got {getattr(self, key)}")
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the loss scale adapts to overflows (``loss_scale`` is 0)."""
        return self.loss_scale == 0.0

    @property
    def initial_dynamic_scale(self) -> float:
        """The first loss scale of dynamic scaling: 2 ** ``initial_scale_power``."""
        return float(2**self.initial_scale_power)


class Bf16Config(Section):
    """``bf16`` (alias ``bfloat16``): bf16 mixed precision, no loss scaling.
    ``check_grad_overflow``: skip a step whose gradients are not all finite, as fp16 does
    (counted in ``skipped_steps``); off by default, as in DeepSpeed.
    ``bf16_master_weights_and_grads`` keeps ZeRO's master weights (and gradients) in bf16,
    ``bf16_optimizer_states`` Adam's moments too; ``stochastic_rounding`` (terascale's key,
    default on) narrows into them stochastically ([Note: bf16 masters and optimizer states])."""

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = False
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False
    stochastic_rounding: bool = True

    @property
    def masters_in_bf16(self) -> bool:
        """Whether the ZeRO masters are bf16 (the key applies with bf16 enabled only)."""
        return self.enabled and self.bf16_master_weights_and_grads

    @property
    def states_in_bf16(self) -> bool:
        """Whether Adam's moments are bf16 too (they need bf16 masters, as in DeepSpeed)."""
        return self.masters_in_bf16 and self.bf16_optimizer_states


class TorchAutocastConfig(Section):
    """``torch_autocast`` (DeepSpeed's section): the forward (and its recompute) runs under
    ``torch.autocast`` in ``dtype`` (None: torch's default for the device, bf16 on the host
    and fp16 on CUDA) while parameters, gradients and masters keep the dtype the other
    sections give them (fp32 unless bf16/fp16 is on). fp16 brings dynamic loss scaling, as
    the ``fp16`` section's. The gradients of the parameters of ``lower_precision_safe_modules``
    (class paths, default torch's Linear and Conv1d/2d/3d) are reduced over the ranks in
    ``dtype``, the others in their own."""

    enabled: bool = False
    dtype: DtypeName | None = None
    lower_precision_safe_modules: list[str] | None = None

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        name = normalize_dtype_name(value)
        if name == "fp32":
            raise ValueError("torch_autocast.dtype is the lower precision to compute in: 'bfloat16' or 'float16'")
        return name


class DataTypesConfig(Section):
    """``data_types``: dtypes of what the engine keeps (None = DeepSpeed's default):
    gradient accumulation (the compute dtype), floating buffers (each its own dtype), and
    ``param_dtype``, which must agree with fp16/bf16 ([Note: param_dtype names the mode])."""

    grad_accum_dtype: DtypeName | None = None
    param_dtype: DtypeName | None = None
    buffer_dtype: DtypeName | None = None

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return normalize_dtype_name(value)


def param_dtype_conflict(param_dtype: DtypeName | None, fp16: bool, bf16: bool) -> str | None:
    """Why ``data_types.param_dtype`` disagrees with the enabled mode, or None when it
    agrees or is unset ([Note: param_dtype names the mode])."""
    if param_dtype is None:
        return None
    mode: DtypeName = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    if param_dtype == mode:
        return None
    enabled = f"{mode}.enabled is true" if mode != "fp32" else "neither fp16.enabled nor bf16.enabled is true"
    if param_dtype == "fp32":
        fix = f"turn {mode} off"
    elif mode == "fp32":
        fix = f"set {param_dtype}.enabled: true"
    else:
        fix = f"enable {param_dtype} instead of {mode}"
    return (
        f"data_types.param_dtype is '{param_dtype}' but {enabled}, so parameters train in {mode}: "
        f"{fix}, or write '{mode}' or nothing for data_types.param_dtype (the fp16/bf16 flags choose the dtype)"
    )


@torch.no_grad()
def cast_module(
    module: nn.Module,
    param_dtype: torch.dtype,
    buffer_dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> None:
    """Cast ``module``'s floating parameters to ``param_dtype`` and, when ``buffer_dtype`` is
    given, its floating buffers to that (other buffers keep their dtype: [Note: buffer
    dtypes]), then move it to ``device`` when given. In place: each tensor stays the
    module's object."""
    # Cast where the tensors are, then move: the device never holds an fp32 copy of a
    # model that trains in 16 bits.
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != param_dtype:
            p.data = p.data.to(param_dtype)
    if buffer_dtype is not None:
        for b in module.buffers():
            if b.is_floating_point() and b.dtype != buffer_dtype:
                b.data = b.data.to(buffer_dtype)
    if device is not None:
        module.to(device=device)
