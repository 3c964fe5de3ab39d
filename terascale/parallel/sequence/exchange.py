"""The all-to-alls of Ulysses attention: sequence slices in, whole sequences of some heads out.

[Note: the Ulysses exchange]
The ``P`` ranks of a sequence-parallel group hold consecutive slices of the same sequences:
rank ``r`` holds positions ``[r * s, (r + 1) * s)`` of every head. Before attention one
all-to-all gives rank ``r`` heads ``[r * H / P, (r + 1) * H / P)`` at every position
(:func:`seq_to_heads`); after it the inverse exchange returns each rank its positions of
every head (:func:`heads_to_seq`). Each exchange moves ``(P - 1) / P`` of the tensor, and
the pair is its own inverse: the backward of one is the other, so gradients travel the
same way back. Tensors are ``[batch, heads, seq, head_dim]`` (the layout Hugging Face's
attention functions take); other layouts name their dims.

[Note: gathering uneven slices]
An attention module that cannot be split by heads (a vision encoder's, taken whole) needs
the whole sequence on every rank instead: :func:`gather_slices` concatenates the ranks'
slices, which may differ in length by rank (5 image patches over 2 ranks are 3 and 2).
The collective moves equal blocks, so each slice travels padded to the longest and the
padding is cut off before anything reads it. Each rank then computes on the whole
sequence but is answerable only for its outputs, so the gradient each rank holds for the
gathered sequence is a partial one; the backward sums them over the group and hands each
rank its own slice's part (a reduce-scatter): the gradient the slice has in the unsplit
computation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.comm.collectives import all_gather_flat, reduce_scatter_flat


def _to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[b, H, s, d] (this rank's positions of every head) -> [b, H/P, P*s, d]."""
    p = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, p, h // p, s, d).permute(1, 0, 2, 3, 4).contiguous()  # [P, b, H/P, s, d]: chunk r to rank r
    recv = torch.empty_like(send)  # [P, b, H/P, s, d]: rank r's positions of my heads
    ops.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def _to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[b, H/P, P*s, d] (every position of this rank's heads) -> [b, H, s, d]."""
    p = dist.get_world_size(group)
    b, hp, ps, d = x.shape
    s = ps // p
    send = x.reshape(b, hp, p, s, d).permute(2, 0, 1, 3, 4).contiguous()  # [P, b, H/P, s, d]: rank r's positions
    recv = torch.empty_like(send)  # [P, b, H/P, s, d]: rank r's heads at my positions
    ops.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * hp, s, d)


class _Exchange(torch.autograd.Function):
    """One direction of the exchange; its backward is the other."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _to_heads(x, group) if to_heads else _to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_to_seq(grad, ctx.group) if ctx.to_heads else _to_heads(grad, ctx.group)), None, None


def _canonical(x: torch.Tensor, head_dim: int, seq_dim: int) -> torch.Tensor:
    if x.dim() != 4:
        raise ValueError(f"the Ulysses exchange takes 4-D [batch, heads, seq, head_dim] tensors, got shape {tuple(x.shape)}")
    return x.movedim((head_dim, seq_dim), (1, 2))


def seq_to_heads(x: torch.Tensor, group: ProcessGroup, *, head_dim: int = 1, seq_dim: int = 2) -> torch.Tensor:
    """This rank's sequence slice of every head -> every position of its ``H / P`` heads
    (see [Note: the Ulysses exchange]); differentiable, collective over ``group``. The
    result keeps ``x``'s layout. The head count must divide by the group's size."""
    p = dist.get_world_size(group)
    y = _canonical(x, head_dim, seq_dim)
    if y.shape[1] % p:
        raise ValueError(f"{y.shape[1]} heads do not split over a sequence-parallel group of {p} ranks")
    return _Exchange.apply(y, group, True).movedim((1, 2), (head_dim, seq_dim))


def heads_to_seq(x: torch.Tensor, group: ProcessGroup, *, head_dim: int = 1, seq_dim: int = 2) -> torch.Tensor:
    """Every position of this rank's heads -> its sequence slice of every head (the inverse
    of :func:`seq_to_heads`); differentiable, collective over ``group``."""
    p = dist.get_world_size(group)
    y = _canonical(x, head_dim, seq_dim)
    if y.shape[2] % p:
        raise ValueError(f"a sequence of {y.shape[2]} positions does not split over {p} ranks")
    return _Exchange.apply(y, group, False).movedim((1, 2), (head_dim, seq_dim))


def slice_lengths(length: int, group: ProcessGroup, device: torch.device | str) -> list[int]:
    """Every rank's ``length`` (its slice's), by group rank; collective over ``group``."""
    p = dist.get_world_size(group)
    mine = torch.tensor([length], dtype=torch.long, device=device)
    every = torch.empty(p, dtype=torch.long, device=device)
    all_gather_flat(every, mine, group)
    return every.tolist()


def _padded_blocks(parts: list[torch.Tensor], longest: int, dim: int) -> torch.Tensor:
    """``parts`` each padded with zeros along ``dim`` to ``longest``, stacked on a new dim 0."""
    blocks = []
    for part in parts:
        short = longest - part.shape[dim]
        if short:
            pad_shape = list(part.shape)
            pad_shape[dim] = short
            part = torch.cat([part, part.new_zeros(pad_shape)], dim=dim)
        blocks.append(part)
    return torch.stack(blocks).contiguous()


class _GatherSlices(torch.autograd.Function):
    """Forward: the ranks' slices concatenated; backward: reduce-scatter (see the note)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, lengths: list[int], dim: int) -> torch.Tensor:
        ctx.group, ctx.lengths, ctx.dim = group, lengths, dim
        longest = max(lengths)
        mine = _padded_blocks([x], longest, dim)[0]
        every = torch.empty((len(lengths), *mine.shape), dtype=x.dtype, device=x.device)
        all_gather_flat(every.view(-1), mine.view(-1), group)
        return torch.cat([every[r].narrow(dim, 0, n) for r, n in enumerate(lengths)], dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lengths, dim = ctx.lengths, ctx.dim
        full = _padded_blocks(list(grad.split(lengths, dim=dim)), max(lengths), dim)
        mine = torch.empty(full.shape[1:], dtype=grad.dtype, device=grad.device)
        reduce_scatter_flat(mine.view(-1), full.view(-1), ctx.group)
        return mine.narrow(dim, 0, lengths[dist.get_rank(ctx.group)]), None, None, None


def gather_slices(
    x: torch.Tensor, group: ProcessGroup, *, dim: int = 1, lengths: list[int] | None = None
) -> torch.Tensor:
    """Every rank's slice of a sequence (``x``: this rank's, along ``dim``) concatenated in
    group-rank order, on every rank; the slices may differ in length (``lengths``, by group
    rank; None asks the ranks, one small collective). Differentiable: this rank's gradient
    is its slice's part of the gradient summed over the group (see [Note: gathering uneven
    slices]). Collective over ``group``; the other dims must agree across ranks."""
    dim = dim % x.dim()
    if lengths is None:
        lengths = slice_lengths(x.shape[dim], group, x.device)
    if len(lengths) != dist.get_world_size(group) or lengths[dist.get_rank(group)] != x.shape[dim]:
        raise ValueError(f"slice lengths {lengths} do not match this rank's slice of {x.shape[dim]} along dim {dim}")
    if len(lengths) == 1:
        return x
    return _GatherSlices.apply(x.contiguous(), group, list(lengths), dim)
