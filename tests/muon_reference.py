"""Muon written from the published algorithm (Jordan et al., 2024), the tests' reference.

Plain PyTorch on whole tensors, by parameter name: momentum as DeepSpeed keeps it (an
average, ``m ← βm + (1-β)g``), Nesterov's direction ``(1-β)g + βm``, five quintic
Newton–Schulz iterations on the short side first, the update scaled by
``√max(1, rows/cols)``, decoupled weight decay; AdamW (bias-corrected, betas (0.9, 0.95),
eps 1e-10 by default) for the parameters of fewer than two dimensions and those named ``embed`` or
``lm_head`` (DeepSpeed's rule). Nothing of terascale's is used. And the config the Muon
tests train terascale with, at those settings.
"""

from __future__ import annotations

import torch
from torch import nn

LR, ADAM_LR, WD, MOMENTUM = 0.02, 3e-3, 0.01, 0.9


def orthogonal(g: torch.Tensor) -> torch.Tensor:
    """Five quintic Newton–Schulz iterations (Jordan et al.), on the short side first."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if g.shape[0] > g.shape[1] else x


class ReferenceMuon:
    """Muon (``lr``, ``momentum``) and AdamW (``adam_lr``, ``eps``) over ``model``'s
    parameters, both with decoupled weight decay ``wd``."""

    def __init__(self, model: nn.Module, lr: float, adam_lr: float, wd: float, momentum: float,
                 eps: float = 1e-10) -> None:  # fmt: skip
        self.model, self.lr, self.adam_lr, self.wd, self.momentum, self.eps = model, lr, adam_lr, wd, momentum, eps
        self.state: dict[str, dict] = {n: {} for n, _ in model.named_parameters()}

    @torch.no_grad()
    def step(self) -> None:
        beta = self.momentum
        for name, p in self.model.named_parameters():
            g, st = p.grad, self.state[name]
            if p.ndim >= 2 and "embed" not in name and "lm_head" not in name:
                m = st.setdefault("m", torch.zeros_like(p))
                m.mul_(beta).add_(g, alpha=1 - beta)
                u = ((1 - beta) * g + beta * m).reshape(p.shape[0], -1)
                o = orthogonal(u) * max(1.0, u.shape[0] / u.shape[1]) ** 0.5
                p.mul_(1 - self.lr * self.wd).sub_(self.lr * o.reshape(p.shape))
            else:
                t = st["t"] = st.get("t", 0) + 1
                m = st.setdefault("m", torch.zeros_like(p))
                v = st.setdefault("v", torch.zeros_like(p))
                m.mul_(0.9).add_(g, alpha=0.1)
                v.mul_(0.95).add_(g * g, alpha=0.05)
                update = (m / (1 - 0.9**t)) / ((v / (1 - 0.95**t)).sqrt() + self.eps)
                p.mul_(1 - self.adam_lr * self.wd).sub_(self.adam_lr * update)


def muon_config(batch: int, micro: int, stage: int, extra: dict, sub_group_size: int = 100) -> dict:
    """terascale's config for Muon at :data:`LR` (AdamW at :data:`ADAM_LR`) and ZeRO
    ``stage``, with small pieces (matrices in parts on several ranks) and ``extra`` in
    ``zero_optimization`` (``"ns"`` there: the ``ns_method``)."""
    extra = dict(extra)
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "Muon", "params": {"lr": LR, "adam_lr": ADAM_LR, "weight_decay": WD,
                                                  "momentum": MOMENTUM, "ns_method": extra.pop("ns", "gram")}},
        "zero_optimization": {"stage": stage, "sub_group_size": sub_group_size, "reduce_bucket_size": 200,
                              "stage3_param_persistence_threshold": 0, **extra},
        "steps_per_print": 1000,
    }  # fmt: skip
