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
