"""Dropout on activations that are sliced over tensor-parallel ranks.

[Note: dropout under tensor parallelism]
Two kinds of activation need two kinds of mask. Replicated activations (outside a
tensor-parallel region: the residual stream, the output of a row-parallel layer) are one
tensor held by every rank, so the mask must be the same on every rank, or the copies
drift apart: plain ``nn.Dropout`` drawing from the default generator, which
``seed_model_parallel`` seeds alike on all tensor-parallel ranks. Sliced activations
(attention heads, MLP columns inside a region) are different parts of one tensor, so the
masks must differ, or the same pattern repeats in every slice: :class:`ParallelDropout`
draws from the tracker's ``model-parallel-rng`` stream, seeded per tensor-parallel rank,
and leaves the default generator where it was. The tracker is passed explicitly; the
same one is what activation checkpointing snapshots, so a recompute replays these masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from terascale.activation.rng import MODEL_PARALLEL_RNG, RNGStatesTracker
from terascale.parallel.tensor.collectives import SharesOnCopy


def parallel_dropout(
    x: torch.Tensor, p: float, training: bool, tracker: RNGStatesTracker, stream: str = MODEL_PARALLEL_RNG
) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with the mask drawn from ``tracker``'s ``stream``
    (per tensor-parallel rank: see [Note: dropout under tensor parallelism])."""
    if not training or p == 0.0:
        return x
    with tracker.fork(stream):
        return F.dropout(x, p, training=True)


class ParallelDropout(SharesOnCopy):
    """Dropout for activations inside a tensor-parallel region: masks differ across
    tensor-parallel ranks. For replicated activations use ``nn.Dropout``."""

    _shared_on_copy = ("tracker",)  # a copy draws from the same streams

    def __init__(self, p: float, tracker: RNGStatesTracker, stream: str = MODEL_PARALLEL_RNG) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"ParallelDropout: p must be in [0, 1], got {p}")
        self.p, self.tracker, self.stream = p, tracker, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel_dropout(x, self.p, self.training, self.tracker, self.stream)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream!r}"
