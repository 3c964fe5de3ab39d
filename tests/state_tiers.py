"""Optimizer-state variants on every tier: one small model trained, checkpointed and resumed
per config (shared by the tests of 8-bit and bf16 optimizer states)."""

from __future__ import annotations

import torch


def model():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def batches(rank: int, steps: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)) for _ in range(steps)]


def train(engine, batches) -> list[float]:
    """A step per batch; inputs in the dtype the model computes in, the loss in fp32."""
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for x, y in batches:
        loss = (engine(x.to(dtype)).float() - y).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def tiers_rank(configs: list[dict], save_dir: str) -> list[dict]:
    """Per config: 6 steps with a checkpoint after 3, then a fresh engine resumed from it
    for steps 4-6; the losses, parameters, optimizer bytes (masters and state) and swap
    file bytes, and whether the resume repeated the parameters bit for bit."""
    import torch.distributed as dist

    import terascale

    out = []
    for k, config in enumerate(configs):
        engine, *_ = terascale.initialize(model=model(), config=config)
        data = batches(dist.get_rank(), 6)
        losses = train(engine, data[:3])
        engine.save_checkpoint(save_dir, tag=f"c{k}")
        losses += train(engine, data[3:])
        mem = engine.memory_breakdown()
        swapper = getattr(engine.model_state, "swapper", None)
        disk = swapper.nbytes_on_disk() if swapper is not None else 0
        params = {n: p.detach().clone() for n, p in engine.full_state_dict().items()}
        engine.destroy()
        engine, *_ = terascale.initialize(model=model(), config=config)
        engine.load_checkpoint(save_dir, tag=f"c{k}")
        resumed = train(engine, data[3:])
        resumed_params = engine.full_state_dict()
        engine.destroy()
        out.append({"losses": losses, "resumed": resumed, "params": params, "disk": disk,
                    "opt_bytes": mem["optimizer_state"], "master_bytes": mem["master_params"],
                    "resumed_equal": all(torch.equal(params[n], resumed_params[n]) for n in params)})  # fmt: skip
    return out
