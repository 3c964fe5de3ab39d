"""Lion from the config (``"type": "Lion"``, DeepSpeed's FusedLion names and defaults) at
every ZeRO stage and offload tier, against plain PyTorch with Lion written from the paper
(Chen et al., 2023): ``w ← w·(1 - lr·wd) - lr·sign(β₁m + (1-β₁)g)``, then
``m ← β₂m + (1-β₂)g``."""

from __future__ import annotations

import os

import torch
from torch import nn

from distributed import run_ranks

STEPS, MICRO, LR, WD, BETAS = 4, 2, 1e-3, 0.1, (0.9, 0.99)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, MICRO * world, 8, generator=g), torch.randn(STEPS, MICRO * world, 4, generator=g)


def reference(world: int) -> dict[str, torch.Tensor]:
    model = net()
    x, y = data(world)
    momenta = [torch.zeros_like(p) for p in model.parameters()]
    for s in range(STEPS):
        model.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        with torch.no_grad():
            for p, m in zip(model.parameters(), momenta):
                p.mul_(1 - LR * WD).sub_(LR * torch.sign(BETAS[0] * m + (1 - BETAS[0]) * p.grad))
                m.mul_(BETAS[1]).add_(p.grad, alpha=1 - BETAS[1])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(world: int, cases: list[tuple[int, dict]]) -> list:
    import terascale

    rank = int(os.environ["RANK"])
    out = []
    for stage, zero in cases:
        config = {"train_batch_size": MICRO * world, "train_micro_batch_size_per_gpu": MICRO,
                  "optimizer": {"type": "Lion", "params": {"lr": LR, "weight_decay": WD, "betas": list(BETAS)}},
                  "zero_optimization": {"stage": stage, "sub_group_size": 50, **zero}}  # fmt: skip
        engine, optimizer, _, _ = terascale.initialize(model=net(), config=config)
        x, y = data(world)
        for s in range(STEPS):
            lo = rank * MICRO
            engine.backward(nn.functional.mse_loss(engine(x[s, lo : lo + MICRO]), y[s, lo : lo + MICRO]))
            engine.step()
        states = {len(v) for v in optimizer.state.values()}
        out.append((engine.full_state_dict(), states))
        engine.destroy()
    return out


def test_lion_matches_the_reference_at_every_stage_and_tier(tmp_path) -> None:
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    cases = [(0, {}), (1, {}), (2, {"offload_optimizer": {"device": "cpu"}}), (3, {}), (3, {"offload_optimizer": nvme})]
    ref = reference(2)
    for rank_results in run_ranks(train, 2, 2, cases):
        for (state, kinds), case in zip(rank_results, cases):
            assert kinds <= {1}, f"{case}: Lion keeps one state buffer"  # (NVMe: swapped out, none bound)
            for k, v in ref.items():
                torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=f"{case}: {k}")
