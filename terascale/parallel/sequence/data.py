"""A batch cut into sequence slices, and the loss over all of its tokens.

[Note: the loss under sequence parallelism]
Each rank of a sequence-parallel group sees ``1 / P`` of every sequence, but the loss is a
mean over every target token of the micro-batch, and a slice may hold more, fewer or no
counted targets than another. So each rank sums its targets' losses and divides by the
number of counted targets of the whole micro-batch, ``N``, known to every rank before the
batch is cut (:func:`slice_batch`); the ranks' terms add up to the unsplit mean, and so
do their gradients. The engine reduces gradients as DeepSpeed does, averaging over every
rank that holds the parameters, the sequence group's included ([Note: sequence-parallel
groups]); so each rank's backward starts from ``P`` times its term, and the average over
the group is the sum of the terms' gradients. (DeepSpeed's ALST recipe arrives at the same
``P`` x term: the backward of its differentiable all-gather of the ranks' losses sums the
group's gradients of the combined loss.) :func:`sequence_loss` returns that with the
*value* of the whole mean, so the loss a program logs is the unsplit model's on every
rank. Next-token targets are shifted on the whole sequence before it is cut: shifted
within a slice, the target of its last position (the next slice's first token) would be
lost.
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
    sequence dim, with global ``position_ids`` and next-token ``shift_labels``),
    ``num_targets``, the counted targets of the whole micro-batch, and ``mask``, the whole
    sequences' attention mask where it is not plain causal (see :func:`full_mask`)."""

    inputs: dict[str, Any]
    num_targets: int
    mask: torch.Tensor | None = None


def full_mask(attention_mask: torch.Tensor | None, position_ids: torch.Tensor) -> torch.Tensor | None:
    """The boolean ``[b, 1, S, S]`` mask (True: attend) of whole sequences for a padding
    ``attention_mask`` ([b, S], 0 at padding) or, without one, ``position_ids`` ([b, S])
    that hold packed sequences, or None where it is plain causal. As Hugging Face's masks
    read them, a packed sequence begins wherever a position is not its predecessor's plus
    one. A query attends to earlier keys of its own sequence that are not padding; a
    left-padding query has none, and its row stays empty, as in the model's own mask (the
    attention kernel decides what such a row gives, the same split or whole)."""
    padded = attention_mask is not None and not bool(attention_mask.all())
    length = position_ids.shape[-1]
    document = None
    if attention_mask is None:
        step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
        document = (step != 1).cumsum(-1)
        if not bool(document[:, -1].any()):
            document = None
    if not padded and document is None:
        return None
    index = torch.arange(length, device=position_ids.device)
    mask = (index[None, :] <= index[:, None])[None].expand(position_ids.shape[0], length, length)
    if document is not None:
        mask = mask & (document[:, :, None] == document[:, None, :])
    if padded:
        mask = mask & attention_mask.bool()[:, None, :]
    return mask[:, None]


def slice_batch(batch: Mapping[str, Any], rank: int, sp: int, *, seq_dim: int = 1) -> SequenceSlice:
    """Cut ``batch`` (Hugging Face keyword inputs: ``input_ids``, optional ``labels``,
    ``position_ids``, ``attention_mask``) into ``sp`` slices of its sequence dim and return
    slice ``rank`` (see [Note: the loss under sequence parallelism]). ``labels`` are
    replaced by ``shift_labels`` (shifted on the whole sequence); the ``attention_mask`` is
    taken out and, with the position ids, becomes the whole sequences' ``mask``."""
    ids = batch["input_ids"]
    length = ids.shape[seq_dim]
    out = dict(batch)
    attention_mask = out.pop("attention_mask", None)
    if out.get("position_ids") is None:  # what the model makes without them, at full length
        out["position_ids"] = torch.arange(length, device=ids.device).expand(ids.shape[0], length)
    labels = out.pop("labels", None)
    if labels is not None and out.get("shift_labels") is None:
        out["shift_labels"] = next_token_targets(labels, seq_dim)
    num_targets = int((out["shift_labels"] != IGNORE).sum()) if out.get("shift_labels") is not None else 0
    inputs = cut_sequences(out, rank, sp, seq_dim=seq_dim)
    mask = full_mask(attention_mask, out["position_ids"].expand(ids.shape[0], length)) if seq_dim == 1 else None
    return SequenceSlice(inputs, num_targets, mask)


def next_token_targets(labels: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
    """``labels`` shifted one position left along ``seq_dim`` on the whole sequence, the
    last position ignored: position i's target is token i + 1."""
    pad = torch.full_like(labels.narrow(seq_dim, 0, 1), IGNORE)
    return torch.cat([labels.narrow(seq_dim, 1, labels.shape[seq_dim] - 1), pad], dim=seq_dim)


def cut_sequences(batch: Mapping[str, Any], rank: int, sp: int, *, seq_dim: int = 1) -> dict[str, Any]:
    """``batch`` with ``labels`` replaced by their :func:`next_token_targets`
    (``shift_labels``) and every tensor of the sequence's length along ``seq_dim`` cut to
    slice ``rank`` of ``sp`` (views: the rest as they are). Raises ``ValueError`` when the
    sequence does not split evenly."""
    length = batch["input_ids"].shape[seq_dim]
    if length % sp:
        raise ValueError(
            f"sequences of {length} tokens do not split over {sp} sequence-parallel ranks; pad or pack them "
            f"to a multiple of {sp}"
        )
    out = dict(batch)
    labels = out.pop("labels", None)
    if labels is not None and out.get("shift_labels") is None:
        out["shift_labels"] = next_token_targets(labels, seq_dim)
    size = length // sp
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() > seq_dim and value.shape[seq_dim] == length:
            out[key] = value.narrow(seq_dim, rank * size, size)
    return out


class _GlobalValue(torch.autograd.Function):
    """``total``'s value; ``local``'s gradient times ``factor``."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, total: torch.Tensor, factor: int) -> torch.Tensor:
        ctx.factor = factor
        return total.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None, None


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
    rank); its gradient is this rank's term's times the group's size, for the engine's
    average over the group ([Note: the loss under sequence parallelism]). Collective over
    ``group``."""
    if isinstance(num_targets, torch.Tensor):
        local = summed / num_targets.to(summed.device).clamp(min=1)
    else:
        local = summed / max(num_targets, 1)
    total = local.detach().clone()
    size = 1 if group is None else dist.get_world_size(group)
    if size > 1:
        ops.all_reduce(total, group=group)
    return _GlobalValue.apply(local, total, size)
