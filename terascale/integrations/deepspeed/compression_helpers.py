"""The module-surgery helpers of ``deepspeed.compression.helper``.

Programs that prepare models for compression or distillation use them on their own: get
or replace a submodule by its dotted name, and turn GPT-2 style ``Conv1D`` layers
(``weight`` stored ``[in, out]``) into ``nn.Linear`` (``[out, in]``) computing the same map.
DeepSpeed's compression training itself (``init_compression``, ``redundancy_clean``) is not
built in terascale.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def recursive_getattr(model: nn.Module, module_name: str) -> Any:
    """``model.a.b.c`` for ``module_name="a.b.c"``."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model: nn.Module, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``module_name="a.b.c"``."""
    *parents, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(parents)) if parents else model, last, module)


def convert_conv1d_to_linear(model: nn.Module, convert_type: type) -> nn.Module:
    """Replace every ``convert_type`` (a ``Conv1D`` whose ``weight`` is ``[in, out]``) in
    ``model`` by an ``nn.Linear`` with the transposed weight and the same bias, in place;
    returns ``model``. The outputs are unchanged."""
    names = [name for name, m in model.named_modules() if isinstance(m, convert_type)]
    for name in names:
        old = recursive_getattr(model, name)
        weight = old.weight
        in_features, out_features = weight.shape
        new = nn.Linear(in_features, out_features, bias=old.bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            new.weight.copy_(weight.t())
            if old.bias is not None:
                new.bias.copy_(old.bias)
        new.weight.requires_grad_(weight.requires_grad)
        recursive_setattr(model, name, new)
    return model
