"""Small models and data shared by the engine tests, plus the single-process reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IN, HIDDEN, CLASSES = 12, 24, 5


class MLP(nn.Module):
    """Embedding + MLP classifier with an optional branch used only on some inputs."""

    def __init__(self, tied: bool = False, reuse: bool = False) -> None:
        super().__init__()
        self.reuse = reuse  # run ``blocks`` twice per forward (a module called several times)
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN))
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.rare = nn.Linear(HIDDEN, HIDDEN)  # used only when the caller asks for it
        self.tied = tied
        if tied:
            self.emb = nn.Linear(CLASSES, HIDDEN, bias=False)
            self.emb.weight = self.head.weight  # type: ignore[assignment]  # shape (C, H) transposed use below

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_rare: bool = False) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        if use_rare:
            h = h + self.rare(h)
        h = h + self.blocks(h)
        if self.reuse:
            h = h + self.blocks(h)
        if self.tied:
            # The head's weight is used twice: as the output layer and as an input projection.
            h = h + F.one_hot(y, CLASSES).to(h.dtype) @ self.head.weight
        logits = self.head(h)
        return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), y)


def make_model(seed: int = 0, tied: bool = False, frozen: bool = False, reuse: bool = False) -> MLP:
    """The MLP; ``frozen`` freezes the input layer (partial training, as with adapters)."""
    torch.manual_seed(seed)
    model = MLP(tied=tied, reuse=reuse)
    if frozen:
        model.inp.requires_grad_(False)
    return model


def make_data(steps: int, global_batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, global_batch, IN, generator=g)
    y = torch.randint(0, CLASSES, (steps, global_batch), generator=g)
    return x, y


def rare_step(step: int) -> bool:
    """Whether the 'rare' branch runs on optimizer step ``step`` (on every rank)."""
    return step % 2 == 1


def reference_train(
    steps: int,
    global_batch: int,
    *,
    lr: float,
    weight_decay: float,
    clip: float,
    tied: bool = False,
    use_rare: bool = False,
    dtype: torch.dtype = torch.float32,
    data_seed: int = 1,
    frozen: bool = False,
    reuse: bool = False,
    zero_unused_grads: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process PyTorch: full global batch per step, AdamW, clip_grad_norm_.

    ``zero_unused_grads`` gives a trainable parameter that got no gradient a zero one
    (ZeRO's semantics) instead of leaving it ``None`` (skipped by AdamW).
    """
    model = make_model(tied=tied, frozen=frozen, reuse=reuse).to(dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
    x, y = make_data(steps, global_batch, seed=data_seed)
    x = x.to(dtype)
    losses = []
    for s in range(steps):
        loss = model(x[s], y[s], use_rare=use_rare and rare_step(s))
        loss.backward()
        if zero_unused_grads:
            for p in trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
