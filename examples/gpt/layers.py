"""The GPT as a list of layers: embedding, ``n_layer`` blocks, final norm + head.

The same pre-LayerNorm decoder as :mod:`gpt.model` (GPT-2 initialisation, causal SDPA,
GELU MLP), cut into layers that a pipeline can place on different ranks and that a
tensor-parallel version can slice, for benchmarks that compare layouts and systems
(``bench/parallel3d.py``). Differences from :class:`gpt.model.GPT`, all of them so that
every layout of the model is the same model:

- The output head has its own weight (not tied to the token embedding): every system
  (pipeline engines included) supports an untied head without special cases.
- Each layer draws its initial weights from its own generator, seeded by ``(seed,
  layer index)``, never from the global RNG. A rank that builds only some layers (a
  pipeline stage), or builds a layer to slice it (tensor parallelism), gets exactly the
  weights that a one-process model built from the same seed has.
- Attention derives its number of heads from the width of its ``qkv`` output and the
  head size, so the same ``Block.forward`` runs on a block whose projections were
  sliced over tensor-parallel ranks (each rank then holds ``n_head / tp`` heads, its
  ``qkv`` output being its q, k and v heads concatenated).
- Plain ``nn.Linear``/``nn.LayerNorm`` (fp32 only), which tools that recognise layers by
  type (DeepSpeed's AutoTP) can find.

Layer ``i`` of :func:`layer_specs` is ``Embed`` for ``i == 0``, ``Block`` for
``1 <= i <= n_layer`` and ``Head`` for ``i == n_layer + 1``; :class:`LayeredGPT` runs
them in order and returns the mean cross-entropy, like ``GPT(ids, labels)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpt.model import GPTConfig


def layer_generator(seed: int, index: int) -> torch.Generator:
    """The generator that initialises layer ``index`` of a model built from ``seed``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def _init_linear(linear: nn.Linear, std: float, gen: torch.Generator) -> None:
    with torch.no_grad():
        nn.init.normal_(linear.weight, mean=0.0, std=std, generator=gen)
        if linear.bias is not None:
            linear.bias.zero_()


class Embed(nn.Module):
    """Token + learned position embeddings (layer 0): ids ``(B, T)`` -> ``(B, T, C)``."""

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        gen = layer_generator(seed, 0)
        with torch.no_grad():
            nn.init.normal_(self.wte.weight, mean=0.0, std=0.02, generator=gen)
            nn.init.normal_(self.wpe.weight, mean=0.0, std=0.02, generator=gen)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.wte(ids) + self.wpe(positions)


class Attention(nn.Module):
    """Causal self-attention; heads = width of ``qkv``'s output / (3 * head size)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block (layer ``index``, 1-based): x + attn(ln(x)), x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, index: int, seed: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)
        gen = layer_generator(seed, index)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2: residual projections scaled by depth
        _init_linear(self.attn.qkv, 0.02, gen)
        _init_linear(self.attn.proj, residual_std, gen)
        _init_linear(self.mlp.fc, 0.02, gen)
        _init_linear(self.mlp.proj, residual_std, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final LayerNorm and output projection (layer ``n_layer + 1``): ``(B, T, C)`` -> logits."""

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        _init_linear(self.lm_head, 0.02, layer_generator(seed, config.n_layer + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layer_specs(config: GPTConfig, seed: int = 0) -> list[tuple[type[nn.Module], tuple]]:
    """``(class, constructor args)`` of every layer in order, for pipeline ``LayerSpec``s."""
    return [(Embed, (config, seed))] + [(Block, (config, i, seed)) for i in range(1, config.n_layer + 1)] + [
        (Head, (config, seed))
    ]


class LayeredGPT(nn.Module):
    """All layers in one module: ``forward(ids)`` -> logits, ``forward(ids, labels)`` -> loss.

    ``blocks`` is a ``ModuleList`` (what ZeRO-3/FSDP wrap policies look for).
    """

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embed = Embed(config, seed)
        self.blocks = nn.ModuleList(Block(config, i, seed) for i in range(1, config.n_layer + 1))
        self.head = Head(config, seed)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits if labels is None else loss_fn(logits, labels)
