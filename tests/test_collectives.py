"""Flat all-gather and reduce-scatter (point-to-point on gloo) give the collectives' results."""

from __future__ import annotations

import pytest

from distributed import run_ranks


def _collectives_rank() -> None:
    import torch
    import torch.distributed as dist

    from terascale.comm import all_gather_flat, init_distributed, reduce_scatter_flat

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    n = 1000
    for dtype in (torch.float32, torch.bfloat16):
        # Rank r contributes ``r + 1`` times a base tensor every rank can build.
        base = (torch.arange(world * n) % 8).to(dtype)  # small integers: sums are exact in bf16
        expected_sum = base.float() * sum(range(1, world + 1))

        # Several reduce-scatters in flight at once, each in place or into a separate output.
        fulls = [base * (rank + 1) * (k + 1) for k in range(3)]
        outs = [fulls[0][rank * n : (rank + 1) * n], torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)]
        works = [reduce_scatter_flat(o, f, group, async_op=True) for o, f in zip(outs, fulls)]
        for w in works:
            w.wait()
        for k, out in enumerate(outs):
            want = (expected_sum * (k + 1))[rank * n : (rank + 1) * n].to(dtype)
            torch.testing.assert_close(out, want, rtol=0, atol=0)

        # All-gathers in flight together, in place and from a separate shard.
        shard = torch.full((n,), float(rank + 1), dtype=dtype)
        gathered = [torch.zeros(world * n, dtype=dtype) for _ in range(2)]
        gathered[1][rank * n : (rank + 1) * n].copy_(shard)
        works = [
            all_gather_flat(gathered[0], shard, group, async_op=True),
            all_gather_flat(gathered[1], gathered[1][rank * n : (rank + 1) * n], group, async_op=True),
        ]
        for w in works:
            w.wait()
        want = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(n).to(dtype)
        for g in gathered:
            torch.testing.assert_close(g, want, rtol=0, atol=0)
        # Blocking form.
        out = torch.empty(n, dtype=dtype)
        assert reduce_scatter_flat(out, base.clone(), group) is None
        torch.testing.assert_close(out, (base.float() * world)[rank * n : (rank + 1) * n].to(dtype))


@pytest.mark.parametrize("world", [2, 3])
def test_flat_collectives_match_their_definition(world):
    run_ranks(_collectives_rank, world)
