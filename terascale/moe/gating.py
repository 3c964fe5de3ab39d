"""Top-k routing of tokens to experts: which experts each token goes to, with what weight,
and (with a capacity) which routes are dropped.

[Note: routing]
A router scores ``S`` tokens against ``E`` experts (``logits``, computed in fp32) and
picks ``k`` experts per token. Its result is per *route* (token, choice): the expert, the
combine weight, and the route's slot in its expert's buffer, or -1 where the route was
dropped. Everything downstream (the dispatch, the expert computation, the combine) reads
routes, never the dense ``[S, E, C]`` masks that early MoE code built.

Two regimes:

- **dropless** (``capacity_factor=None``): every route is kept; an expert takes as many
  tokens as route to it, and the dispatch exchanges uneven counts. Slots are the routes'
  positions in their expert's group, in token order.
- **capacity** (DeepSpeed's ``drop_tokens=True``): each expert takes at most
  ``C = max(ceil(S / E * k * capacity_factor), min_capacity)`` routes on this rank.
  Which routes exceed ``C`` follows DeepSpeed's gates:

  - top-1: per expert, the ``C`` tokens with the highest random priority (``use_rts``)
    or the first ``C`` in token order; the weight is the chosen expert's softmax
    probability, not renormalised;
  - top-2: first choices fill each expert before second choices, in token order; the
    two kept weights are renormalised to sum to one (a token whose second route was
    dropped weighs its first at 1);
  - top-k (k > 2): per expert, the ``C`` routes with the highest probability; the kept
    weights of a token renormalised to sum to one.

  Dropless top-1 keeps the softmax probability as the weight; dropless top-k (k >= 2)
  renormalises the k probabilities, as the capacity gates do when nothing is dropped.

The load-balancing loss is DeepSpeed's: ``E * sum_e mean_s(p[s, e]) * f_e`` with ``f_e``
the fraction of tokens whose *first* choice is ``e`` (top-1 and top-2), or
``E / k * ...`` with ``f_e`` the fraction of tokens that have ``e`` among their k
(k > 2); computed before any drop. The z-loss (ST-MoE) is ``mean_s(logsumexp(logits)^2)``.
``counts`` is the number of routes per expert before drops (DeepSpeed's ``exp_counts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NOISE_POLICIES = ("Jitter", "RSample")
JITTER_EPS = 1e-2


@dataclass
class Routes:
    """Routing of ``S`` tokens with ``k`` choices each (see [Note: routing])."""

    expert: torch.Tensor  # [S, k] int64: the expert of each route
    weight: torch.Tensor  # [S, k] fp32: its combine weight (0 where dropped)
    slot: torch.Tensor  # [S, k] int64: its position in the expert's buffer, -1 where dropped
    capacity: int | None  # C, or None when dropless
    aux_loss: torch.Tensor  # 0-d fp32, differentiable in the logits
    z_loss: torch.Tensor  # 0-d fp32, differentiable in the logits
    counts: torch.Tensor  # [E] int64: routes per expert before drops

    @property
    def kept(self) -> torch.Tensor:
        """[S, k] bool: the routes that reach their expert."""
        return self.slot >= 0


def capacity(tokens: int, experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's expert capacity: ``max(ceil(tokens / experts * k * factor), min_capacity)``."""
    return max(math.ceil(tokens / experts * k * capacity_factor), min_capacity)


