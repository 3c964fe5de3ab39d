"""Ulysses attention inside a Hugging Face model, without model edits.

Transformers 5 models call their attention through a registry keyed by
``config._attn_implementation`` (``AttentionInterface``), with query, key and value as
``[batch, heads, seq, head_dim]`` after the rotary embedding, and build their masks through
a second registry keyed the same way. :func:`use_ulysses_attention` registers, under a name
of its own, the model's attention wrapped in the Ulysses exchange
([Note: the Ulysses exchange]) and switches that one model to it: another model in the same
process (an unsplit reference, say) keeps its own attention.

After the exchange each rank attends over whole sequences, so masks made for the local
slice do not apply. The model's sliced forward (``terascale.parallel.sequence.model``)
passes the whole sequences' mask down as the ``ulysses_mask`` keyword (None: plain causal,
``is_causal`` for SDPA, an additive mask for eager attention), built from the whole batch's
padding mask and position ids (packed sequences restart them:
:func:`terascale.parallel.sequence.data.full_mask`); a sliding window (Mistral, Qwen2's
sliding layers) is applied over the whole sequence too. Position ids must be the global
ones of the rank's slice (rotary embeddings read them).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed import ProcessGroup

from terascale.parallel.sequence.attention import ulysses_attention

_SUPPORTED = ("sdpa", "eager")


def use_ulysses_attention(model: nn.Module, group: ProcessGroup) -> str:
    """Make ``model``'s attention (SDPA or eager, as the model has it) Ulysses attention
    over ``group``; returns the attention implementation name registered for it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _SUPPORTED:
        raise ValueError(
            f"sequence parallelism wraps the model's attention, which must be one of {_SUPPORTED} (flash-attention "
            f"under sequence parallelism is not built yet); {type(model).__name__} uses {impl!r}: load it with "
            "attn_implementation='sdpa'"
        )
    attention = _ulysses(impl, group)
    name = f"terascale_ulysses_{impl}_{id(group)}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    model.set_attn_implementation(name)
    return name


MASK_KWARG = "ulysses_mask"  # the whole sequences' mask, passed down by the model's sliced forward


def _ulysses(impl: str, group: ProcessGroup):
    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        full = kwargs.pop(MASK_KWARG, _UNSET)
        if full is _UNSET and attention_mask is not None and not _is_plain_causal(attention_mask, query.shape[2]):
            raise ValueError(
                "sequence parallelism: this batch needs a padding or packed-sequence mask, which the model's "
                "local mask cannot give after the exchange; call the model through terascale.initialize (its "
                "forward builds the whole sequences' mask), or feed whole, unpadded sequences"
            )
        full = None if full is _UNSET else full
        window = kwargs.pop("sliding_window", None)
        inner = _inner_attention(impl, module)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            mask = _whole_mask(full, window, q.shape[2], q.device)
            if impl != "sdpa":
                mask = _additive(mask, q.shape[2], q.dtype, q.device)
            saved = module.num_key_value_groups
            module.num_key_value_groups = q.shape[1] // k.shape[1]  # the local ratio after the exchange
            try:
                out, _ = inner(module, q, k, v, mask, **kwargs)  # [b, S, H / P, d]
            finally:
                module.num_key_value_groups = saved
            return out.transpose(1, 2)

        out = ulysses_attention(query, key, value, attend, group)  # [b, H, s, d]
        return out.transpose(1, 2).contiguous(), None

    return attention


_UNSET = object()


def _whole_mask(full: torch.Tensor | None, window: int | None, length: int, device: torch.device) -> torch.Tensor | None:
    """The boolean [b|1, 1, S, S] mask over whole sequences (True: attend), or None for
    plain causal attention: ``full`` (padding, packed sequences) and a sliding ``window``
    (each query sees itself and the ``window - 1`` positions before it)."""
    if window is None or window >= length:
        return full
    index = torch.arange(length, device=device)
    near = (index[:, None] - index[None, :] < window) & (index[None, :] <= index[:, None])
    return near[None, None] if full is None else full & near


def _additive(mask: torch.Tensor | None, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive float mask eager attention takes: 0 where ``mask`` (default: causal)
    allows, the dtype's lowest value elsewhere."""
    if mask is None:
        return _causal_mask(length, dtype, device)
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)


def _inner_attention(impl: str, module: nn.Module):
    if impl == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__}'s module has no eager_attention_forward to wrap")
    return eager


def _is_plain_causal(mask: torch.Tensor, length: int) -> bool:
    """Whether ``mask`` (boolean or additive, [b, 1, s, s]) is the plain causal mask."""
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return bool((allowed == causal).all())


def _causal_mask(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive causal mask [1, 1, S, S] eager attention takes."""
    return torch.full((length, length), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)[None, None]
