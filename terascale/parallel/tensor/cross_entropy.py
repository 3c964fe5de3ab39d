"""Cross-entropy over logits whose vocabulary is split over a tensor-parallel group.

[Note: vocab-parallel cross-entropy]
Rank ``r`` holds logits ``z`` for vocabulary ids ``[r * V/tp, (r + 1) * V/tp)``. With
``m`` the max over the whole vocabulary, ``S = sum_v exp(z_v - m)`` and ``t`` the target's
shifted logit, the loss is ``log S - t``. Each of ``m``, ``S`` and ``t`` is a per-position
scalar combined over the group (max, sum, and a sum where only the rank holding the target
contributes), so no rank ever holds the full ``[..., V]`` logits. The gradient with
respect to rank ``r``'s logits is ``softmax_r - onehot_r`` (label smoothing ``eps``:
``softmax_r - (1 - eps) onehot_r - eps / V``), computed from the softmax saved in
forward: no communication in backward.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: ProcessGroup,
        ignore_index: int,
        label_smoothing: float,
    ) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local_vocab = logits.shape[-1]
        vocab = local_vocab * world
        start = rank * local_vocab
        # fp32 throughout, as F.cross_entropy accumulates low-precision logits
        shifted = logits.float()
        logits_max = shifted.amax(dim=-1)
        if world > 1:
            ops.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = shifted - logits_max.unsqueeze(-1)

        held = (target >= start) & (target < start + local_vocab)
        local_target = (target - start).masked_fill(~held, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~held, 0.0)
        # one all-reduce for every per-position sum: target logit, sum exp, (sum of logits)
        sums = [target_logit]
        if label_smoothing > 0:
            sums.append(shifted.sum(dim=-1))
        softmax = shifted.exp_()  # shifted is ours (a copy); reuse its memory
        sums.append(softmax.sum(dim=-1))
        stacked = torch.stack(sums)
        if world > 1:
            ops.all_reduce(stacked, group=group)
        target_logit, sum_exp = stacked[0], stacked[-1]

        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            # -mean_v log softmax_v = log S - mean_v (z_v - m)
            smooth = log_sum_exp - stacked[1] / vocab
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        valid = target != ignore_index
        loss = loss.masked_fill(~valid, 0.0)

        softmax.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, held & valid, valid)
        ctx.label_smoothing, ctx.vocab, ctx.logits_dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_target, held, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        # a new tensor, not softmax in place: backward may run twice (retain_graph)
        grad = softmax - eps / ctx.vocab if eps > 0 else softmax.clone()
        own = grad.gather(-1, local_target.unsqueeze(-1)) - (1.0 - eps) * held.unsqueeze(-1).to(grad.dtype)
        grad.scatter_(-1, local_target.unsqueeze(-1), own)
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` of the full logits, from this rank's vocabulary slice of them.

    ``logits``: ``[..., V/tp]``, group rank ``r`` holding vocabulary ids
    ``[r * V/tp, (r + 1) * V/tp)``; ``target``: ``[...]`` ids in ``[0, V)`` (or
    ``ignore_index``, which contributes neither loss nor gradient and is left out of the
    mean). Every rank gets the same loss, in fp32; the gradient with respect to
    ``logits`` is this rank's slice of the full logits' gradient (see [Note:
    vocab-parallel cross-entropy]). Collective over ``group``.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} need target of shape "
            f"{tuple(logits.shape[:-1])}, got {tuple(target.shape)}"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index, label_smoothing)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    # as F.cross_entropy: the mean over the targets that are not ignored (nan if none is)
    return loss.sum() / (target != ignore_index).sum()
