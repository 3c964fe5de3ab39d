"""``deepspeed.ops.sparse_attention``: block-sparse self-attention, in PyTorch.

A *sparsity config* says which blocks of the attention matrix are computed: ``make_layout(seq_len)``
returns a ``[heads, seq_len // block, seq_len // block]`` 0/1 tensor (the layouts are DeepSpeed's:
fixed local windows with global blocks, variable windows, BigBird, block-sparse Longformer,
sliding windows, dense). :class:`SparseSelfAttention` computes softmax attention restricted to
the layout's blocks, with DeepSpeed's masks (key padding, attention mask, relative position
scores) and mask modes.

DeepSpeed runs this as Triton block-sparse kernels on the GPU; here the scores are
computed densely and the layout is applied as a mask, so the result is the same
(attention over exactly the layout's blocks) on any device and dtype, and memory is that of
dense attention ([Note: sparse attention as a masked dense product]).

[Note: sparse attention as a masked dense product]
A query row attends only to keys in the blocks its block-row has in the layout; a row whose
every allowed key is masked out (padding) gets zero output, as the block-sparse softmax of
an empty row does. Masked scores are -inf before the softmax, so a present block contributes
exactly what it does in a dense softmax over the present blocks alone.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

_DIRECTIONS = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> None:
    if attention not in _DIRECTIONS:
        raise ValueError(f"attention must be 'unidirectional' or 'bidirectional', got {attention!r}")


class SparsityConfig:
    """The base layout: nothing set. ``different_layout_per_head=False`` gives every head
    the first head's layout."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False) -> None:
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        if seq_len % self.block != 0:
            raise ValueError(f"sequence length {seq_len} must be divisible by the block size {self.block}")
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        if not self.different_layout_per_head:
            layout[1 : self.num_heads, :, :] = layout[0, :, :]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_head_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)

    def set_head_layout(self, h: int, layout: torch.Tensor) -> None:
        """Set head ``h``'s blocks in ``layout`` (each layout its own parts, in DeepSpeed's order)."""


class DenseSparsityConfig(SparsityConfig):
    """Every block: dense attention (for comparing against the sparse layouts)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:, :, :] = 1
        return layout


class FixedSparsityConfig(SparsityConfig):
    """Local windows of ``num_local_blocks`` blocks, and in each window its last
    ``num_global_blocks`` blocks attended to by every row (and, with
    ``horizontal_global_attention``, attending to every column); with
    ``num_different_global_patterns`` > 1 the heads take different global blocks."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1) -> None:  # fmt: skip
        super().__init__(num_heads, block, different_layout_per_head)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(f"num_local_blocks ({num_local_blocks}) must be divisible by "
                             f"num_global_blocks ({num_global_blocks})")  # fmt: skip
        _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention is only for bidirectional attention")
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head=True")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(f"num_different_global_patterns ({num_different_global_patterns}) can be at most "
                             f"num_local_blocks // num_global_blocks = {num_local_blocks // num_global_blocks}")
        self.num_local_blocks, self.num_global_blocks = num_local_blocks, num_global_blocks
        self.attention, self.horizontal_global_attention = attention, horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        for i in range(0, num_blocks, self.num_local_blocks):
            end = min(i + self.num_local_blocks, num_blocks)
            for row in range(i, end):
                last = row + 1 if self.attention == "unidirectional" else end
                layout[h, row, i:last] = 1
        return layout

    def _set_global_block(self, h: int, layout: torch.Tensor, first: int, last: int) -> None:
        first_row = 0 if self.attention == "bidirectional" else first
        layout[h, first_row:, first:last] = 1
        if self.horizontal_global_attention:
            layout[h, first:last, :] = 1

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        first_global = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * self.num_global_blocks
        full_windows_end = num_blocks - (num_blocks % self.num_local_blocks)
        for i in range(first_global, full_windows_end, self.num_local_blocks):
            self._set_global_block(h, layout, i, i + self.num_global_blocks)
        if full_windows_end < num_blocks:  # the last, partial window
            start = min(full_windows_end + first_global, num_blocks - self.num_global_blocks)
            self._set_global_block(h, layout, start, start + self.num_global_blocks)
        return layout

    def set_head_layout(self, h: int, layout: torch.Tensor) -> None:
        self.set_local_layout(h, layout)
        self.set_global_layout(h, layout)


def _random_blocks(h: int, layout: torch.Tensor, count: int, unidirectional: bool) -> None:
    num_blocks = layout.shape[1]
    if num_blocks < count:
        raise ValueError(f"num_random_blocks ({count}) must be at most the number of blocks per row ({num_blocks})")
    for row in range(num_blocks):
        pool = range(0, row + 1) if unidirectional else range(num_blocks)
        cols = random.sample(pool, min(count, len(pool)))
        layout[h, row, cols] = 1


