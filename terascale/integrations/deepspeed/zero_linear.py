"""DeepSpeed's ``deepspeed.runtime.zero.linear``: the linear layer DeepSpeed swaps in under
ZeRO-3 (``zero_optimization.memory_efficient_linear``), for programs that name it.

DeepSpeed needs its own linear because its ZeRO-3 frees a gathered weight only if autograd
holds no reference to it: the layer's backward saves the weight's *partitioned* handle and
re-gathers it. terascale's ZeRO-3 re-gathers every group for backward whatever autograd
saved ([Note: sharded gradients], the gather schedule), so here the layer is
``torch.nn.functional.linear`` itself: the same numbers, the same autocast rules (the
output is in the autocast dtype inside ``torch.autocast``, in the weight's dtype outside)
and ``torch.func`` transforms work through it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from terascale.integrations.deepspeed.accelerator import get_accelerator

# DeepSpeed exposes torch.amp's decorators bound to its accelerator's device type.
autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=get_accelerator().device_name())
autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=get_accelerator().device_name())


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``input @ weight.T + bias`` (DeepSpeed's ZeRO-3 linear; see the module docstring)."""
    return F.linear(input, weight, bias)


class LinearModuleForZeroStage3(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`zero3_linear_wrap` (DeepSpeed's class name)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return zero3_linear_wrap(input, self.weight, self.bias)
