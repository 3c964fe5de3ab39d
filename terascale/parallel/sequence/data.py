"""A batch cut into sequence slices, and the loss over all of its tokens.

[Note: the loss under sequence parallelism]
Each rank of a sequence-parallel group sees ``1 / P`` of every sequence, but the loss is a
mean over every target token of the micro-batch, and a slice may hold more, fewer or no
counted targets than another. So each rank sums its targets' losses and divides by the
number of counted targets of the whole micro-batch, ``N``, known to every rank before the
batch is cut (:func:`slice_batch`); the ranks' terms add up to the unsplit mean. Summing
the ranks' gradients (the gradient reduction sums over the sequence-parallel ranks,
averaging only over data-parallel replicas) gives the unsplit model's gradient.
:func:`sequence_loss` returns each rank's term with the *value* of the whole mean, so the
loss a program logs is the unsplit model's on every rank, while backward runs on the local
term only. Next-token targets are shifted on the whole sequence before it is cut: shifted
within a slice, the target of its last position (the next slice's first token) would be lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops

IGNORE = -100


@dataclass(frozen=True)
class SequenceSlice:
    """One rank's slice of a micro-batch: ``inputs`` (every ``[b, S, ...]`` tensor cut on the
    sequence dim, with global ``position_ids`` and next-token ``shift_labels``) and
    ``num_targets``, the counted targets of the whole micro-batch."""

    inputs: dict[str, Any]
    num_targets: int


def slice_batch(batch: Mapping[str, Any], rank: int, sp: int, *, seq_dim: int = 1) -> SequenceSlice:
    """Cut ``batch`` (Hugging Face keyword inputs: ``input_ids``, optional ``labels``,
    ``position_ids``, ``attention_mask``) into ``sp`` slices of its sequence dim and return
    slice ``rank`` (see [Note: the loss under sequence parallelism]). ``labels`` are
    replaced by ``shift_labels`` (shifted on the whole sequence); an all-ones
    ``attention_mask`` is dropped (it says nothing), another is refused for now."""
    ids = batch["input_ids"]
    length = ids.shape[seq_dim]
    if length % sp:
        raise ValueError(
            f"sequences of {length} tokens do not split over {sp} sequence-parallel ranks; pad or pack them "
            f"to a multiple of {sp}"
        )
    out = dict(batch)
    mask = out.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError("sequence parallelism: padded batches (an attention_mask with zeros) are not supported yet")
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(length, device=ids.device).expand(ids.shape[0], length)
    num_targets = 0
    labels = out.pop("labels", None)
    if labels is not None and out.get("shift_labels") is None:
        pad = torch.full_like(labels.narrow(seq_dim, 0, 1), IGNORE)
        out["shift_labels"] = torch.cat([labels.narrow(seq_dim, 1, length - 1), pad], dim=seq_dim)
    if out.get("shift_labels") is not None:
        num_targets = int((out["shift_labels"] != IGNORE).sum())
    size = length // sp
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() > seq_dim and value.shape[seq_dim] == length:
            out[key] = value.narrow(seq_dim, rank * size, size)
    return SequenceSlice(out, num_targets)


class _GlobalValue(torch.autograd.Function):
    """``local``'s gradient with ``total``'s value."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        return total.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sequence_loss(
    logits: torch.Tensor, shift_labels: torch.Tensor, num_targets: int | torch.Tensor, group: ProcessGroup | None
) -> torch.Tensor:
    """This rank's term of the micro-batch's mean cross-entropy (fp32): its slice's
    summed losses over ``num_targets``, the whole micro-batch's counted targets; the value
    returned is the whole mean (the terms summed over ``group``), its gradient this rank's
    term's (see [Note: the loss under sequence parallelism]). Collective over ``group``."""
    summed = torch.nn.functional.cross_entropy(
        logits.flatten(0, -2).float(), shift_labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return sequence_mean(summed, num_targets, group)


def sequence_mean(summed: torch.Tensor, num_targets: int | torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``summed`` (this rank's slice's summed losses, 0-d) over ``num_targets``, valued as
    the whole micro-batch's mean: the terms of every rank of ``group`` added up (None: one
    rank); its gradient is this rank's term's. Collective over ``group``."""
    if isinstance(num_targets, torch.Tensor):
        local = summed / num_targets.to(summed.device).clamp(min=1)
    else:
        local = summed / max(num_targets, 1)
    total = local.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        ops.all_reduce(total, group=group)
    return _GlobalValue.apply(local, total)
