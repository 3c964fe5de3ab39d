"""Global gradient norm and clipping, over replicated or sharded gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def global_grad_norm(grads: Sequence[torch.Tensor], group: ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of all ``grads`` taken together, as a float32 0-d tensor.

    ``group=None`` means every rank holds the same full gradients (no communication);
    otherwise each rank holds a disjoint piece and the squared norms are summed over
    ``group``. Non-finite gradients give a non-finite norm, which is how overflow shows.
    """
    if grads:
        norms = torch._foreach_norm([g for g in grads], 2.0)
        total_sq = torch.stack([n.float() for n in norms]).square().sum()
    else:
        total_sq = torch.zeros((), dtype=torch.float32)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total_sq, group=group)
    return total_sq.sqrt()


def clip_grads_(grads: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so their global norm is at most ``max_norm``.

    Uses the same coefficient as ``torch.nn.utils.clip_grad_norm_``:
    ``min(1, max_norm / (total_norm + 1e-6))``.
    """
    if not grads:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, same in by_device.items():
        torch._foreach_mul_(same, coef.to(device))
