"""Routing ([Note: routing]) against plain loops written from DeepSpeed's gate semantics."""

from __future__ import annotations

import math

import pytest
import torch

from terascale.moe.gating import JITTER_EPS, capacity, jitter, route


def _logits(s: int = 37, e: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(s, e, generator=torch.Generator().manual_seed(seed)) * 2


def _reference(logits: torch.Tensor, k: int, cap: int | None) -> tuple[list, list, list]:
    """Per token: experts, weights, slots (-1 dropped), by DeepSpeed's rules with a capacity
    (dropless: slots in token order), one route at a time."""
    probs = torch.softmax(logits.double(), dim=1)
    s, e = probs.shape
    if k <= 2:
        choice = [[int(probs[t].argmax())] for t in range(s)]
        if k == 2:
            for t in range(s):
                rest = probs[t].clone()
                rest[choice[t][0]] = -1
                choice[t].append(int(rest.argmax()))
    else:
        choice = [probs[t].topk(k).indices.tolist() for t in range(s)]
    slots = [[-1] * k for _ in range(s)]
    filled = [0] * e
    if cap is None:  # dropless: routes in token order
        for t in range(s):
            for j in range(k):
                x = choice[t][j]
                slots[t][j] = filled[x]
                filled[x] += 1
    elif k <= 2:  # choice by choice (first choices fill first), in token order
        for j in range(k):
            for t in range(s):
                x = choice[t][j]
                slots[t][j] = filled[x]
                filled[x] += 1
    else:  # per expert by descending probability, ties in route order
        routes = [(t, j) for t in range(s) for j in range(k)]
        routes.sort(key=lambda r: -float(probs[r[0], choice[r[0]][r[1]]]))
        for t, j in routes:
            x = choice[t][j]
            slots[t][j] = filled[x]
            filled[x] += 1
    if cap is not None:
        slots = [[x if x < cap else -1 for x in row] for row in slots]
    weights = []
    for t in range(s):
        w = [float(probs[t, choice[t][j]]) if slots[t][j] >= 0 else 0.0 for j in range(k)]
        if k >= 2:
            total = max(sum(w), torch.finfo(torch.float32).eps)
            w = [x / total for x in w]
        weights.append(w)
    return choice, weights, slots


@pytest.mark.parametrize("k,factor", [(1, None), (2, None), (3, None), (1, 0.5), (2, 0.7), (3, 0.6)])
def test_routes_follow_deepspeeds_rules(k, factor):
    logits = _logits()
    r = route(logits, k, capacity_factor=factor, min_capacity=2, use_rts=False, second_expert_sampling=False)
    cap = None if factor is None else capacity(37, 6, k, factor, 2)
    choice, weights, slots = _reference(logits, k, cap)
    assert r.capacity == cap
    assert r.expert.tolist() == choice
    assert r.slot.tolist() == slots
    torch.testing.assert_close(r.weight, torch.tensor(weights, dtype=torch.float32), rtol=1e-6, atol=1e-7)
    assert r.counts.tolist() == [sum(row.count(x) for row in choice) for x in range(6)]
    if factor is not None:
        assert bool((~r.kept).any()), "the capacity should drop something in this case"
        assert all(int((r.slot == c).sum()) <= 6 for c in range(cap))  # each slot at most once per expert


def test_capacity_is_deepspeeds_formula():
    assert capacity(100, 8, 1, 1.0, 4) == 13
    assert capacity(100, 8, 2, 1.0, 4) == 25
    assert capacity(10, 8, 1, 1.0, 4) == 4  # min_capacity
    assert capacity(100, 8, 3, 1.25, 4) == math.ceil(100 / 8 * 3 * 1.25)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_aux_loss_is_the_load_balance_product_and_differentiable(k):
    logits = _logits(e=8).requires_grad_(True)
    r = route(logits, k, second_expert_sampling=False)
    probs = torch.softmax(logits.detach(), dim=1)
    if k <= 2:
        frac = torch.nn.functional.one_hot(probs.argmax(1), 8).float().mean(0)
        expected = 8 * (probs.mean(0) * frac).sum()
    else:
        top = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=1).indices, 1.0)
        expected = 8 / k * (probs.mean(0) * top.mean(0)).sum()
    torch.testing.assert_close(r.aux_loss.detach(), expected)
    torch.testing.assert_close(r.z_loss.detach(), torch.logsumexp(logits.detach(), 1).square().mean())
    (r.aux_loss + r.z_loss + r.weight.sum()).backward()
    assert logits.grad is not None and bool(logits.grad.abs().sum() > 0)


def test_random_token_selection_keeps_capacity_tokens_per_expert():
    logits = _logits(s=64, e=4)
    gen = torch.Generator().manual_seed(3)
    r = route(logits, 1, capacity_factor=0.5, min_capacity=1, use_rts=True, generator=gen)
    assert r.capacity == 8
    for x in range(4):
        mine = r.slot[r.expert[:, 0] == x, 0]
        kept = mine[mine >= 0]
        assert kept.numel() == min(int(r.counts[x]), 8)
        assert sorted(kept.tolist()) == list(range(kept.numel()))
    # Top-1 weights are the chosen expert's probability, not renormalised.
    probs = torch.softmax(logits, 1).gather(1, r.expert)
    torch.testing.assert_close(r.weight, probs * r.kept)


def test_used_token_masks_tokens_out():
    logits = _logits(s=10, e=3)
    used = torch.tensor([1, 0] * 5)
    r = route(logits, 1, used_token=used)
    assert r.kept[:, 0].tolist() == [bool(u) for u in used.tolist()]
    assert int(r.counts.sum()) == 5


def test_bad_arguments_name_the_numbers():
    with pytest.raises(ValueError, match="k=5 must be between 1 and the number of experts \\(4\\)"):
        route(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        route(torch.zeros(3, 4), 1, noisy_gate_policy="Gauss")
    with pytest.raises(ValueError, match="tokens, experts"):
        route(torch.zeros(3), 1)


def test_jitter_scales_each_input_within_its_band():
    x = torch.randn(200, 16)
    y = jitter(x, torch.Generator().manual_seed(0))
    ratio = y / x
    assert bool((ratio >= 1 - JITTER_EPS).all() and (ratio <= 1 + JITTER_EPS).all())
    assert float(ratio.std()) > JITTER_EPS / 4  # noise, not a constant factor
