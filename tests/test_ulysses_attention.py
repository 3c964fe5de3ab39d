"""Ulysses attention ([Note: the Ulysses exchange], [Note: key/value heads under Ulysses])
against the same attention on whole sequences in one process: outputs and the gradients of
queries, keys and values, with and without grouped-query attention."""

from __future__ import annotations

import pytest

from distributed import run_ranks

# (query heads, key/value heads): MHA, GQA splitting evenly, GQA replicated (KV < sp),
# replicated by lcm (6 kv heads over 4 ranks), multi-query.
CASES = {2: [(8, 8), (8, 2), (4, 1)], 4: [(8, 8), (8, 2), (12, 6), (8, 1)]}


def _attend(q, k, v):
    """Causal attention with grouped key/value heads, on whole sequences."""
    import torch.nn.functional as F

    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True)


def _rank() -> None:
    import torch
    import torch.distributed as dist

    from terascale.comm import init_distributed
    from terascale.parallel.sequence.attention import ulysses_attention
    from terascale.parallel.sequence.exchange import heads_to_seq, seq_to_heads

    init_distributed()
    rank, sp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    b, s, d = 2, 4, 8
    # The exchange alone: a round trip is the identity, and seq_to_heads gives whole sequences.
    full = torch.randn(b, 8, sp * s, d, generator=torch.Generator().manual_seed(1))
    mine = full[:, :, rank * s : (rank + 1) * s]
    heads = seq_to_heads(mine, group)
    torch.testing.assert_close(heads, full[:, rank * 8 // sp : (rank + 1) * 8 // sp], rtol=0, atol=0)
    torch.testing.assert_close(heads_to_seq(heads, group), mine, rtol=0, atol=0)
    # [b, s, H, d] layout named by its dims.
    other = seq_to_heads(mine.transpose(1, 2), group, head_dim=2, seq_dim=1)
    torch.testing.assert_close(other, heads.transpose(1, 2), rtol=0, atol=0)
    # DeepSpeed's wrapper on Megatron's [seq, batch, heads, head_dim] layout.
    from terascale.parallel.sequence.attention import DistributedAttention

    def sbhd(q, k, v):  # whole-sequence attention in [s, b, h, d]
        return _attend(*(t.permute(1, 2, 0, 3) for t in (q, k, v))).permute(2, 0, 1, 3)

    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(sp * s, b, n, d, generator=g) for n in (8, 2, 2))
    wrapped = DistributedAttention(sbhd, group)
    got = wrapped(*(t[rank * s : (rank + 1) * s] for t in (q, k, v)), batch_dim_idx=1)
    torch.testing.assert_close(got, sbhd(q, k, v)[rank * s : (rank + 1) * s], rtol=1e-5, atol=1e-6)
    for h, kv in CASES[sp]:
        g = torch.Generator().manual_seed(h * 100 + kv)
        q, k, v = (torch.randn(b, n, sp * s, d, generator=g) for n in (h, kv, kv))
        tangent = torch.randn(b, h, sp * s, d, generator=g)
        ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = _attend(*ref)
        (out * tangent).sum().backward()
        local = [t[:, :, rank * s : (rank + 1) * s].clone().requires_grad_(True) for t in (q, k, v)]
        got = ulysses_attention(*local, _attend, group)
        (got * tangent[:, :, rank * s : (rank + 1) * s]).sum().backward()
        name = f"H={h} KV={kv} sp={sp}"
        torch.testing.assert_close(got, out[:, :, rank * s : (rank + 1) * s], rtol=1e-5, atol=1e-6, msg=name)
        for mine_t, ref_t in zip(local, ref):
            torch.testing.assert_close(mine_t.grad, ref_t.grad[:, :, rank * s : (rank + 1) * s], rtol=1e-5, atol=1e-6,
                                       msg=name)  # fmt: skip


@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_attention_equals_whole_sequence_attention(sp):
    run_ranks(_rank, sp)


def test_heads_that_do_not_split_are_refused_with_the_numbers():
    from terascale.parallel.sequence.attention import kv_repeats

    assert kv_repeats(8, 8, 2) == 1 and kv_repeats(8, 2, 4) == 2 and kv_repeats(12, 6, 4) == 2 and kv_repeats(8, 1, 4) == 4
    with pytest.raises(ValueError, match="over 4 ranks needs the 6 attention heads to split evenly"):
        kv_repeats(6, 6, 4)
