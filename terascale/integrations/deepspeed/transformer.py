"""``DeepSpeedTransformerLayer``: DeepSpeed's BERT encoder layer, in PyTorch.

DeepSpeed ships this layer as fused CUDA kernels; programs build it from a
:class:`DeepSpeedTransformerConfig` and load BERT weights into its flat parameters
(``attn_qkvw``, ``attn_ow``, ``attn_nw``, ``inter_w``, ``output_w``, ``norm_w`` and biases).
This is the same layer, with the same parameters, initialisation and math, as plain torch
operations (so autograd, ZeRO and any device apply):

- pre-LN (``pre_layer_norm``): ``h = x + Attn(LN_norm(x))``; ``y = h + FFN(LN_attn(h))``;
- post-LN: ``h = LN_attn(x + Attn(x))``; ``y = LN_norm(h + FFN(h))``;

where ``LN_attn`` uses ``attn_nw/attn_nb`` and ``LN_norm`` ``norm_w/norm_b``, attention is
multi-head softmax attention with BERT's additive mask, and the FFN uses the tanh
approximation of GELU, as DeepSpeed's kernel does. The kernels' memory options
(``normalize_invertible``, ``gelu_checkpoint``, ``attn_dropout_checkpoint``,
``stochastic_mode``) change what the kernels keep for backward, not the result; they are
accepted and the layer keeps what autograd keeps (use activation checkpointing to save memory).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class TransformerConfig:
    def __init__(self, batch_size: int, hidden_size: int, intermediate_size: int, heads: int,
                 attn_dropout_ratio: float, hidden_dropout_ratio: float, num_hidden_layers: int,
                 initializer_range: float) -> None:  # fmt: skip
        self.layer_id = -1
        self.batch_size, self.hidden_size, self.intermediate_size = batch_size, hidden_size, intermediate_size
        self.heads = heads
        self.attn_dropout_ratio, self.hidden_dropout_ratio = attn_dropout_ratio, hidden_dropout_ratio
        self.num_hidden_layers, self.initializer_range = num_hidden_layers, initializer_range


class DeepSpeedTransformerConfig(TransformerConfig):
    """The layer's sizes and options (DeepSpeed's names and defaults; ``-1``: unset)."""

    def __init__(self, batch_size: int = -1, hidden_size: int = -1, intermediate_size: int = -1, heads: int = -1,
                 attn_dropout_ratio: float = -1, hidden_dropout_ratio: float = -1, num_hidden_layers: int = -1,
                 initializer_range: float = -1, layer_norm_eps: float = 1e-12, local_rank: int = -1,
                 seed: int = -1, fp16: bool = False, pre_layer_norm: bool = True, normalize_invertible: bool = False,
                 gelu_checkpoint: bool = False, adjust_init_range: bool = True, attn_dropout_checkpoint: bool = False,
                 stochastic_mode: bool = False, return_tuple: bool = False, training: bool = True) -> None:  # fmt: skip
        super().__init__(batch_size, hidden_size,
                         intermediate_size if intermediate_size > 0 else 4 * hidden_size, heads,
                         attn_dropout_ratio, hidden_dropout_ratio, num_hidden_layers, initializer_range)  # fmt: skip
        self.fp16, self.pre_layer_norm, self.local_rank, self.seed = fp16, pre_layer_norm, local_rank, seed
        self.normalize_invertible, self.gelu_checkpoint = normalize_invertible, gelu_checkpoint
        self.adjust_init_range, self.test_gemm, self.layer_norm_eps = adjust_init_range, False, layer_norm_eps
        self.training, self.is_grad_enabled = training, True
        self.attn_dropout_checkpoint, self.stochastic_mode = attn_dropout_checkpoint, stochastic_mode
        self.return_tuple = return_tuple

    @classmethod
    def from_dict(cls, json_object: dict[str, Any]) -> DeepSpeedTransformerConfig:
        config = DeepSpeedTransformerConfig()
        for key, value in json_object.items():
            config.__dict__[key] = value
        return config

    @classmethod
    def from_json_file(cls, json_file: str) -> DeepSpeedTransformerConfig:
        with open(json_file, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class DeepSpeedTransformerLayer(nn.Module):
    """One encoder layer (see the module docstring). ``initial_weights`` / ``initial_biases``:
    BERT's eight tensors in DeepSpeed's order (query, key, value, attention output,
    attention LayerNorm, intermediate, output, output LayerNorm)."""

    layer_id = 0

    def __init__(self, config: DeepSpeedTransformerConfig, initial_weights: list[torch.Tensor] | None = None,
                 initial_biases: list[torch.Tensor] | None = None) -> None:  # fmt: skip
        super().__init__()
        if config.hidden_size <= 0 or config.heads <= 0 or config.hidden_size % config.heads:
            raise ValueError(f"hidden_size ({config.hidden_size}) must be a positive multiple of heads ({config.heads})")
        self.config = config
        self.config.layer_id = DeepSpeedTransformerLayer.layer_id
        DeepSpeedTransformerLayer.layer_id += 1
        h, inter = config.hidden_size, config.intermediate_size
        dtype = torch.half if config.fp16 else torch.float

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype))

        if initial_weights is None and initial_biases is None:
            self.attn_qkvw, self.attn_qkvb = p(3 * h, h), p(3 * h)
            self.attn_ow, self.attn_ob = p(h, h), p(h)
            self.attn_nw, self.attn_nb = p(h), p(h)
            self.inter_w, self.inter_b = p(inter, h), p(inter)
            self.output_w, self.output_b = p(h, inter), p(h)
            self.norm_w, self.norm_b = p(h), p(h)
            self.init_transformer_weights(config.adjust_init_range)
        else:
            if initial_weights is None or initial_biases is None:
                raise ValueError("give both initial_weights and initial_biases, or neither")
            w, b = initial_weights, initial_biases
            self.attn_qkvw = nn.Parameter(torch.cat([w[0].data, w[1].data, w[2].data]))
            self.attn_qkvb = nn.Parameter(torch.cat([b[0].data, b[1].data, b[2].data]))
            (self.attn_ow, self.attn_nw, self.inter_w, self.output_w,
             self.norm_w) = (nn.Parameter(t.data.clone()) for t in w[3:8])  # fmt: skip
            (self.attn_ob, self.attn_nb, self.inter_b, self.output_b,
             self.norm_b) = (nn.Parameter(t.data.clone()) for t in b[3:8])  # fmt: skip

    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """Normal(0, initializer_range) weights, the two output projections scaled down by
        ``sqrt(2 * num_hidden_layers)`` with ``adjust_init_range``; zero biases; unit norms."""
        std = self.config.initializer_range
        output_std = std / math.sqrt(2.0 * self.config.num_hidden_layers) if adjust_init_range else std
        with torch.no_grad():
            self.attn_qkvw.normal_(0.0, std)
            self.attn_ow.normal_(0.0, output_std)
            self.inter_w.normal_(0.0, std)
            self.output_w.normal_(0.0, output_std)
            for bias in (self.attn_qkvb, self.attn_ob, self.attn_nb, self.inter_b, self.output_b, self.norm_b):
                bias.zero_()
            self.attn_nw.fill_(1.0)
            self.norm_w.fill_(1.0)

    def _attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, seq, hidden = x.shape
        heads = self.config.heads
        qkv = F.linear(x, self.attn_qkvw, self.attn_qkvb).view(bsz, seq, 3, heads, hidden // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [bsz, heads, seq, head_dim]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hidden // heads)
        if mask is not None:
            scores = scores + mask.to(scores.dtype)
        probs = torch.softmax(scores, dim=-1)
        dropped = F.dropout(probs, self._ratio(self.config.attn_dropout_ratio), self.training)
        context = torch.matmul(dropped, v).transpose(1, 2).reshape(bsz, seq, hidden)
        out = F.linear(context, self.attn_ow, self.attn_ob)
        return F.dropout(out, self._ratio(self.config.hidden_dropout_ratio), self.training), probs

    @staticmethod
    def _ratio(r: float) -> float:
        return max(float(r), 0.0)  # -1: unset, no dropout

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(_gelu_tanh(F.linear(x, self.inter_w, self.inter_b)), self.output_w, self.output_b)
        return F.dropout(out, self._ratio(self.config.hidden_dropout_ratio), self.training)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                head_mask: Any = None, layer_head_mask: Any = None, encoder_hidden_states: Any = None,
                encoder_attention_mask: Any = None, past_key_value: Any = None, output_attentions: bool = False,
                grads: Any = None) -> Any:  # fmt: skip
        if encoder_hidden_states is not None or past_key_value is not None:
            raise ValueError("DeepSpeedTransformerLayer is an encoder layer: no cross-attention or key/value cache")
        eps = self.config.layer_norm_eps
        hidden = hidden_states.shape[-1:]
        if self.config.pre_layer_norm:
            attn, probs = self._attention(F.layer_norm(hidden_states, hidden, self.norm_w, self.norm_b, eps),
                                          attention_mask)  # fmt: skip
            h = hidden_states + attn
            out = h + self._ffn(F.layer_norm(h, hidden, self.attn_nw, self.attn_nb, eps))
        else:
            attn, probs = self._attention(hidden_states, attention_mask)
            h = F.layer_norm(hidden_states + attn, hidden, self.attn_nw, self.attn_nb, eps)
            out = F.layer_norm(h + self._ffn(h), hidden, self.norm_w, self.norm_b, eps)
        if output_attentions:
            return out, probs
        return (out,) if self.config.return_tuple else out
