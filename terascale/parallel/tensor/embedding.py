"""An embedding table whose rows (the vocabulary) are split over a tensor-parallel group."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from terascale.parallel.slicing import TensorSlice, take_slice
from terascale.parallel.tensor.collectives import (
    SEQUENCE_DIM,
    SharesOnCopy,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
)
from terascale.parallel.tensor.linear import check_divisible


class VocabParallelEmbedding(SharesOnCopy):
    """``nn.Embedding`` with rank ``r`` holding rows ``[r * V/tp, (r + 1) * V/tp)``.

    Parameter: ``weight`` ``[num_embeddings/tp, embedding_dim]``, initialised as
    ``nn.Embedding`` initialises the full table, then sliced (see [Note: initialising the
    full weight] in ``linear``). Input: the same ids on every rank. Each rank looks up the
    ids it holds and writes zeros for the others; the partial outputs are summed over the
    group, so every rank gets the full ``[..., embedding_dim]`` output - or, with
    ``sequence_parallel``, its positions of it along ``sequence_dim`` (reduce-scattered).
    Ids outside ``[0, num_embeddings)`` give zeros rather than an error (checking them
    would synchronise with the device).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: ProcessGroup,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        sequence_dim: int = SEQUENCE_DIM,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.tp_size, self.tp_rank = dist.get_world_size(group), dist.get_rank(group)
        check_divisible(type(self).__name__, "num_embeddings", num_embeddings, self.tp_size)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"VocabParallelEmbedding: padding_idx={padding_idx} is outside the vocabulary")
            padding_idx %= num_embeddings  # nn.Embedding's convention for negative indices
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        per_rank = num_embeddings // self.tp_size
        self.vocab_start, self.vocab_end = self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank
        self._slice = TensorSlice(0, self.tp_size, self.tp_rank)
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype, device=device)
        self.weight = nn.Parameter(take_slice(full.weight.detach(), self._slice))

    @property
    def local_padding_idx(self) -> int | None:
        """``padding_idx`` as a row of this rank's table, or None if another rank holds it."""
        if self.padding_idx is None or not self.vocab_start <= self.padding_idx < self.vocab_end:
            return None
        return self.padding_idx - self.vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            out = F.embedding(ids, self.weight, self.padding_idx)
        else:
            foreign = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill(foreign, 0)
            out = F.embedding(local_ids, self.weight, self.local_padding_idx)
            # zeroing the rows of foreign ids also zeroes their gradient into row 0
            out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.group, self.sequence_dim)
        return reduce_from_tensor_region(out, self.group)

    def tensor_parallel_slices(self) -> dict[str, TensorSlice]:
        """The slice of ``weight`` (see ``sliced_parameters``)."""
        return {"weight": self._slice}

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: ProcessGroup, **kwargs) -> VocabParallelEmbedding:
        """This rank's rows of an existing ``nn.Embedding`` (its weights, device, dtype);
        ``kwargs`` are the constructor's keywords (``sequence_parallel``, ...)."""
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("VocabParallelEmbedding: max_norm, scale_grad_by_freq and sparse are not supported")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group, padding_idx=embedding.padding_idx,
                    dtype=embedding.weight.dtype, device="meta", **kwargs)  # fmt: skip
        weight = embedding.weight
        layer.weight = nn.Parameter(take_slice(weight.detach(), layer._slice), requires_grad=weight.requires_grad)
        return layer

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
            f"tp={self.tp_rank}/{self.tp_size}, sequence_parallel={self.sequence_parallel}"
        )
