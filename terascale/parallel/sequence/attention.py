"""Attention over whole sequences from sequence slices: exchange, attend, exchange back.

[Note: key/value heads under Ulysses]
With grouped-query attention a model has ``H`` query heads and ``KV`` key/value heads,
query head ``i`` reading key/value head ``i // (H / KV)``. The exchange gives each of the
``P`` ranks ``H / P`` query heads; the key/value heads they read must travel with them.
When ``P`` divides ``KV`` they split as the queries do. Otherwise each key/value head is
repeated ``f = lcm(KV, P) / KV`` times first (``f = P / KV`` when ``KV`` divides ``P``, as
DeepSpeed does; the least common multiple also covers, e.g., 6 key/value heads over 4
ranks), so that the ``lcm(KV, P)`` heads split evenly and rank ``r``'s query heads find
their key/value heads among its share: the local ratio of query to key/value heads is
``H / lcm(KV, P)``. The backward of the repetition sums the replicas' gradients, which is
the key/value heads' gradient in the unsplit model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.parallel.sequence.exchange import heads_to_seq, seq_to_heads

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def kv_repeats(heads: int, kv_heads: int, sp: int) -> int:
    """How many times each key/value head is repeated before the exchange (see
    [Note: key/value heads under Ulysses]); raises ValueError naming the numbers when
    ``sp`` ranks cannot share ``heads`` query heads."""
    if heads % sp:
        raise ValueError(
            f"sequence parallelism over {sp} ranks needs the {heads} attention heads to split evenly; "
            f"choose a sequence-parallel size that divides {heads}"
        )
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads do not form groups over {kv_heads} key/value heads")
    return math.lcm(kv_heads, sp) // kv_heads


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attend: Attend,
    group: ProcessGroup,
) -> torch.Tensor:
    """Attention of this rank's sequence slice, computed over the whole sequences.

    ``query`` [b, H, s, d], ``key``/``value`` [b, KV, s, d]: this rank's ``s`` positions of
    sequences split over ``group`` in rank order. ``attend(q, k, v)`` is the model's
    attention on whole sequences for ``H / P`` query heads and their key/value heads
    (``H / lcm(KV, P)`` query heads per key/value head), returning [b, H / P, P * s, d];
    it masks as it would unsplit (causal positions are global after the exchange).
    Returns this rank's positions of every head, [b, H, s, d]. Differentiable; collective
    over ``group``."""
    sp = dist.get_world_size(group)
    repeats = kv_repeats(query.shape[1], key.shape[1], sp)
    if repeats > 1:
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)
    out = attend(seq_to_heads(query, group), seq_to_heads(key, group), seq_to_heads(value, group))
    return heads_to_seq(out, group)


class DistributedAttention(torch.nn.Module):
    """DeepSpeed-Ulysses' attention wrapper for a program's own attention (DeepSpeed's
    ``deepspeed.sequence.layer.DistributedAttention``).

    ``local_attention(q, k, v, *args, **kwargs)`` attends over whole sequences; its
    inputs and output keep the layout of the wrapper's inputs, where ``scatter_idx`` is the
    heads dim and ``gather_idx`` the sequence dim (the defaults, 2 and 0, are Megatron's
    ``[seq, batch, heads, head_dim]``; ``[batch, seq, heads, head_dim]`` is 2 and 1).
    ``forward(query, key, value, *args, **kwargs)`` takes this rank's sequence slice and
    returns its slice of the attention output. Key/value heads fewer than the ranks are
    repeated ([Note: key/value heads under Ulysses]); DeepSpeed's ``batch_dim_idx`` and
    ``rotary_pos_emb`` arguments are accepted by keyword (rotary embeddings are applied
    after the exchange, on whole sequences, by ``rotary_pos_emb(q, k)``). A
    ``sequence_process_group`` left None is the engine's sequence-parallel group, set by
    ``terascale.initialize`` (``sequence_parallel_size``)."""

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor],
        sequence_process_group: ProcessGroup | None = None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: object = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def forward(self, query, key, value, *args, batch_dim_idx: int | None = None, rotary_pos_emb=None, **kwargs):
        if self.spg is None:
            raise ValueError(
                "DistributedAttention has no sequence-parallel group: pass sequence_process_group, or train the "
                "model through terascale.initialize with sequence_parallel_size set"
            )
        sp = dist.get_world_size(self.spg)
        heads, seq = self.scatter_idx, self.gather_idx
        repeats = kv_repeats(query.shape[heads], key.shape[heads], sp)
        if repeats > 1:
            key = key.repeat_interleave(repeats, dim=heads)
            value = value.repeat_interleave(repeats, dim=heads)
        q, k, v = (seq_to_heads(t, self.spg, head_dim=heads, seq_dim=seq) for t in (query, key, value))
        if rotary_pos_emb is not None:
            q, k = rotary_pos_emb(q, k)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return heads_to_seq(context, self.spg, head_dim=heads, seq_dim=seq)
