"""The Lion optimizer (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

Elementwise, like Adam, so it steps ZeRO shards as it steps whole tensors, with one state
buffer per parameter instead of Adam's two. DeepSpeed's ``ops.lion`` names build it
(``terascale/integrations/deepspeed/ops.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from terascale.optim.closure import evaluate


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023): ``p -= lr * (sign(b1 * m + (1 - b1) * g) + wd * p)``, then
    ``m = b2 * m + (1 - b2) * g``. Elementwise, so it steps ZeRO shards as it steps whole
    tensors; one state tensor (``exp_avg``) per parameter."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:  # fmt: skip
        if lr < 0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"Lion: betas must lie in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = evaluate(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss
