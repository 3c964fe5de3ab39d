"""Normalisation layers for activations split along the sequence over tensor-parallel ranks.

[Note: sequence-parallel parameters]
Under sequence parallelism a norm between blocks sees only this rank's positions, so the
gradient of its (replicated) weight is a partial sum over those positions. Megatron sums
such gradients over the tensor-parallel group in its optimizer; here the parameters pass
through :func:`copy_to_tensor_region` (identity forward, all-reduce backward) on their
way into the computation, so autograd itself leaves the full, identical gradient on every
rank and the engine needs to know nothing about it. ``RowParallelLinear``'s bias under
sequence parallelism does the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from terascale.parallel.tensor.collectives import SharesOnCopy, copy_to_tensor_region


class SequenceParallelNorm(SharesOnCopy):
    """LayerNorm (or RMSNorm with ``rms=True``) over the last dims of sequence-split
    activations, whose ``weight``/``bias`` get full gradients on every rank of ``group``
    (see [Note: sequence-parallel parameters]).

    Parameters and initialisation are ``nn.LayerNorm``'s / ``nn.RMSNorm``'s (``weight``
    ones, ``bias`` zeros; RMSNorm has no bias), so state-dict keys and values equal theirs.
    The forward is theirs on whatever part of the sequence ``x`` holds; the module
    itself communicates only in backward.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        *,
        group: ProcessGroup,
        eps: float | None = 1e-5,
        rms: bool = False,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape: tuple[int, ...] = shape
        self.group, self.eps, self.rms = group, eps, rms
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(shape, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)
        if elementwise_affine and bias and not rms:
            self.bias = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else copy_to_tensor_region(self.weight, self.group)
        if self.rms:
            return F.rms_norm(x, self.normalized_shape, weight, self.eps)
        bias = None if self.bias is None else copy_to_tensor_region(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, 1e-5 if self.eps is None else self.eps)

    @classmethod
    def from_norm(cls, norm: nn.LayerNorm | nn.RMSNorm, group: ProcessGroup) -> SequenceParallelNorm:
        """The same norm (its parameters, shared, not copied) with sequence-parallel gradients."""
        if not isinstance(norm, (nn.LayerNorm, nn.RMSNorm)):
            raise TypeError(
                f"SequenceParallelNorm.from_norm takes nn.LayerNorm or nn.RMSNorm, got {type(norm).__name__}"
            )
        rms = isinstance(norm, nn.RMSNorm)
        layer = cls(norm.normalized_shape, group=group, eps=norm.eps, rms=rms, elementwise_affine=False, device="meta")
        layer.weight = norm.weight
        layer.bias = None if rms else norm.bias
        return layer

    def extra_repr(self) -> str:
        kind = "rms" if self.rms else "layer"
        return f"{self.normalized_shape}, eps={self.eps}, {kind}, affine={self.weight is not None}"
