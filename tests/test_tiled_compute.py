"""Sequence tiles ([Note: tiled compute]): the MLP and the loss computed a tile at a time
give the whole-sequence results and gradients, each parameter's gradient arriving once,
also under ZeRO-3 on two ranks."""

from __future__ import annotations

import torch
from torch import nn

from distributed import run_ranks
from terascale.activation.tiled import tile_mlp, tiled_cross_entropy


class SwiGLU(nn.Module):
    def __init__(self, h: int = 8, i: int = 24) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(h, i, bias=False), nn.Linear(h, i), nn.Linear(i, h)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def test_tiled_mlp_equals_the_whole_sequence_and_each_parameter_gets_one_gradient():
    torch.manual_seed(0)
    mlp = SwiGLU()
    x = torch.randn(2, 10, 8)
    tangent = torch.randn(2, 10, 8)
    calls = {n: 0 for n, _ in mlp.named_parameters()}
    for n, p in mlp.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: calls.__setitem__(n, calls[n] + 1))
    want_x = x.clone().requires_grad_(True)
    (mlp(want_x) * tangent).sum().backward()
    want = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    mlp.zero_grad()
    calls = dict.fromkeys(calls, 0)
    got_x = x.clone().requires_grad_(True)
    whole = mlp(x).detach()
    handle = tile_mlp(mlp, tiles=3)  # 10 positions: tiles of 3, 3, 4
    out = mlp(got_x)
    torch.testing.assert_close(out, whole)
    (out * tangent).sum().backward()
    torch.testing.assert_close(got_x.grad, want_x.grad)
    for n, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)
    assert set(calls.values()) == {1}, calls
    handle.remove()
    assert "forward" not in vars(mlp)


def test_a_tiles_recompute_runs_under_the_autocast_its_forward_ran_under():
    # torch_autocast covers the engine's forward; the tiles are recomputed in backward,
    # outside it, and must compute in the same dtype (as torch.utils.checkpoint does).
    from terascale.activation.tiled import tiled

    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    seen = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        return lin(t)

    x = torch.randn(2, 6, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiled(fn, x, params=list(lin.parameters()), tiles=2)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert seen == [True] * 4  # two tiles in forward, two recomputed
    want = torch.autograd.grad(lin(x.detach().to(torch.bfloat16).float()).sum(), lin.weight)[0]
    torch.testing.assert_close(lin.weight.grad, want, rtol=2e-2, atol=2e-2)
    seen.clear()
    tiled(fn, x, params=list(lin.parameters()), tiles=2).sum().backward()
    assert seen == [False] * 4  # and without autocast, none


def test_tiled_cross_entropy_is_the_summed_loss_without_whole_logits():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    head = nn.Linear(8, 50, bias=False)
    labels = torch.randint(0, 50, (2, 9))
    labels[:, 6:] = -100  # the last tile has nothing to count
    want = nn.functional.cross_entropy(head(hidden).flatten(0, 1), labels.reshape(-1), reduction="sum")
    want.backward()
    want_h, want_w = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    got = tiled_cross_entropy(hidden, head.weight, labels, tiles=3)
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(hidden.grad, want_h)
    torch.testing.assert_close(head.weight.grad, want_w)


def _zero3_rank(tiles: int) -> dict:
    import torch.distributed as dist

    import terascale
    from terascale.comm import init_distributed

    init_distributed()
    rank = dist.get_rank()

    class Head(nn.Linear):
        """The output layer and the loss in one module: the loss reads its own weight."""

        def forward(self, h, y):
            return tiled_cross_entropy(h, self.weight, y, tiles, bias=self.bias) / y.numel()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.blocks, self.head = nn.Linear(6, 8), nn.ModuleList(SwiGLU() for _ in range(2)), Head(8, 5)

        def forward(self, x, y):
            h = self.inp(x)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h, y)

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.05,
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    net = Net()
    for block in net.blocks:
        if tiles > 1:
            tile_mlp(block, tiles)
    engine, *_ = terascale.initialize(model=net, config=config)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x, y = torch.randn(2, 7, 6, generator=g), torch.randint(0, 5, (2, 7), generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "state": engine.full_state_dict()}


def test_tiles_train_like_the_whole_sequence_under_zero3():
    whole, tiled = run_ranks(_zero3_rank, 2, 1)[0], run_ranks(_zero3_rank, 2, 3)[0]
    torch.testing.assert_close(torch.tensor(tiled["losses"]), torch.tensor(whole["losses"]), rtol=1e-5, atol=1e-6)
    for k, v in whole["state"].items():
        torch.testing.assert_close(tiled["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
