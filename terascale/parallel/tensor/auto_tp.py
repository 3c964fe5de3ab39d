"""Tensor parallelism for Hugging Face decoder models, without touching their code.

[Note: auto_tp]
Each transformer block becomes Megatron's two tensor-parallel regions: attention (q, k,
v column-parallel, each rank holding whole heads; o row-parallel) and the MLP (gate/up or
c_fc column-parallel, down or c_proj row-parallel). Each region costs one all-reduce in
forward (after the row-parallel layer) and one in backward (into the column-parallel
layers' input gradient). Embeddings, norms and the LM head stay replicated: every
tensor-parallel rank computes them on the same data, and because the column-parallel
layers all-reduce their input gradients, their gradients come out the same on every rank.

The attention code reshapes projections with ``-1`` heads, so with ``1/tp`` of the heads'
features it computes ``1/tp`` of the heads unchanged; only what it reads as a head count
must be divided. In the transformers this was written against (5.x) the Llama-family
attention reads none (``num_key_value_groups``, a ratio, stays valid); older versions'
``num_heads`` / ``num_key_value_heads`` / ``hidden_size`` attention attributes are divided
where present. GPT-2's
attention splits the fused ``c_attn`` output by ``split_size`` (the q/k/v width, now
``hidden/tp``); it and ``num_heads`` are divided. The model's ``config`` is left describing the full
model (it is what a checkpoint saves); a static KV cache sized from it would be wrong, the
default dynamic cache is fine. Dropout that the attention applies to its heads draws from
the default generator, the same on every rank (see [Note: dropout under tensor
parallelism]); sequence parallelism is not applied, since these models' attention
reshapes by the length of its input.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear, check_divisible
from terascale.parallel.tensor.parallelize import Colwise, ParallelStyle, Rowwise, parallelize_module

LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED = ("gpt2", *LLAMA_LIKE)

_LLAMA_PLAN: dict[str, ParallelStyle] = {
    "*.self_attn.q_proj": Colwise(),
    "*.self_attn.k_proj": Colwise(),
    "*.self_attn.v_proj": Colwise(),
    "*.self_attn.o_proj": Rowwise(),
    "*.mlp.gate_proj": Colwise(),
    "*.mlp.up_proj": Colwise(),
    "*.mlp.down_proj": Rowwise(),
}

_GPT2_PLAN: dict[str, ParallelStyle] = {
    "*.attn.c_attn": Colwise(fused=3),  # [q | k | v]: every rank keeps its heads of each
    "*.attn.c_proj": Rowwise(),
    "*.mlp.c_fc": Colwise(),
    "*.mlp.c_proj": Rowwise(),
}


def auto_tp(model: nn.Module, group: ProcessGroup) -> nn.Module:
    """Make a Hugging Face ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``
    or ``GPT2LMHeadModel`` (or their base models) tensor-parallel over ``group``, in place;
    returns ``model``. See [Note: auto_tp].

    Every rank of ``group`` calls it on the same full model (same weights) and afterwards
    feeds it the same inputs; each keeps its slices of the attention and MLP weights.
    Parameter names and state-dict keys are unchanged; ``sliced_parameters(model)`` lists
    the sliced ones. Sizes that the tensor-parallel size does not divide are a ValueError.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        found = model_type if model_type is not None else type(model).__name__
        raise ValueError(f"auto_tp supports Hugging Face models of type {', '.join(SUPPORTED)}; got {found}")
    if any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules()):
        raise ValueError("auto_tp: the model already has tensor-parallel layers")
    tp = dist.get_world_size(group)
    if model_type == "gpt2":
        _gpt2(model, config, group, tp)
    else:
        _llama_like(model, config, group, tp)
    return model


def _llama_like(model: nn.Module, config, group: ProcessGroup, tp: int) -> None:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    check_divisible("auto_tp", "num_attention_heads", heads, tp)
    check_divisible("auto_tp", "num_key_value_heads", kv_heads, tp)
    check_divisible("auto_tp", "intermediate_size", config.intermediate_size, tp)
    parallelize_module(model, group, _LLAMA_PLAN)
    for module in model.modules():
        if isinstance(getattr(module, "q_proj", None), ColumnParallelLinear):
            # what older transformers' attention modules (4.x) read as their head counts and
            # output width (``hidden_size`` there is num_heads * head_dim); 5.x has none
            for name in ("num_heads", "num_key_value_heads", "hidden_size"):
                if isinstance(getattr(module, name, None), int):
                    setattr(module, name, getattr(module, name) // tp)


def _gpt2(model: nn.Module, config, group: ProcessGroup, tp: int) -> None:
    if getattr(config, "add_cross_attention", False):
        raise ValueError("auto_tp: GPT-2 with cross-attention (add_cross_attention=True) is not supported")
    hidden = config.n_embd
    check_divisible("auto_tp", "n_head", config.n_head, tp)
    check_divisible("auto_tp", "n_embd", hidden, tp)
    check_divisible("auto_tp", "n_inner", config.n_inner or 4 * hidden, tp)
    parallelize_module(model, group, _GPT2_PLAN)
    for module in model.modules():
        if isinstance(getattr(module, "c_attn", None), ColumnParallelLinear):
            # c_attn's output is now [q | k | v] of this rank's heads, each hidden/tp wide
            module.split_size //= tp
            module.num_heads //= tp
