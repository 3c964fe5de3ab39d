"""Collectives over a tensor-parallel group that autograd can differentiate.

[Note: regions]
Megatron's vocabulary. A *tensor-parallel region* is the part of a layer where each rank
holds a slice of the activations (its heads, its columns); outside it every rank holds the
same, replicated activations. Entering a region is free in forward (each rank already has
the full input) but each rank's input gradient is only its slice's contribution, so the
backward all-reduces: :func:`copy_to_tensor_region`. Leaving a region sums the ranks'
partial outputs in forward, and the gradient is already the same everywhere:
:func:`reduce_from_tensor_region`. Gather and scatter along the last (feature) dim are the
other exit and entry.

With *sequence parallelism* the replicated activations between blocks are instead split
along the sequence dim, each rank holding its own positions (a *sequence region*).
Entering a tensor region all-gathers the sequence and its backward reduce-scatters the
partial gradients (:func:`gather_from_sequence_region`); leaving it reduce-scatters the
partial outputs, and its backward all-gathers (:func:`reduce_scatter_to_sequence_region`).

The sequence dim is an argument: 1 for the ``[batch, seq, hidden]`` activations of
Hugging Face models (the default everywhere here), 0 for Megatron's ``[seq, batch, hidden]``.

With a group of one rank every function here is the identity and communicates nothing.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.comm.collectives import all_gather_flat, reduce_scatter_flat

SEQUENCE_DIM = 1  # [batch, seq, hidden]


def _world(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum of ``x`` over ``group``, in a new tensor (``x`` itself may be shared: a
    gradient that autograd also hands to another branch, an activation saved for backward)."""
    out = x.clone(memory_format=torch.contiguous_format)
    ops.all_reduce(out, group=group)
    return out


def _split(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (contiguous copy)."""
    world, size = _world(group), x.shape[dim]
    if size % world:
        raise ValueError(f"size {size} of dim {dim} is not divisible by tensor-parallel size {world}")
    n = size // world
    return x.narrow(dim, dist.get_rank(group) * n, n).contiguous()


def _all_gather(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in group-rank order."""
    world = _world(group)
    x = x.contiguous()
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    all_gather_flat(out.view(-1), x.view(-1), group)
    # [world, .., n, ..] -> [.., world, n, ..] -> [.., world * n, ..] (a copy unless dim == 0)
    return out.movedim(0, dim % x.dim()).flatten(dim % x.dim(), dim % x.dim() + 1)


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """The sum of ``x`` over ``group``, of which this rank keeps its part along ``dim``."""
    world, size = _world(group), x.shape[dim]
    if size % world:
        raise ValueError(f"size {size} of dim {dim} is not divisible by tensor-parallel size {world}")
    dim = dim % x.dim()
    # [.., world * n, ..] -> [world, .., n, ..] so that each rank's part is contiguous.
    full = x.unflatten(dim, (world, size // world)).movedim(dim, 0).contiguous()
    if full.data_ptr() == x.data_ptr():
        full = full.clone()  # reduce_scatter_flat may overwrite its input; x is not ours
    out = torch.empty(full.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out.view(-1), full.view(-1), group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, ctx.group, ctx.dim), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int, partial_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.partial_grad = group, dim, partial_grad
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.partial_grad:
            return _reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return _split(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.group, ctx.dim), None, None


def copy_to_tensor_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward: ``x`` unchanged. Backward: the gradient summed over ``group``.

    Also what makes a replicated parameter used on sequence-split activations get its
    full gradient on every rank (pass the parameter through it before use).
    """
    return x if _world(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward: ``x`` summed over ``group`` (every rank gets the sum). Backward: identity."""
    return x if _world(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_tensor_region(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Forward: every rank's ``x`` concatenated along ``dim`` (default the last, features),
    in group-rank order. Backward: this rank's part of the gradient."""
    return x if _world(group) == 1 else _GatherFromRegion.apply(x, group, dim)


def scatter_to_tensor_region(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Forward: this rank's part of ``x`` along ``dim`` (group rank ``r`` keeps block ``r``).
    Backward: the ranks' gradients concatenated along ``dim``."""
    return x if _world(group) == 1 else _ScatterToRegion.apply(x, group, dim)


def gather_from_sequence_region(
    x: torch.Tensor, group: ProcessGroup, dim: int = SEQUENCE_DIM, *, partial_grad: bool = True
) -> torch.Tensor:
    """Forward: the full sequence, every rank's positions ``x`` concatenated along ``dim``.

    Backward: with ``partial_grad`` (the gathered tensor feeds a tensor-parallel layer, so
    each rank's gradient is a partial sum) the gradients are reduce-scattered; without it
    (the gathered tensor feeds replicated computation, the gradient is the same on every
    rank) each rank takes its own positions.
    """
    return x if _world(group) == 1 else _GatherFromSequenceRegion.apply(x, group, dim, partial_grad)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Forward: ``x`` summed over ``group``, each rank keeping its positions along ``dim``.
    Backward: the positions' gradients all-gathered."""
    return x if _world(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group, dim)


def scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Forward: this rank's positions of the replicated ``x`` (e.g. the embedding output
    entering a sequence-parallel stack). Backward: the positions' gradients all-gathered."""
    return scatter_to_tensor_region(x, group, dim)


class SharesOnCopy(nn.Module):
    """A module whose attributes named in ``_shared_on_copy`` (a process group, an RNG
    tracker) are handles to shared state: ``copy.deepcopy`` gives the copy the same
    objects instead of failing (a process group cannot be copied) or forking them."""

    _shared_on_copy: ClassVar[tuple[str, ...]] = ("group",)

    def __deepcopy__(self, memo: dict) -> SharesOnCopy:
        for name in self._shared_on_copy:
            shared = self.__dict__.get(name)
            memo[id(shared)] = shared
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new
