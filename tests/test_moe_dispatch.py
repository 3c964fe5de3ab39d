"""Expert-parallel dispatch ([Note: expert-parallel dispatch]) against the same experts run
in one process: outputs, and gradients of the tokens, the router and the experts."""

from __future__ import annotations

import pytest

from distributed import run_ranks


def _model(e: int, m: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    gate = nn.Linear(m, e, bias=False)
    experts = nn.ModuleList(nn.Sequential(nn.Linear(m, 2 * m), nn.GELU(), nn.Linear(2 * m, m)) for _ in range(e))
    return gate, experts


def _tokens(rank: int, s: int, m: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(s, m, generator=g), torch.randn(s, m, generator=g)


def _moe(x, gate, experts, k, factor, group, num_experts):
    from terascale.moe.dispatch import combine, dispatch, run_experts
    from terascale.moe.gating import route

    routes = route(gate(x), k, capacity_factor=factor, min_capacity=1, use_rts=False, second_expert_sampling=False)
    rows, per_expert, record = dispatch(x, routes.expert, num_experts, group, routes.kept)
    return combine(run_experts(rows, per_expert, experts), routes.weight, record)


def _dispatch_rank(k: int, factor: float | None, e: int) -> None:
    import torch
    import torch.distributed as dist

    from terascale.comm import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    m = 8  # ranks hold different numbers of tokens: 13 + 4 * rank
    local = e // world
    # Reference: every rank's tokens through all experts in this one process.
    gate, experts = _model(e, m)
    xs = [_tokens(r, 13 + 4 * r, m) for r in range(world)]
    ref_x = [x.clone().requires_grad_(True) for x, _ in xs]
    loss = sum((_moe(x, gate, experts, k, factor, None, e) * t).sum() for x, (_, t) in zip(ref_x, xs))
    loss.backward()
    # Expert-parallel: this rank's tokens, this rank's experts.
    ep_gate, all_experts = _model(e, m)
    mine = all_experts[rank * local : (rank + 1) * local]
    x = xs[rank][0].clone().requires_grad_(True)
    out = _moe(x, ep_gate, mine, k, factor, dist.group.WORLD, e)
    (out * xs[rank][1]).sum().backward()
    torch.testing.assert_close(out, _moe(xs[rank][0], gate, experts, k, factor, None, e), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_x[rank].grad, rtol=1e-5, atol=1e-6)
    for got, want in zip(mine.parameters(), experts[rank * local : (rank + 1) * local].parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    dist.all_reduce(ep_gate.weight.grad)  # each rank's router saw only its own tokens
    torch.testing.assert_close(ep_gate.weight.grad, gate.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world,k,factor", [(2, 2, None), (2, 1, 0.6), (4, 2, 0.8)])
def test_expert_parallel_equals_one_process(world, k, factor):
    run_ranks(_dispatch_rank, world, k, factor, 8)


def test_one_rank_keeps_every_route_and_checks_shapes():
    import torch

    from terascale.moe.dispatch import dispatch
    from terascale.moe.gating import route

    routes = route(torch.randn(5, 3), 1)
    rows, per_expert, _ = dispatch(torch.randn(5, 4), routes.expert, 3, None, routes.kept)
    assert sum(per_expert) == 5 and rows.shape == (5, 4)
    # Routes not kept (an index past the experts, as Hugging Face's padding sentinel) stay home.
    kept = torch.tensor([[True], [False], [True], [True], [False]])
    rows, per_expert, _ = dispatch(torch.randn(5, 4), routes.expert, 3, None, kept)
    assert sum(per_expert) == 3 and rows.shape == (3, 4)
    with pytest.raises(ValueError, match="5 tokens but routes for 4"):
        dispatch(torch.randn(5, 4), route(torch.randn(4, 3), 1).expert, 3, None)
