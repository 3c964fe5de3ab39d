"""TiledLinear: the same arithmetic as nn.Linear, one tile gathered at a time under ZeRO-3,
and zero_optimization.tile_linear_above tiling a model's big layers without model changes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks
from terascale.zero import TiledLinear, tile_linears
from terascale.zero.tiling import split_sizes


@pytest.mark.parametrize(("in_splits", "out_splits"), [(1, 1), (3, 2), (2, 5), (10, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_tiled_linear_equals_linear_forward_and_backward(in_splits: int, out_splits: int, bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(10, 7, bias=bias)
    tiled = TiledLinear(10, 7, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=linear)
    x = torch.randn(3, 4, 10, requires_grad=True)
    linear(x).square().sum().backward()
    want_x, x.grad = x.grad, None
    tiled(x).square().sum().backward()
    torch.testing.assert_close(x.grad, want_x, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        tiled_grads = {"weight": torch.cat([torch.cat([t.weight.grad for t in row], 1) for row in tiled.linears], 0)}
        if bias:
            tiled_grads["bias"] = torch.cat([row[-1].bias.grad for row in tiled.linears])
    torch.testing.assert_close(tiled_grads["weight"], linear.weight.grad, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(tiled_grads["bias"], linear.bias.grad, rtol=1e-6, atol=1e-6)
        assert all(row[j].bias is None for row in tiled.linears for j in range(in_splits - 1))
    # DeepSpeed's names: the grid is ``linears`` (its state dict keys), the chunk boundaries
    # ``in_parts``/``out_parts``, and tile [i][j] holds W[out_parts[i]:out_parts[i+1], in_parts[j]:...].
    assert tiled.in_parts[0] == 0 and tiled.in_parts[-1] == 10 and len(tiled.out_parts) == out_splits + 1
    i, j = out_splits - 1, in_splits - 1
    block = linear.weight[tiled.out_parts[i] : tiled.out_parts[i + 1], tiled.in_parts[j] : tiled.in_parts[j + 1]]
    assert torch.equal(tiled.linears[i][j].weight, block) and "linears.0.0.weight" in tiled.state_dict()
    assert [[tuple(t.weight.shape) for t in row] for row in tiled.linears][0][0] == (
        split_sizes(7, out_splits)[0], split_sizes(10, in_splits)[0])  # fmt: skip


def test_already_split_input_and_uncombined_outputs() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(9, 6)
    tiled = TiledLinear(9, 6, in_splits=3, out_splits=2, input_is_already_split=True, combine_out_splits=False)
    tiled.copy_params_from(linear)
    x = torch.randn(5, 9)
    outs = tiled(list(x.split(split_sizes(9, 3), dim=-1)))
    assert isinstance(outs, list) and len(outs) == 2
    torch.testing.assert_close(torch.cat(outs, -1), linear(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="expects 3 input chunks"):
        tiled([x])
    with pytest.raises(ValueError, match="does not fit"):
        tiled.copy_params_from(nn.Linear(6, 9))
    with pytest.raises(ValueError, match="cannot split 9 features into 10"):
        TiledLinear(9, 6, in_splits=10)


def test_tile_linears_keeps_state_dict_keys_and_ties() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(50, 16)
    model = nn.ModuleDict({"emb": emb, "up": nn.Linear(16, 64), "down": nn.Linear(64, 16), "head": nn.Linear(16, 50)})
    model["head"].weight = emb.weight  # tied: stays a plain Linear
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert tile_linears(model, above=300) == ["up", "down"]
    assert isinstance(model["up"], TiledLinear) and type(model["head"]) is nn.Linear
    after = model.state_dict()
    assert list(after) == list(before)
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    assert all(t.weight.numel() <= 300 for row in model["up"].linears for t in row)
    changed = {k: v + 1 for k, v in before.items()}
    model.load_state_dict(changed)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, changed[k], rtol=0, atol=0)


# -- under ZeRO-3 on 2 ranks ----------------------------------------------------------------------


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ProbeLinear.probe()
        return grad


class ProbeLinear(nn.Linear):
    """A tile that samples the gathered tile bytes when it runs, in forward and in backward."""

    probe = staticmethod(lambda: None)

    def forward(self, x):
        ProbeLinear.probe()
        return _Probe.apply(super().forward(x))


class Net(nn.Module):
    def __init__(self, tiled: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 48)
        self.big = nn.Linear(48, 60)
        self.head = nn.Linear(60, 4)
        if tiled:  # after the others: the tiles' own initialisation draws random numbers
            self.big = TiledLinear(48, 60, in_splits=4, out_splits=3, linear_cls=ProbeLinear, init_linear=self.big)

    def forward(self, x):
        return self.head(F.gelu(self.big(self.embed(x))))


def _train_both(engine, plain: nn.Module, rank: int, world: int) -> None:
    """3 steps: the engine on this rank's rows, ``plain`` on the global batch in one process."""
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        out = engine(x[mine])
        engine.backward(F.mse_loss(out, y[mine].to(out.device)))
        engine.step()
        F.mse_loss(plain(x), y).backward()
        opt.step()
        opt.zero_grad()


def _zero3_tiled_rank() -> float:
    import terascale
    from terascale.zero import ShardState

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = Net(tiled=True)
    torch.manual_seed(0)
    plain = Net(tiled=False)
    config = {
        "train_batch_size": 4 * world, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                              "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0},
    }  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)
    state = engine.model_state
    tiles = {id(t) for row in model.big.linears for t in row}
    tile_groups = [fg for plan, fg in zip(state.plans, state.groups) if id(plan.module) in tiles]
    assert len(tile_groups) == 12
    peak = [0]

    def probe() -> None:
        live = sum(fg.layout.padded_numel * 4 for fg in tile_groups if fg.state is not ShardState.SHARDED)
        peak[0] = max(peak[0], live)

    ProbeLinear.probe = staticmethod(probe)
    _train_both(engine, plain, rank, world)
    weights = engine.full_state_dict()
    engine.destroy()
    assert "big.linears.1.2.weight" in weights
    joined = TiledLinear(48, 60, in_splits=4, out_splits=3)
    joined.load_state_dict({k[4:]: v for k, v in weights.items() if k.startswith("big.")})
    got = {**{f"big.{k}": v for k, v in joined.joined().items()}, **{k: v for k, v in weights.items() if "tiles" not in k}}
    for name, want in plain.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    largest_tile = max(fg.layout.padded_numel * 4 for fg in tile_groups)
    return peak[0] / largest_tile


def test_zero3_gathers_one_tile_at_a_time_and_matches_the_untiled_layer() -> None:
    for ratio in run_ranks(_zero3_tiled_rank, 2):
        assert 0 < ratio <= 1.2, ratio


def _tile_above_rank(stage: int) -> dict:
    import terascale

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    config = {
        "train_batch_size": 4 * world, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "tile_linear_above": 1000, "stage3_param_persistence_threshold": 0},
    }  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)
    assert isinstance(model[2], TiledLinear) and isinstance(model[0], nn.Linear)
    _train_both(engine, plain, rank, world)
    weights = engine.full_state_dict()
    engine.destroy()
    want = plain.state_dict()
    assert list(weights) == list(want), "the untiled layer's keys"
    for k, v in want.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage} {k}: {m}")
    return {"tiles": len(list(model[2].linears.modules()))}


@pytest.mark.parametrize("stage", [0, 3])
def test_tile_linear_above_tiles_big_layers_without_model_changes(stage: int) -> None:
    run_ranks(_tile_above_rank, 2, stage)
