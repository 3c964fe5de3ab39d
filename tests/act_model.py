"""A small transformer-like model with dropout for the activation checkpointing tests, and
the plain PyTorch data-parallel reference it is compared with.

Randomness is part of the oracle: before every micro-batch both the reference and
terascale seed the CPU generator the same way (per step, micro-step and rank), so the
dropout masks of forward agree; a recompute that did not replay them exactly would give
other gradients.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

D, IN, OUT, TOKENS, MICRO = 16, 8, 4, 6, 2
STEPS = 3
LR, WD = 1e-2, 0.01


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    """``user_checkpoint``: the model checkpoints its own blocks with torch.utils.checkpoint
    (``"reentrant"``, ``"non_reentrant"``, or ``"full_recompute"``: non-reentrant without early
    stop), as models with gradient checkpointing do."""

    def __init__(self, layers: int = 4, user_checkpoint: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, D)
        self.blocks = nn.ModuleList(Block(D) for _ in range(layers))
        self.head = nn.Linear(D, OUT)
        self.user_checkpoint = user_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            if self.user_checkpoint and torch.is_grad_enabled():
                kwargs = {"use_reentrant": self.user_checkpoint == "reentrant"}
                if self.user_checkpoint == "full_recompute":  # no early stop: the block's forward runs to its end
                    kwargs["early_stop"] = False
                h = torch.utils.checkpoint.checkpoint(functools.partial(block, scale=0.5), h, **kwargs)
            else:
                h = block(h, scale=0.5)
        return self.head(h)


def make_net(seed: int = 0, user_checkpoint: str | None = None) -> Net:
    torch.manual_seed(seed)
    return Net(user_checkpoint=user_checkpoint)


def data(world: int, gas: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = STEPS * gas * world * MICRO
    return torch.randn(n, TOKENS, IN, generator=g), torch.randn(n, TOKENS, OUT, generator=g)


def micro_batch(x: torch.Tensor, step: int, micro: int, rank: int, world: int, gas: int) -> torch.Tensor:
    start = ((step * gas + micro) * world + rank) * MICRO
    return x[start : start + MICRO]


def seed_micro(step: int, micro: int, rank: int) -> None:
    torch.manual_seed(10_000 + 100 * step + 10 * micro + rank)


def reference(world: int, rank: int, gas: int, device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on this rank: its micro-batches, gradients averaged over ranks with an
    all-reduce, AdamW. Returns this rank's micro-batch losses and the final weights (on CPU)."""
    model = make_net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    x, y = data(world, gas)
    losses = []
    for step in range(STEPS):
        for micro in range(gas):
            seed_micro(step, micro, rank)
            out = model(micro_batch(x, step, micro, rank, world, gas).to(device))
            loss = F.mse_loss(out, micro_batch(y, step, micro, rank, world, gas).to(device))
            (loss / gas).backward()
            losses.append(loss.item())
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def train(engine, world: int, rank: int, gas: int) -> list[float]:
    """The same training through a terascale engine; returns this rank's micro-batch losses."""
    x, y = data(world, gas)
    losses = []
    for step in range(STEPS):
        for micro in range(gas):
            seed_micro(step, micro, rank)
            out = engine(micro_batch(x, step, micro, rank, world, gas))
            loss = F.mse_loss(out, micro_batch(y, step, micro, rank, world, gas).to(out.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def config(world: int, gas: int, stage: int, activation: dict, zero: dict | None = None, **extra) -> dict:
    return {
        "train_batch_size": MICRO * gas * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500,
                              **(zero or {})},
        "activation_checkpointing": activation,
        **extra,
    }
