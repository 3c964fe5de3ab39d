"""A small transformer-like language model written with tensor-parallel layers, and its
plain PyTorch twin: the model of the model-parallel parity tests.

``TPNet(group)`` slices its embedding, MLPs and head over ``group``; ``TPNet(None)`` is
the same model from ``nn.Embedding``/``nn.Linear``/``F.cross_entropy``. Built under the
same seed both hold the same full weights (the parallel layers initialise the full
tensor as the plain ones do, then keep their slice). Dropout acts on the replicated
hidden states, so its masks are the same on every tensor-parallel rank and on the
reference with the same RNG state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from terascale.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

VOCAB, HIDDEN, FFN, SEQ = 16, 8, 16, 6


class Block(nn.Module):
    def __init__(self, group, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        if group is None:
            self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
        else:
            self.up = ColumnParallelLinear(HIDDEN, FFN, group=group)
            self.down = RowParallelLinear(FFN, HIDDEN, group=group)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.dropout(self.down(F.gelu(self.up(self.norm(h)))))


class TPNet(nn.Module):
    def __init__(self, group=None, layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.group = group
        self.embed = nn.Embedding(VOCAB, HIDDEN) if group is None else VocabParallelEmbedding(VOCAB, HIDDEN, group=group)
        self.blocks = nn.ModuleList(Block(group, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = (
            nn.Linear(HIDDEN, VOCAB, bias=False)
            if group is None
            else ColumnParallelLinear(HIDDEN, VOCAB, bias=False, group=group)
        )

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        if self.group is None:
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return vocab_parallel_cross_entropy(logits.float(), labels, self.group)


def make_batches(steps: int, batch: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (steps, batch, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=-1)


# -- the same model as a list of pipeline layers ---------------------------------------------


class EmbedLayer(nn.Module):
    def __init__(self, group=None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN) if group is None else VocabParallelEmbedding(VOCAB, HIDDEN, group=group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class HeadLayer(nn.Module):
    def __init__(self, group=None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = (
            nn.Linear(HIDDEN, VOCAB, bias=False)
            if group is None
            else ColumnParallelLinear(HIDDEN, VOCAB, bias=False, group=group)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))


class TokenLoss:
    """Cross-entropy of (possibly vocabulary-sliced) logits; picklable for LayerSpec users."""

    def __init__(self, group=None) -> None:
        self.group = group

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return vocab_parallel_cross_entropy(logits.float(), labels, self.group)


def layer_specs(group=None, blocks: int = 4, dropout: float = 0.0) -> list:
    """The pipeline layers (``terascale.pipe.LayerSpec``s) of an embedding, ``blocks``
    blocks and a head, tensor-parallel over ``group`` (None: plain layers)."""
    from terascale.pipe import LayerSpec

    return [LayerSpec(EmbedLayer, group), *(LayerSpec(Block, group, dropout) for _ in range(blocks)), LayerSpec(HeadLayer, group)]


def reference_layers(blocks: int = 4, dropout: float = 0.0, base_seed: int = 1234) -> nn.Sequential:
    """The plain model a ``PipelineModule(layer_specs(...), seed_layers=True)`` builds:
    layer ``i`` under seed ``base_seed + i``."""
    layers = []
    for i, (cls, args) in enumerate([(EmbedLayer, ()), *((Block, (None, dropout)),) * blocks, (HeadLayer, ())]):
        torch.manual_seed(base_seed + i)
        layers.append(cls(*args) if args else cls(None))
    return nn.Sequential(*layers)
