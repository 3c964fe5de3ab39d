"""One matrix product per expert over each expert's run of rows: ``grouped_linear``.

The rows a rank's experts receive arrive expert by expert ([Note: expert-parallel
dispatch]); expert ``i`` multiplies its ``counts[i]`` rows by its own weight. With a
fused 3-D weight ([E, N, K], Hugging Face's layout) that is one grouped matmul
(``torch._grouped_mm``: one kernel on GPUs, and on CPUs in torch 2.13 as fast as the
loop or faster); where the kernel cannot take the shapes (rows of 16-byte-unaligned
width) the product runs expert by expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``_grouped_mm``'s backward
    refuses the expanded (stride-0) gradient that a ``sum()`` downstream produces."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes rows ``x`` [R, K] times ``weight`` [E, N, K]^T."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.float32, torch.bfloat16) or (x.device.type == "cuda" and x.dtype != torch.bfloat16):
        return False
    size = x.element_size()
    return (weight.shape[-1] * size) % 16 == 0 and (weight.shape[-2] * size) % 16 == 0


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int], *, grouped_mm: bool = True) -> torch.Tensor:
    """``x`` [R, K] with its rows in runs of ``counts[i]`` (sum R) for expert ``i``;
    returns [R, N]: each run times ``weight[i]`` ([E, N, K]) transposed, as ``F.linear``
    would. Every expert takes part in autograd, with zero rows if none came."""
    if len(counts) != weight.shape[0]:
        raise ValueError(f"{len(counts)} row counts for {weight.shape[0]} experts")
    if grouped_mm and x.shape[0] > 0 and grouped_mm_fits(x, weight):
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(1, 2), offs=offs))
    return torch.cat([F.linear(chunk, weight[i]) for i, chunk in enumerate(x.split(list(counts)))])
