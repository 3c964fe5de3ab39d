"""FlatParamGroup: layout, shards, gather/free round trips, autograd across a free, reduce-scatter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_ranks
from terascale.zero import FlatLayout


def test_layout_pads_to_the_world_and_fragments_cover_every_element_once():
    layout = FlatLayout.build([("a", (5,)), ("b", (3,)), ("c", (7,))], world_size=4)
    assert (layout.numel, layout.shard_numel, layout.padded_numel) == (15, 4, 16)
    assert layout.shard_range(3) == (12, 16)
    # Rank 1 holds a[4:5] then b[0:3]; rank 3 holds c[4:7] and one padding element.
    assert [(f.slot, f.start, f.end, f.shard_offset) for f in layout.fragments(1)] == [(0, 4, 5, 0), (1, 0, 3, 1)]
    assert [(f.slot, f.start, f.end, f.shard_offset) for f in layout.fragments(3)] == [(2, 4, 7, 0)]
    covered = {i: [] for i in range(3)}
    for rank in range(4):
        for f in layout.fragments(rank):
            covered[f.slot].extend(range(f.start, f.end))
    assert {i: sorted(v) for i, v in covered.items()} == {0: list(range(5)), 1: list(range(3)), 2: list(range(7))}


def test_layout_rejects_empty_group():
    with pytest.raises(ValueError, match="at least one parameter"):
        FlatLayout.build([], world_size=2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3))


def _rank_checks(kept: bool):
    import torch.distributed as dist

    from terascale.comm import init_distributed
    from terascale.zero import FlatParamGroup, ShardState
    from terascale.zero.flat_group import FullBuffers

    ctx = init_distributed()
    rank, world = ctx.rank, ctx.world_size
    model = _model()
    named = list(model.named_parameters())
    before = {n: p.detach().clone() for n, p in named}
    objects = [p for _, p in named]
    # Kept memory is exercised by a second group of the same size taking it in between.
    buffers = FullBuffers(0) if kept else None  # as the engine builds: nothing kept yet
    group = FlatParamGroup(named, ctx.dp_group, buffers=buffers)
    other = FlatParamGroup(list(_model().named_parameters()), ctx.dp_group, buffers=buffers)
    if kept:
        buffers.max_idle_bytes = 1 << 20
    # A non-persistent group starts sharded: parameters hold no elements until gathered.
    assert group.state is ShardState.SHARDED and all(p.numel() == 0 for _, p in named)
    group.unshard()

    # The user's Parameter objects and names survive; their data now lives in the buffer.
    assert [p for _, p in model.named_parameters()] == objects
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
        assert p.untyped_storage().data_ptr() == group.full_buffer.untyped_storage().data_ptr()
    flat = torch.cat([before[n].reshape(-1) for n, _ in named])
    padded = torch.cat([flat, flat.new_zeros(group.layout.padded_numel - flat.numel())])
    lo, hi = group.layout.shard_range(rank)
    assert torch.equal(group.shard, padded[lo:hi])
    for p, f in group.owned_fragments():
        assert torch.equal(group.shard[f.shard_offset : f.shard_offset + f.numel], p.detach().reshape(-1)[f.start : f.end])

    # Autograd's saved views stay valid across a free and re-gather, including views that
    # are not the parameters themselves (the transpose here), whose tensors autograd keeps.
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    ref_model = _model()
    (ref_model(x).square().sum() + (x @ ref_model[0].weight.t()).sum()).backward()
    loss = model(x).square().sum() + (x @ model[0].weight.t()).sum()
    address = group.full_buffer.untyped_storage().data_ptr()
    group.reshard()
    assert group.state is ShardState.SHARDED and group.full_buffer.untyped_storage().nbytes() == 0
    if kept:
        # The freed memory is kept and serves the other group's gather (which overwrites
        # it); this group then gathers into fresh memory, where its saved views must follow.
        nbytes = group.layout.padded_numel * 4
        assert buffers.idle_bytes == nbytes
        other.unshard()
        assert buffers.reused == 1 and buffers.idle_bytes == 0
        assert other.full_buffer.untyped_storage().data_ptr() == address
    # A sharded parameter has no elements: using it fails on the shape, never reads freed memory.
    assert model[0].weight.numel() == 0
    with pytest.raises(RuntimeError):
        model(x)
    group.unshard(async_op=True)
    assert group.state in (ShardState.GATHERING, ShardState.UNSHARDED)
    group.wait()
    assert group.state is ShardState.UNSHARDED
    if kept:
        assert buffers.reused == 1 and group.full_buffer.untyped_storage().data_ptr() != address
    loss.backward()
    if kept:
        other.reshard()
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)

    # Shards gather in rank order: mark each shard with its rank and read them back.
    group.reshard()
    with torch.no_grad():
        group.shard.fill_(float(rank))
    group.unshard()
    expected = torch.arange(world, dtype=torch.float32).repeat_interleave(group.layout.shard_numel)
    assert torch.equal(group.full_buffer, expected)
    assert torch.equal(model[0].weight.reshape(-1), expected[: model[0].weight.numel()])

    # A modification of the full parameters reaches the shard (and the next gather).
    with torch.no_grad():
        model[2].bias.fill_(42.0)
    group.update_shard_from_full()
    group.reshard()
    group.unshard()
    assert torch.equal(model[2].bias, torch.full((3,), 42.0))

    # A persistent group keeps its full buffer; its shard is a view of it, and a regather
    # after the shard changed updates every rank in place.
    model2 = _model()
    persistent = FlatParamGroup(list(model2.named_parameters()), ctx.dp_group, persistent=True)
    assert persistent.state is ShardState.UNSHARDED
    assert persistent.shard.data_ptr() == persistent.full_buffer[lo:hi].data_ptr()
    with torch.no_grad():
        persistent.shard.fill_(float(rank))
    persistent.regather()
    assert torch.equal(persistent.full_buffer, expected)
    dist.barrier()
    return repr(group)


# Keeping full buffers moves memory between storages (UntypedStorage._swap_data_ptr_, torch
# newer than 2.11); where it is missing the engine does not keep them (keeps_full_buffers).
_KEEPS = pytest.mark.skipif(not hasattr(torch.UntypedStorage, "_swap_data_ptr_"),
                            reason="this torch cannot move memory between storages (2.11 and older)")


@pytest.mark.parametrize(("world", "kept"), [(1, False), (3, False), pytest.param(3, True, marks=_KEEPS)])
def test_flat_group_round_trips(world, kept):
    # World 3 pads (74 elements -> 75) and splits parameters across shards. With ``kept``
    # the full buffers' memory is kept between gathers ([Note: kept full buffers]).
    reprs = run_ranks(_rank_checks, world, kept)
    assert all("unsharded" in r for r in reprs)


@_KEEPS
def test_kept_full_buffers_stay_within_their_bound_and_serve_their_size():
    from terascale.zero.flat_group import FullBuffers

    buffers = FullBuffers(max_idle_bytes=100)
    first, second, large = torch.UntypedStorage(60), torch.UntypedStorage(60), torch.UntypedStorage(200)
    second_address = second.data_ptr()
    buffers.release(first)
    buffers.release(second)  # displaces the longer-idle first: 120 bytes exceed the bound
    buffers.release(large)  # larger than the bound: freed
    assert (first.nbytes(), second.nbytes(), large.nbytes(), buffers.idle_bytes) == (0, 0, 0, 60)
    other_size = torch.UntypedStorage(0)
    buffers.fill(other_size, 40)  # no kept memory of this size: a fresh allocation
    assert other_size.nbytes() == 40 and buffers.reused == 0 and buffers.idle_bytes == 60
    target = torch.UntypedStorage(0)
    buffers.fill(target, 60)
    assert target.data_ptr() == second_address and buffers.reused == 1 and buffers.idle_bytes == 0
