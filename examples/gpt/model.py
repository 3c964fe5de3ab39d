"""A small GPT: the standard pre-LayerNorm decoder-only transformer.

Token + learned position embeddings, ``n_layer`` blocks of causal self-attention
(``F.scaled_dot_product_attention``) and a GELU MLP, a final LayerNorm, and an output
head whose weight is the token embedding (weight tying, as in GPT-2).

Parameters may be fp32, bf16 or fp16 (the terascale engine casts the model to the
config's dtype). Activations are computed in the parameters' dtype, except on CPUs
without native low-precision matmul kernels (see :func:`compute_dtype`), and the loss
is always computed in fp32 because a softmax over bf16 logits loses enough precision
to bias the loss and its gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    ``block_size`` is the longest sequence the model accepts (the number of learned
    position embeddings); ``n_embd`` must be divisible by ``n_head``.
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


# The model trained by ``make demo`` (examples/train_gpt.py): ~10.8M parameters, sized
# so that a bf16 run on 2 CPU ranks finishes in a few minutes.
DEMO_CONFIG = GPTConfig(vocab_size=256, block_size=128, n_layer=6, n_head=6, n_embd=384)


def flops_per_iteration(config: GPTConfig, global_batch: int, seq_len: int) -> float:
    """Floating-point operations of one optimizer step, by the Megatron-LM formula.

    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` with ``B`` the global batch in sequences,
    ``s`` the sequence length, ``l`` layers, ``h`` hidden size, ``V`` vocabulary size
    (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", 2021, eq. 3). It counts the dense matmuls only: 24·B·s·h² per
    layer for QKV/projection/MLP plus 4·B·s²·h for attention scores, the logit layer,
    and a factor 4 = forward + backward (2×) + one recomputed forward. Without
    activation checkpointing the hardware does 3/4 of this, so TFLOP/s derived from it
    are comparable with Megatron/DeepSpeed reports rather than an exact op count.
    """
    if global_batch < 1 or seq_len < 1:
        raise ValueError(f"global_batch and seq_len must be >= 1, got {global_batch}, {seq_len}")
    b, s, l, h, v = global_batch, seq_len, config.n_layer, config.n_embd, config.vocab_size
    return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def compute_dtype(param_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype in which activations are computed for parameters of ``param_dtype``.

    The parameters' dtype, except for bf16/fp16 parameters on a CPU without native
    kernels for them: there PyTorch falls back to a scalar reference GEMM that is
    10-50x slower than fp32 (measured on an AVX2-only EPYC: 0.6-8 GFLOP/s bf16 vs
    33 GFLOP/s fp32 on one core), so activations are computed in fp32 while the
    parameters and their gradients stay in low precision. oneDNN's own support test
    (``_is_mkldnn_bf16_supported``: AVX512-BW/VL/DQ, or ARM BF16) is the condition
    under which ``torch.mm`` uses fast bf16/fp16 kernels.
    """
    if device.type != "cpu" or param_dtype not in (torch.bfloat16, torch.float16):
        return param_dtype
    if param_dtype == torch.bfloat16:
        native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    else:
        native = torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return param_dtype if native else torch.float32


class _WidenedLinear(torch.autograd.Function):
    """``F.linear(x, weight.to(x.dtype), bias.to(x.dtype))`` that keeps ``weight`` for
    backward as it is stored, not its widened copy.

    Plain autograd would save the cast weight: with bf16 parameters computed in fp32
    that is an fp32 copy of every weight of the model held from forward to backward
    (2x the parameters' bytes, 16 GB at 4B parameters), which ZeRO-3 cannot free
    because it is not a parameter. Saving the parameter itself lets ZeRO-3 free it after
    forward and gather it again for backward; backward casts it once more.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight.to(grad.dtype)
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = (rows.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b


class Linear(nn.Linear):
    """``nn.Linear`` that computes in its input's dtype (parameters are cast to it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype:
            return F.linear(x, self.weight, self.bias)
        return _WidenedLinear.apply(x, self.weight, self.bias)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that computes in its input's dtype (parameters are cast to it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = Linear(config.n_embd, 3 * config.n_embd)
        self.proj = Linear(config.n_embd, config.n_embd)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim), the layout SDPA expects.
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide, GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = Linear(config.n_embd, 4 * config.n_embd)
        self.proj = Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``forward(input_ids)`` returns logits of shape (batch, seq, vocab);
    ``forward(input_ids, labels)`` returns the mean cross-entropy (fp32 scalar) of
    predicting ``labels`` (same shape as ``input_ids``; -100 entries are ignored).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        # Tie input and output embeddings: one Parameter shared by both modules.
        self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 initialisation.

        Residual-branch output projections are scaled by 1/sqrt(2·n_layer) so that the
        variance of the residual stream does not grow with depth.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def num_parameters(self, exclude_position_embeddings: bool = False) -> int:
        """Number of distinct parameters (the tied head is counted once)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_position_embeddings:
            total -= self.wpe.weight.numel()
        return total

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        seq = input_ids.shape[1]
        if seq > self.config.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds GPTConfig.block_size {self.config.block_size}"
            )
        # Packed samples restart the positions where a document starts (terascale.data).
        positions = torch.arange(seq, device=input_ids.device) if position_ids is None else position_ids
        dtype = compute_dtype(self.wte.weight.dtype, input_ids.device)
        x = self.drop((self.wte(input_ids) + self.wpe(positions)).to(dtype))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        return F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
        )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``prompt_ids`` autoregressively.

        ``prompt_ids`` is (seq,) or (batch, seq); the result has the same number of
        dimensions and ``seq + max_new_tokens`` positions. ``temperature == 0`` picks
        the most likely token (greedy); ``top_k`` restricts sampling to the k most
        likely tokens. Contexts longer than ``block_size`` are cropped to the last
        ``block_size`` tokens. Pass ``generator`` for reproducible samples.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        if prompt_ids.dim() not in (1, 2) or prompt_ids.shape[-1] == 0:
            raise ValueError(
                f"prompt_ids must be a non-empty (seq,) or (batch, seq) tensor, "
                f"got shape {tuple(prompt_ids.shape)}"
            )
        squeeze = prompt_ids.dim() == 1
        ids = prompt_ids.unsqueeze(0) if squeeze else prompt_ids
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self(ids[:, -self.config.block_size :])[:, -1, :].float()
                if temperature == 0:
                    next_id = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None and top_k < logits.shape[-1]:
                        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    next_id = torch.multinomial(probs, 1, generator=generator)
                ids = torch.cat([ids, next_id.to(ids.dtype)], dim=1)
        finally:
            self.train(was_training)
        return ids.squeeze(0) if squeeze else ids
