"""``SparseAttentionUtils``: fitting a Hugging Face BERT/RoBERTa to sparse attention.

Block-sparse attention needs sequences padded to a multiple of the block and, for longer
sequences than the model was trained on, longer position embeddings; these helpers do
both and swap a model's self-attention layers for :class:`BertSparseSelfAttention`
(keeping their query/key/value weights).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _encoder_owner(model: nn.Module) -> tuple[str, nn.Module]:
    for name in ("bert", "roberta"):
        if hasattr(model, name):
            return name, getattr(model, name)
    raise ValueError("SparseAttentionUtils supports BERT and RoBERTa models (a .bert or .roberta attribute); "
                     f"{type(model).__name__} has neither")  # fmt: skip


class SparseAttentionUtils:
    """Static helpers (see the module docstring)."""

    @staticmethod
    def extend_position_embedding(model: nn.Module, max_position: int) -> nn.Module:
        """Grow the position embeddings to ``max_position`` by repeating the trained ones
        (RoBERTa keeps its two leading padding positions)."""
        kind, owner = _encoder_owner(model)
        old = owner.embeddings.position_embeddings
        weight = old.weight.data
        offset = 2 if kind == "roberta" else 0
        original = weight.shape[0] - offset
        if max_position <= original:
            raise ValueError(f"max_position {max_position} must exceed the model's {original} positions")
        new = nn.Embedding(max_position + offset, weight.shape[1], dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            new.weight[:offset] = weight[:offset]
            for start in range(offset, max_position + offset, original):
                n = min(original, max_position + offset - start)
                new.weight[start : start + n] = weight[offset : offset + n]
        owner.embeddings.position_embeddings = new
        if hasattr(owner.embeddings, "position_ids"):
            owner.embeddings.register_buffer(
                "position_ids", torch.arange(max_position + offset, device=weight.device).expand((1, -1)),
                persistent=False)  # fmt: skip
        model.config.max_position_embeddings = max_position + offset
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: Any, max_position: int) -> Any:
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(model: nn.Module, max_position: int,
                                                                sparsity_config: Any = None) -> nn.Module:  # fmt: skip
        """Every encoder layer's self-attention becomes a :class:`BertSparseSelfAttention`
        with the same weights."""
        _, owner = _encoder_owner(model)
        model.config.max_position_embeddings = max_position
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, owner.encoder.layer, sparsity_config)
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(config: Any, layers: Any,
                                                                      sparsity_config: Any = None) -> Any:  # fmt: skip
        from terascale.integrations.deepspeed.sparse_attention import BertSparseSelfAttention, SparsityConfig

        sparsity_config = sparsity_config or SparsityConfig(num_heads=config.num_attention_heads)
        for layer in layers:
            old = layer.attention.self
            sparse = BertSparseSelfAttention(config, sparsity_config).to(old.query.weight.device, old.query.weight.dtype)
            sparse.query, sparse.key, sparse.value = old.query, old.key, old.value
            layer.attention.self = sparse
        return layers

    @staticmethod
    def pad_to_block_size(block_size: int, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                          token_type_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                          inputs_embeds: torch.Tensor | None, pad_token_id: int,
                          model_embeddings: Any) -> tuple:  # fmt: skip
        """Pad the sequence dimension to a multiple of ``block_size``: ids with
        ``pad_token_id``, masks and token types with 0, embeddings with the pad token's.
        Returns ``(pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)``."""
        batch, seq = input_ids.shape[:2] if input_ids is not None else inputs_embeds.shape[:2]
        pad_len = (block_size - seq % block_size) % block_size
        if pad_len > 0:
            device = input_ids.device if input_ids is not None else inputs_embeds.device
            pad_ids = torch.full((batch, pad_len), pad_token_id, dtype=torch.long, device=device)
            if inputs_embeds is not None:
                inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
            if input_ids is not None:
                input_ids = nn.functional.pad(input_ids, (0, pad_len), value=pad_token_id)
            if position_ids is not None:
                position_ids = nn.functional.pad(position_ids, (0, pad_len), value=pad_token_id)
            if attention_mask is not None:
                attention_mask = nn.functional.pad(attention_mask, (0, pad_len), value=0)
            if token_type_ids is not None:
                token_type_ids = nn.functional.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """The output without the ``pad_len`` positions :meth:`pad_to_block_size` added."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