def jitter(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` times uniform noise in ``[1 - 1e-2, 1 + 1e-2]`` (DeepSpeed's 'Jitter' policy)."""
    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return x * (1.0 - JITTER_EPS + 2.0 * JITTER_EPS * noise)


def route(
    logits: torch.Tensor,
    k: int,
    *,
    capacity_factor: float | None = None,
    min_capacity: int = 4,
    use_rts: bool = True,
    noisy_gate_policy: str | None = None,
    second_expert_sampling: bool = True,
    normalize_topk: bool | None = None,
    used_token: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Routes:
    """Route the ``S`` tokens of ``logits`` ([S, E], any float dtype; computed in fp32) to
    ``k`` experts each. ``capacity_factor=None`` is dropless; otherwise DeepSpeed's capacity
    rules apply (see [Note: routing]). ``noisy_gate_policy='RSample'`` picks top-1 experts
    by Gumbel-perturbed logits; ``second_expert_sampling`` does the same for top-2's second
    choice (both training-time options: pass ``None``/``False`` in eval). ``'Jitter'`` acts
    on the router's input, not its logits: the caller applies :func:`jitter` before the
    gate, and routing is otherwise unchanged. ``normalize_topk``
    overrides whether the kept weights of a token are renormalised to sum to one (default:
    for ``k >= 2``). ``used_token`` ([S], 0/1) masks tokens out of the routing (top-1, as
    DeepSpeed does). Noise draws from ``generator`` (default: the device's global RNG)."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    s, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"k={k} must be between 1 and the number of experts ({e})")
    if noisy_gate_policy not in (None, "None", *NOISE_POLICIES):
        raise ValueError(f"noisy_gate_policy must be None, 'Jitter' or 'RSample', got {noisy_gate_policy!r}")
    logits = logits.float()
    probs = F.softmax(logits, dim=1)
    z_loss = torch.logsumexp(logits, dim=1).square().mean()
    if k == 1 and noisy_gate_policy == "RSample":
        choice = (logits + _gumbel(logits, generator)).argmax(dim=1, keepdim=True)
    elif k == 2:
        first = probs.argmax(dim=1, keepdim=True)
        scores = logits + _gumbel(logits, generator) if second_expert_sampling else logits
        second = scores.scatter(1, first, float("-inf")).argmax(dim=1, keepdim=True)
        choice = torch.cat([first, second], dim=1)
    else:
        choice = probs.topk(k, dim=1).indices
    weight = probs.gather(1, choice)
    one_hot = F.one_hot(choice, e)  # [S, k, E]
    if used_token is not None:
        if k != 1:
            raise ValueError("used_token is only supported with k=1 (as in DeepSpeed's top-1 gate)")
        one_hot = one_hot * used_token.to(one_hot.dtype).view(s, 1, 1)
    counts = one_hot.sum(dim=(0, 1))
    # Load balance: mean probability per expert times the fraction of tokens sent to it.
    me = probs.mean(dim=0)
    if k <= 2:
        aux_loss = e * (me * one_hot[:, 0].float().mean(dim=0)).sum()
    else:
        aux_loss = e / k * (me * one_hot.sum(dim=1).float().mean(dim=0)).sum()
    if capacity_factor is None:
        slot = _positions(one_hot.flatten(0, 1)).view(s, k)
        if used_token is not None:
            slot = slot.masked_fill(used_token.view(s, 1) == 0, -1)
        cap = None
    else:
        cap = capacity(s, e, k, capacity_factor, min_capacity)
        if k == 1:
            slot = _top1_slots(one_hot[:, 0], cap, use_rts, generator).view(s, 1)
        elif k == 2:
            slot = _positions(one_hot.transpose(0, 1).flatten(0, 1)).view(k, s).t()
        else:
            slot = _topk_slots(one_hot, weight, cap)
        slot = slot.masked_fill(slot >= cap, -1)
    kept = slot >= 0
    weight = weight * kept
    normalize = k >= 2 if normalize_topk is None else normalize_topk
    if normalize:
        weight = weight / weight.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)
    return Routes(choice, weight, slot, cap, aux_loss, z_loss, counts)


def _gumbel(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    u = torch.rand(like.shape, generator=generator, device=like.device, dtype=like.dtype)
    tiny = torch.finfo(like.dtype).tiny
    return -torch.log(-torch.log(u.clamp(tiny, 1.0 - 1e-7)))


def _positions(one_hot: torch.Tensor) -> torch.Tensor:
    """[R, E] one-hot rows -> [R] each row's index among the rows of its expert (in row
    order), -1 for an all-zero row."""
    pos = one_hot.cumsum(dim=0) - 1
    return torch.where(one_hot.bool(), pos, -1).amax(dim=1)


def _top1_slots(mask: torch.Tensor, cap: int, use_rts: bool, generator: torch.Generator | None) -> torch.Tensor:
    """[S, E] one-hot -> [S] slot: per expert the ``cap`` tokens of highest random priority
    (``use_rts``) or the first ``cap`` in token order keep slots 0..; the rest get ``cap``."""
    if not use_rts:
        return _positions(mask)
    priority = torch.rand(mask.shape, generator=generator, device=mask.device) * mask
    # Rank of each token among its expert's tokens by descending priority.
    order = priority.argsort(dim=0, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(mask.shape[0], device=mask.device)
                                             .unsqueeze(1).expand_as(order))  # fmt: skip
    return torch.where(mask.bool(), rank, -1).amax(dim=1)


def _topk_slots(one_hot: torch.Tensor, weight: torch.Tensor, cap: int) -> torch.Tensor:
    """[S, k, E] one-hot, [S, k] probabilities -> [S, k] slot: per expert its routes ranked
    by descending probability (ties in route order)."""
    s, k, e = one_hot.shape
    flat = one_hot.flatten(0, 1)  # [R, E]
    score = torch.where(flat.bool(), weight.reshape(-1, 1), -1.0)
    order = score.argsort(dim=0, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(s * k, device=flat.device)
                                             .unsqueeze(1).expand_as(order))  # fmt: skip
    return torch.where(flat.bool(), rank, -1).amax(dim=1).view(s, k)
