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
    valid = torch.ones_like(choice, dtype=torch.bool)
    if used_token is not None:
        if k != 1:
            raise ValueError("used_token is only supported with k=1 (as in DeepSpeed's top-1 gate)")
        valid = (used_token.view(s, 1) != 0).expand(s, k)
    # Per-expert counts by bincount, never an [S, k, E] one-hot (128 MiB at 8k tokens,
    # top-8 of 256 experts).
    counts = torch.bincount(choice[valid], minlength=e)
    # Load balance: mean probability per expert times the fraction of tokens sent to it.
    me = probs.mean(dim=0)
    if k <= 2:
        first_share = torch.bincount(choice[:, 0][valid[:, 0]], minlength=e).float() / s
        aux_loss = e * (me * first_share).sum()
    else:
        aux_loss = e / k * (me * counts.float() / s).sum()
    if capacity_factor is None:
        slot = _rank_within_expert(choice.reshape(-1), valid.reshape(-1), e).view(s, k)
        cap = None
    else:
        cap = capacity(s, e, k, capacity_factor, min_capacity)
        if k == 1:
            priority = torch.rand(s, generator=generator, device=logits.device) if use_rts else None
            slot = _rank_within_expert(choice[:, 0], valid[:, 0], e, priority).view(s, 1)
        elif k == 2:  # first choices fill each expert before second choices
            slot = _rank_within_expert(choice.t().reshape(-1), valid.t().reshape(-1), e).view(k, s).t()
        else:  # per expert, the routes of highest probability
            slot = _rank_within_expert(choice.reshape(-1), valid.reshape(-1), e, weight.reshape(-1)).view(s, k)
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


def _rank_within_expert(
    expert: torch.Tensor, valid: torch.Tensor, num_experts: int, score: torch.Tensor | None = None
) -> torch.Tensor:
    """[R] routes' experts -> [R] each valid route's place among the valid routes of its
    expert: by descending ``score`` (ties in route order), or in route order without one;
    -1 for a route that is not valid. One sort, no [R, E] mask."""
    index = torch.arange(expert.numel(), device=expert.device)
    key = torch.where(valid, expert, num_experts)  # routes that are not valid sort last
    order = index if score is None else torch.argsort(score, descending=True, stable=True)
    order = order[torch.argsort(key[order], stable=True)]
    sizes = torch.bincount(key, minlength=num_experts + 1)
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.empty_like(index)
    rank[order] = index - starts[key[order]]
    return torch.where(valid, rank, -1)
