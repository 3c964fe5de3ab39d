"""Global gradient norm and clipping, over replicated or sharded gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from terascale.comm.collectives import global_grad_norm

__all__ = ["clip_coefficient", "clip_grads_", "global_grad_norm"]


def clip_grads_(grads: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so their global norm is at most ``max_norm``.

    Uses the same coefficient as ``torch.nn.utils.clip_grad_norm_``:
    ``min(1, max_norm / (total_norm + 1e-6))``.
    """
    if not grads:
        return
    coef = clip_coefficient(max_norm, total_norm)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, same in by_device.items():
        torch._foreach_mul_(same, coef.to(device))


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` uses."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
