"""Mixed precision: model parameters in the compute dtype, fp32 masters for the optimizer.

[Note: master weights]
With bf16 or fp16 the user's module runs with its parameters cast to that dtype, and
the optimizer steps fp32 copies ("masters"); after each step the masters are copied back
into the model. With fp32 the masters are the model's own parameters, so no memory is
spent twice. The optimizer the user receives from ``initialize`` steps the masters and
keeps the user's param-group structure (learning rates, weight decay per group).

Buffers are not cast with the parameters: see ``[Note: buffer dtypes]`` in
``terascale/config/precision.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtypes the model computes in and the masters are kept in."""

    compute_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    # None: buffers keep their own dtype ([Note: buffer dtypes]).
    buffer_dtype: torch.dtype | None = None

    @property
    def has_separate_masters(self) -> bool:
        return self.compute_dtype != self.master_dtype


class MasterWeights:
    """fp32 masters of ``params`` (the params themselves when they are already fp32)."""

    def __init__(self, params: Sequence[nn.Parameter], policy: PrecisionPolicy) -> None:
        self.model_params = list(params)
        self.policy = policy
        self.masters: list[torch.Tensor] = [
            p
            if p.dtype == policy.master_dtype
            else nn.Parameter(p.detach().to(policy.master_dtype), requires_grad=True)
            for p in self.model_params
        ]
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.masters)}
        self._copy_pairs = [(p, m) for p, m in zip(self.model_params, self.masters) if p is not m]

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The master tensor stepped for model parameter ``param``."""
        return self._master_of[id(param)]

    def master_param_groups(self, groups: Iterable[Any]) -> list[dict]:
        """Translate user param groups (tensors or dicts of options) onto the masters."""
        groups = list(groups)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        out = []
        for group in groups:
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            out.append({**group, "params": [self.master_of(p) for p in params]})
        return out

    def set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Give each master its (averaged, unscaled-later) gradient, or None."""
        for m, g in zip(self.masters, grads):
            m.grad = None if g is None else (g if g.dtype == m.dtype else g.to(m.dtype))

    def clear_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Write the updated masters into the model's low-precision parameters."""
        if self._copy_pairs:
            torch._foreach_copy_([p for p, _ in self._copy_pairs], [m for _, m in self._copy_pairs])
