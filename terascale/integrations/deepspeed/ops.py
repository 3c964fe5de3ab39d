"""DeepSpeed's optimizer classes (``deepspeed.ops.adam``, ``.lamb``, ``.adagrad``) as
constructors of terascale's and torch's optimizers.

DeepSpeed's ``DeepSpeedCPUAdam`` and ``FusedAdam`` are compiled kernels of Adam/AdamW;
torch's own ``Adam``/``AdamW`` with ``fused=True`` (or ``foreach``) compute the same update,
and terascale's ZeRO and host-offload paths know them (``[Note: optimizers on shards]``,
``terascale/offload/host_adam.py``). So these names build torch's optimizers, with
DeepSpeed's arguments and defaults, through the same factory as the config's
``optimizer`` section; ``FusedLamb`` is :class:`terascale.optim.Lamb`, which has its
signature. Calling one of DeepSpeed's names returns terascale's optimizer; ``isinstance``
against the name answers whether an optimizer runs that algorithm (the ``_Builds``
metaclass). They are not for subclassing: a subclass's instance is the built optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from terascale.optim import Lamb
from terascale.optim.lion import Lion
from terascale.optim.factory import build_optimizer

FusedLamb = Lamb


class _Builds(type):
    """The metaclass of DeepSpeed's optimizer names: calling one builds terascale's (torch's)
    optimizer of that algorithm (``__new__`` returns it); ``isinstance(x, FusedAdam)`` asks
    whether ``x`` runs that algorithm (``__algorithm__``), as DeepSpeed's programs and tests
    check it. The handle ``initialize`` returns is an instance of its optimizer's class
    ([Note: the optimizer initialize returns]), so it answers as that optimizer does."""

    __algorithm__: type

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, cls.__algorithm__)


class FusedAdam(metaclass=_Builds):
    """AdamW (``adam_w_mode``, the default) or Adam with L2 decay; torch's fused kernel
    where every parameter's device has one."""

    __algorithm__ = torch.optim.Adam  # AdamW is one

    def __new__(cls, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> Any:  # fmt: skip
        options = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                   "adam_w_mode": adam_w_mode, "weight_decay": weight_decay, "amsgrad": amsgrad}  # fmt: skip
        return build_optimizer("Adam", options, params)


class DeepSpeedCPUAdam(metaclass=_Builds):
    """DeepSpeed's host Adam: torch's (fused) Adam/AdamW, which terascale's host offload
    steps chunk by chunk. ``fp32_optimizer_states=False`` (states in the parameters' dtype)
    is refused: terascale keeps optimizer state in fp32."""

    __algorithm__ = torch.optim.Adam

    def __new__(cls, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> Any:  # fmt: skip
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False): terascale keeps optimizer state in fp32")
        return FusedAdam(model_params, lr, bias_correction, betas, eps, adamw_mode, weight_decay, amsgrad)


class DeepSpeedCPUAdagrad(metaclass=_Builds):
    """torch's Adagrad (elementwise, so it steps ZeRO shards as it steps whole tensors)."""

    __algorithm__ = torch.optim.Adagrad

    def __new__(cls, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                amsgrad: bool = False, fp32_optimizer_states: bool = True) -> Any:  # fmt: skip
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no AMSGrad variant")
        return torch.optim.Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay, foreach=True)


class DeepSpeedCPULion(metaclass=_Builds):
    """DeepSpeed's host Lion: :class:`Lion` (its defaults are DeepSpeed's)."""

    __algorithm__ = Lion

    def __new__(cls, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                weight_decay: float = 0.0, fp32_optimizer_states: bool = True) -> Any:  # fmt: skip
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPULion(fp32_optimizer_states=False): terascale keeps optimizer state in fp32")
        return Lion(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion(metaclass=_Builds):
    """:class:`Lion`, with DeepSpeed's signature."""

    __algorithm__ = Lion

    def __new__(cls, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                weight_decay: float = 0.0) -> Any:  # fmt: skip
        return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam", "DeepSpeedCPULion", "FusedAdam", "FusedLamb", "FusedLion",
           "Lion"]
