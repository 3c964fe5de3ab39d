"""Which part of a full tensor a tensor-parallel rank holds, and how to cut and rejoin it.

[Note: tensor slices]
A tensor-parallel layer keeps, of each sliced parameter, one of ``parts`` equal blocks of
the full tensor along one dim; block ``index`` belongs to tensor-parallel rank ``index``.
A *fused* parameter (q, k and v projections stored as one ``[3 * hidden, hidden]``
weight) is ``fused`` equal blocks along that dim, each split on its own, so that every
rank holds whole heads of q, of k and of v: rank ``i``'s tensor is the concatenation of
part ``i`` of every block. Everything else about a parameter - its name, the full shape
a checkpoint stores - stays that of the unsliced model, so the checkpoint code needs only
:func:`sliced_parameters` to map between a rank's tensors and the logical full ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

# The cutting and joining itself is the checkpoint's coordinate arithmetic too (it reorders
# saved slices without importing this layer): one implementation, there.
from terascale.checkpoint.order import join_parts, part_of


@dataclass(frozen=True)
class TensorSlice:
    """This rank's part of a full tensor split over `parts` tensor-parallel ranks along `dim`.
    `fused`: dim `dim` of the full tensor is `fused` equal blocks (e.g. fused q,k,v = 3), each split
    into `parts`; the local tensor is the concatenation of part `index` of every block."""

    dim: int
    parts: int
    index: int
    fused: int = 1

    def __post_init__(self) -> None:
        if self.parts < 1 or self.fused < 1:
            raise ValueError(f"TensorSlice: parts and fused must be >= 1, got parts={self.parts}, fused={self.fused}")
        if not 0 <= self.index < self.parts:
            raise ValueError(f"TensorSlice: index {self.index} is outside [0, {self.parts})")

    def _dim_of(self, shape: Sequence[int]) -> int:
        if not -len(shape) <= self.dim < len(shape):
            raise ValueError(f"TensorSlice: dim {self.dim} is out of range for a {len(shape)}-d shape {tuple(shape)}")
        return self.dim % len(shape)

    def local_shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of this rank's part of a tensor of ``full_shape``."""
        d = self._dim_of(full_shape)
        size, divisor = full_shape[d], self.parts * self.fused
        if size % divisor:
            raise ValueError(
                f"TensorSlice: size {size} of dim {d} is not divisible by {divisor} "
                f"({self.parts} parts x {self.fused} fused blocks)"
            )
        shape = list(full_shape)
        shape[d] = size // self.parts
        return tuple(shape)

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the full tensor whose part on this rank has ``local_shape``."""
        d = self._dim_of(local_shape)
        if local_shape[d] % self.fused:
            raise ValueError(
                f"TensorSlice: local size {local_shape[d]} of dim {d} is not divisible by fused={self.fused}"
            )
        shape = list(local_shape)
        shape[d] = local_shape[d] * self.parts
        return tuple(shape)


def take_slice(full: torch.Tensor, s: TensorSlice) -> torch.Tensor:
    """A contiguous copy of rank ``s.index``'s part of ``full`` (never a view of ``full``)."""
    s.local_shape(full.shape)  # raises on sizes that do not divide
    return part_of(full, s._dim_of(full.shape), s.parts, s.index, s.fused)  # torch.cat copies


def join_slices(parts: Sequence[torch.Tensor], dim: int, fused: int = 1) -> torch.Tensor:
    """The full tensor from every rank's part (``parts[i]`` is index ``i``'s); inverse of
    :func:`take_slice` over all indices."""
    if not parts:
        raise ValueError("join_slices: no parts given")
    shape = parts[0].shape
    if any(p.shape != shape for p in parts):
        raise ValueError(f"join_slices: parts differ in shape: {[tuple(p.shape) for p in parts]}")
    d = TensorSlice(dim, len(parts), 0, fused)._dim_of(shape)
    if shape[d] % fused:
        raise ValueError(f"join_slices: size {shape[d]} of dim {d} is not divisible by fused={fused}")
    return join_parts(parts, d, fused)


def sliced_parameters(module: nn.Module) -> dict[str, TensorSlice]:
    """The slice of every tensor-parallel parameter of ``module``, by its full dotted name.

    Asks every submodule that has ``tensor_parallel_slices()`` (whose keys are its own
    direct parameter names). A parameter reachable under several names (tied) is named as
    ``module.named_parameters()`` first names it. Parameters not listed are replicated
    over the tensor-parallel group.
    """
    names = {id(p): name for name, p in module.named_parameters()}
    out: dict[str, TensorSlice] = {}
    for _, sub in module.named_modules():
        describe = getattr(sub, "tensor_parallel_slices", None)
        if not callable(describe):
            continue
        for local_name, s in describe().items():
            param = sub._parameters.get(local_name)
            assert param is not None, f"{type(sub).__name__} describes '{local_name}', which is not its parameter"
            name = names[id(param)]
            assert out.get(name, s) == s, f"parameter '{name}' is described by two different slices"
            out[name] = s
    return out
