"""How a tensor-parallel parameter's elements are laid out in a checkpoint.

[Note: sliced tensors in checkpoints]
Spans are elements of a *flattened* tensor. A tensor split over ``parts``
tensor-parallel ranks along dimension ``dim`` is saved part after part: part 0's
elements in its own row-major order, then part 1's, and so on, so every rank's spans
are the same large contiguous runs they are locally (a ZeRO shard of a slice stays one
span). The manifest records that order (:class:`SliceOrder`) with the parameter. When
``dim`` is 0 (and the dimension is not made of fused blocks, like a fused q/k/v weight)
part after part *is* the row-major order of the full tensor, whatever ``parts`` is, so
no order is recorded and any row-split loads with plain spans.

A loader whose slicing has the same order reads its spans directly. Any other layout
(another tensor-parallel size, another split dimension, no tensor parallelism, or
consolidation into one file) reads the whole saved tensor, puts it back into row-major
order and takes its own part: one parameter at a time, so the memory this costs is the
largest parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def part_of(full: torch.Tensor, dim: int, parts: int, index: int, fused: int = 1) -> torch.Tensor:
    """Part ``index`` of ``full`` split into ``parts`` along ``dim``, where ``dim`` is
    ``fused`` equal blocks each split alike (a contiguous copy)."""
    blocks = full.chunk(fused, dim) if fused > 1 else (full,)
    return torch.cat([b.chunk(parts, dim)[index] for b in blocks], dim).contiguous()


def join_parts(parts: Sequence[torch.Tensor], dim: int, fused: int = 1) -> torch.Tensor:
    """The full tensor whose :func:`part_of` ``k`` is ``parts[k]`` (the inverse)."""
    if fused == 1:
        return torch.cat(list(parts), dim)
    split = [p.chunk(fused, dim) for p in parts]
    return torch.cat([torch.cat([s[b] for s in split], dim) for b in range(fused)], dim)


@dataclass(frozen=True)
class SliceOrder:
    """Part after part of a tensor split over ``parts`` along ``dim`` (``fused`` blocks):
    see [Note: sliced tensors in checkpoints]."""

    dim: int
    parts: int
    fused: int = 1

    @staticmethod
    def of(dim: int, parts: int, fused: int = 1) -> SliceOrder | None:
        """The order to record, None where it is the full tensor's row-major order."""
        if parts == 1 or (dim == 0 and fused == 1):
            return None
        return SliceOrder(dim, parts, fused)

    def local_shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] //= self.parts
        return tuple(shape)

    def to_full(self, flat: torch.Tensor, full_shape: Sequence[int]) -> torch.Tensor:
        """The full row-major tensor from its elements in this order."""
        local = self.local_shape(full_shape)
        return join_parts(list(flat.reshape(self.parts, *local).unbind(0)), self.dim, self.fused)

    def to_json(self) -> list[int]:
        return [self.dim, self.parts, self.fused]

    @staticmethod
    def from_json(value: Sequence[int] | None) -> SliceOrder | None:
        return None if value is None else SliceOrder(*(int(v) for v in value))