def _sliding_window(h: int, layout: torch.Tensor, window_blocks: int, unidirectional: bool = False) -> None:
    num_blocks = layout.shape[1]
    if num_blocks < window_blocks:
        raise ValueError(f"the sliding window ({window_blocks} blocks) must be at most the number of blocks "
                         f"per row ({num_blocks})")  # fmt: skip
    w = window_blocks // 2
    for row in range(num_blocks):
        start = max(0, row - w)
        end = row + 1 if unidirectional else min(row + w + 1, num_blocks)
        layout[h, row, start:end] = 1


def _global_ranges(indices: list[int], end_indices: list[int] | None) -> list[tuple[int, int]]:
    if end_indices is None:
        return [(i, i + 1) for i in indices]
    if len(indices) != len(end_indices):
        raise ValueError("global_block_indices and global_block_end_indices must have the same length")
    for start, end in zip(indices, end_indices):
        if start >= end:
            raise ValueError(f"global block range [{start}, {end}) is empty: start must be below end")
    return list(zip(indices, end_indices))


class VariableSparsityConfig(SparsityConfig):
    """Local windows of the sizes in ``local_window_blocks`` (the last size repeating),
    global blocks at ``global_block_indices`` (ranges with ``global_block_end_indices``) and
    ``num_random_blocks`` random blocks per row."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: list[int] | None = None,
                 global_block_indices: list[int] | None = None, global_block_end_indices: list[int] | None = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False) -> None:  # fmt: skip
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention is only for bidirectional attention")
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks or [4])
        self.global_block_indices = list(global_block_indices if global_block_indices is not None else [0])
        self.global_block_end_indices = global_block_end_indices
        _global_ranges(self.global_block_indices, global_block_end_indices)
        self.attention, self.horizontal_global_attention = attention, horizontal_global_attention

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _random_blocks(h, layout, self.num_random_blocks, unidirectional=False)
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        start, i = 0, 0  # the listed window sizes in turn, then the last one repeating
        while start < num_blocks:
            size = self.local_window_blocks[min(i, len(self.local_window_blocks) - 1)]
            end = min(start + size, num_blocks)
            for row in range(start, end):
                last = row + 1 if self.attention == "unidirectional" else end
                layout[h, row, start:last] = 1
            start, i = end, i + 1
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices):
            if start >= num_blocks:
                continue
            end = min(end, num_blocks)
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            first_row = 0 if self.attention == "bidirectional" else start
            layout[h, first_row:, start:end] = 1
        return layout

    def set_head_layout(self, h: int, layout: torch.Tensor) -> None:
        self.set_random_layout(h, layout)
        self.set_local_layout(h, layout)
        self.set_global_layout(h, layout)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird: ``num_random_blocks`` random blocks per row, a sliding window of
    ``num_sliding_window_blocks`` blocks, and the first ``num_global_blocks`` blocks global
    (rows and columns)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional") -> None:  # fmt: skip
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        self.num_random_blocks, self.num_sliding_window_blocks = num_random_blocks, num_sliding_window_blocks
        self.num_global_blocks, self.attention = num_global_blocks, attention

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _random_blocks(h, layout, self.num_random_blocks, self.attention == "unidirectional")
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(h, layout, self.num_sliding_window_blocks)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        if num_blocks < self.num_global_blocks:
            raise ValueError(f"num_global_blocks ({self.num_global_blocks}) must be at most the number of blocks "
                             f"per row ({num_blocks})")  # fmt: skip
        layout[h, 0 : self.num_global_blocks, :] = 1
        layout[h, :, 0 : self.num_global_blocks] = 1
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])
        return layout

    def set_head_layout(self, h: int, layout: torch.Tensor) -> None:
        self.set_random_layout(h, layout)
        self.set_sliding_window_layout(h, layout)
        self.set_global_layout_itc(h, layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer: a sliding window and global blocks (rows and columns) at
    ``global_block_indices`` (ranges with ``global_block_end_indices``)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: list[int] | None = None,
                 global_block_end_indices: list[int] | None = None, attention: str = "bidirectional") -> None:  # fmt: skip
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices if global_block_indices is not None else [0])
        self.global_block_end_indices = global_block_end_indices
        _global_ranges(self.global_block_indices, global_block_end_indices)
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(h, layout, self.num_sliding_window_blocks)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices):
            if start < num_blocks:
                end = min(end, num_blocks)
                layout[h, start:end, :] = 1
                layout[h, :, start:end] = 1
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])
        return layout

    def set_head_layout(self, h: int, layout: torch.Tensor) -> None:
        self.set_sliding_window_layout(h, layout)
        self.set_global_layout(h, layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window of ``num_sliding_window_blocks`` blocks (causal when unidirectional)."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional") -> None:  # fmt: skip
        super().__init__(num_heads, block)
        _check_attention(attention)
        self.num_sliding_window_blocks, self.attention = num_sliding_window_blocks, attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(h, layout, self.num_sliding_window_blocks, self.attention == "unidirectional")
        return layout

    def set_head_layout(self, h: int, layout: torch.Tensor) -> None:
        self.set_sliding_window_layout(h, layout)


class SparseSelfAttention(nn.Module):
    """Softmax attention over the blocks of ``sparsity_config``'s layout (see the module
    docstring). ``forward(query, key, value)`` takes ``[batch, heads, seq, head_dim]``.
    ``key_padding_mask`` (``[batch, seq]``) and ``attn_mask`` (``[seq, seq]``) are added to the
    scores in mode ``"add"`` and keep where nonzero in mode ``"mul"``; ``rpe`` is added."""

    def __init__(self, sparsity_config: SparsityConfig | None = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048) -> None:  # fmt: skip
        super().__init__()
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in ("add", "mul"):
                raise ValueError(f"{name} must be 'add' or 'mul', got {mode!r}")
        self.sparsity_config = sparsity_config if sparsity_config is not None else SparsityConfig(num_heads=4)
        self.key_padding_mask_mode, self.attn_mask_mode = key_padding_mask_mode, attn_mask_mode
        self.max_seq_length = max_seq_length
        # The layout is fixed per sequence length once made (random blocks included): cached.
        self._layouts: dict[int, torch.Tensor] = {}

    def get_layout(self, L: int) -> torch.Tensor:  # noqa: N803 - DeepSpeed's argument name
        if L % self.sparsity_config.block != 0:
            raise ValueError(f"sequence length {L} must be divisible by the block size {self.sparsity_config.block}")
        if L > self.max_seq_length:
            raise ValueError(f"sequence length {L} is above max_seq_length {self.max_seq_length}")
        if L not in self._layouts:
            self._layouts[L] = self.sparsity_config.make_layout(L)
        return self._layouts[L]

    @staticmethod
    def _additive(mask: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
        if mode == "add":
            return mask.to(dtype)
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(mask == 0, float("-inf")).expand(mask.shape)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if query.dim() != 4 or key.shape != query.shape or value.shape[:3] != query.shape[:3]:
            raise ValueError("query, key and value must be [batch, heads, seq, head_dim] of one shape")
        bsz, heads, seq, head_dim = query.shape
        if heads != self.sparsity_config.num_heads:
            raise ValueError(f"{heads} heads in the inputs, {self.sparsity_config.num_heads} in the sparsity config")
        block = self.sparsity_config.block
        layout = self.get_layout(seq).to(query.device).bool()
        allowed = layout.repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)  # [heads, seq, seq]
        scores = torch.matmul(query, key.transpose(-2, -1)) * head_dim**-0.5
        if rpe is not None:
            scores = scores + rpe.to(scores.dtype)
        if key_padding_mask is not None:
            kpm = key_padding_mask.reshape(bsz, seq) if key_padding_mask.numel() == bsz * seq else key_padding_mask
            scores = scores + self._additive(kpm, self.key_padding_mask_mode, scores.dtype)[:, None, None, :]
        if attn_mask is not None:
            scores = scores + self._additive(attn_mask, self.attn_mask_mode, scores.dtype)
        scores = scores.masked_fill(~allowed, float("-inf"))
        # Rows with no allowed, unmasked key give zeros ([Note: sparse attention as a masked dense product]).
        empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
        probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        return torch.matmul(probs.to(value.dtype), value)


class BertSparseSelfAttention(nn.Module):
    """BERT's self-attention (query/key/value projections) over :class:`SparseSelfAttention`:
    ``forward(hidden_states, attention_mask)`` -> the context ``[batch, seq, hidden]``;
    ``attention_mask`` is the key padding mask (additive)."""

    def __init__(self, config: Any, sparsity_config: SparsityConfig | None = None) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(f"hidden size {config.hidden_size} is not a multiple of the number of attention "
                             f"heads {config.num_attention_heads}")  # fmt: skip
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=config.num_attention_heads)
        self.sparse_self_attention = SparseSelfAttention(sparsity_config)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))
        context = self.sparse_self_attention(q, k, v, key_padding_mask=attention_mask)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:-2], self.all_head_size)


from terascale.integrations.deepspeed.sparse_attention_utils import SparseAttentionUtils  # noqa: E402

__all__ = ["BSLongformerSparsityConfig", "BertSparseSelfAttention", "BigBirdSparsityConfig", "DenseSparsityConfig",
           "FixedSparsityConfig", "LocalSlidingWindowSparsityConfig", "SparseAttentionUtils", "SparseSelfAttention",
           "SparsityConfig", "VariableSparsityConfig"]  # fmt: skip
