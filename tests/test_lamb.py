"""Lamb against a step-by-step plain-Python reference of DeepSpeed's FusedLamb math."""

from __future__ import annotations

import math

import pytest
import torch

from terascale.optim import Lamb


def reference_lamb(weights, grads_per_step, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                   bias_correction=True, eps_inside_sqrt=False, weight_decay=0.0,
                   max_coeff=10.0, min_coeff=0.01, max_grad_norm=0.0, scale=1.0):
    """Run LAMB on lists of floats; returns final weights and the per-step trust ratios."""
    b1, b2 = betas
    w = [list(x) for x in weights]
    m = [[0.0] * len(x) for x in weights]
    v = [[0.0] * len(x) for x in weights]
    all_coeffs = []
    for t, grads in enumerate(grads_per_step, start=1):
        divisor = scale
        if max_grad_norm > 0:
            norm = math.sqrt(sum(g * g for gs in grads for g in gs))
            clip = (norm / scale + 1e-6) / max_grad_norm
            if clip > 1:
                divisor = clip * scale
        coeffs = []
        for k in range(len(w)):
            g = [x / divisor for x in grads[k]]
            m[k] = [b1 * a + (1 - b1) * x for a, x in zip(m[k], g)]
            v[k] = [b2 * a + (1 - b2) * x * x for a, x in zip(v[k], g)]
            c1 = 1 - b1**t if bias_correction else 1.0
            c2 = 1 - b2**t if bias_correction else 1.0
            update = []
            for mi, vi, wi in zip(m[k], v[k], w[k]):
                vh = vi / c2
                denom = math.sqrt(vh + eps) if eps_inside_sqrt else math.sqrt(vh) + eps
                update.append((mi / c1) / denom + weight_decay * wi)
            w_norm = math.sqrt(sum(x * x for x in w[k]))
            u_norm = math.sqrt(sum(x * x for x in update))
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
            coeffs.append(coeff)
            w[k] = [wi - lr * coeff * ui for wi, ui in zip(w[k], update)]
        all_coeffs.append(coeffs)
    return w, all_coeffs


SHAPES = [(3, 4), (5,), (2, 2, 2)]


def make_problem(seed: int, steps: int, dtype=torch.float64, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) * 0.1 for s in shapes]
             for _ in range(steps)]
    return weights, grads


def run_lamb(weights, grads, step_kwargs=None, **options):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Lamb(params, **options)
    coeffs = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step(**(step_kwargs or {}))
        coeffs.append(opt.get_lamb_coeffs())
    return params, coeffs, opt


def as_lists(tensors):
    return [t.flatten().tolist() for t in tensors]


def assert_matches(params, coeffs, ref_w, ref_coeffs, tol=1e-12):
    for p, r in zip(params, ref_w):
        torch.testing.assert_close(p.detach().flatten(), torch.tensor(r, dtype=p.dtype),
                                   rtol=tol, atol=tol)
    for got, want in zip(coeffs, ref_coeffs):
        assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("options", [
    dict(lr=1e-2, weight_decay=0.01),
    dict(lr=5e-3, bias_correction=False, eps_inside_sqrt=True),
    dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, bias_correction=True),
], ids=["default", "no-bias-correction-eps-inside", "betas-wd"])
def test_matches_reference(options):
    weights, grads = make_problem(0, steps=6)
    params, coeffs, _ = run_lamb(weights, grads, **options)
    ref_w, ref_coeffs = reference_lamb(as_lists(weights), [as_lists(g) for g in grads],
                                       **options)
    assert_matches(params, coeffs, ref_w, ref_coeffs)
    # The trust ratio must actually do something in this problem for the test to bite.
    assert any(abs(c - 1.0) > 1e-3 for step in ref_coeffs for c in step)


def test_trust_ratio_clamped_at_max():
    weights, grads = make_problem(1, steps=3)
    weights = [w * 100 for w in weights]  # ||w|| / ||u|| far above max_coeff
    options = dict(lr=1e-3, max_coeff=2.0, min_coeff=0.01)
    params, coeffs, _ = run_lamb(weights, grads, **options)
    ref_w, ref_coeffs = reference_lamb(as_lists(weights), [as_lists(g) for g in grads],
                                       **options)
    assert all(c == 2.0 for step in coeffs for c in step)
    assert_matches(params, coeffs, ref_w, ref_coeffs)


def test_trust_ratio_clamped_at_min():
    weights, grads = make_problem(2, steps=3)
    weights = [w * 1e-3 for w in weights]  # ||w|| / ||u|| far below min_coeff
    options = dict(lr=1e-3, max_coeff=10.0, min_coeff=0.5)
    params, coeffs, _ = run_lamb(weights, grads, **options)
    ref_w, ref_coeffs = reference_lamb(as_lists(weights), [as_lists(g) for g in grads],
                                       **options)
    assert all(c == 0.5 for step in coeffs for c in step)
    assert_matches(params, coeffs, ref_w, ref_coeffs)


def test_zero_norm_parameter_and_zero_update_use_ratio_one():
    weights, grads = make_problem(3, steps=3)
    weights[1] = torch.zeros_like(weights[1])  # ||w|| = 0
    for step in grads:
        step[2] = torch.zeros_like(step[2])  # with no decay: ||u|| = 0, w must not move
    options = dict(lr=1e-2)
    params, coeffs, _ = run_lamb(weights, grads, **options)
    ref_w, ref_coeffs = reference_lamb(as_lists(weights), [as_lists(g) for g in grads],
                                       **options)
    assert coeffs[0][1] == 1.0  # afterwards the parameter is no longer zero
    assert [step[2] for step in coeffs] == [1.0, 1.0, 1.0]
    torch.testing.assert_close(params[2].detach(), weights[2], rtol=0, atol=0)
    assert params[1].abs().sum() > 0  # the zero parameter still moves, with ratio 1
    assert_matches(params, coeffs, ref_w, ref_coeffs)


@pytest.mark.parametrize("max_grad_norm", [0.05, 100.0], ids=["clips", "no-clip"])
def test_max_grad_norm_and_loss_scale(max_grad_norm):
    weights, grads = make_problem(4, steps=4)
    loss_scale = 1024.0
    scaled = [[g * loss_scale for g in step] for step in grads]
    options = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=max_grad_norm)
    params, coeffs, _ = run_lamb(weights, scaled, step_kwargs={"scale": loss_scale}, **options)
    ref_w, ref_coeffs = reference_lamb(as_lists(weights), [as_lists(g) for g in scaled],
                                       scale=loss_scale, **options)
    assert_matches(params, coeffs, ref_w, ref_coeffs)


def test_given_grad_norm_is_used():
    weights, grads = make_problem(5, steps=1)
    fake_norm = 7.0  # differs from the true norm, so the result must follow it
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Lamb(params, lr=1e-2, max_grad_norm=0.5)
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    opt.step(grad_norm=fake_norm)
    divisor = (fake_norm + 1e-6) / 0.5
    ref_w, _ = reference_lamb(as_lists(weights), [as_lists([g / divisor for g in grads[0]])],
                              lr=1e-2)
    for p, r in zip(params, ref_w):
        torch.testing.assert_close(p.detach().flatten(), torch.tensor(r, dtype=p.dtype))


def test_float32_matches_float64_reference():
    weights, grads = make_problem(6, steps=5, dtype=torch.float32)
    params, _, _ = run_lamb(weights, grads, lr=1e-2, weight_decay=0.01)
    ref_w, _ = reference_lamb(as_lists(weights), [as_lists(g) for g in grads],
                              lr=1e-2, weight_decay=0.01)
    for p, r in zip(params, ref_w):
        torch.testing.assert_close(p.detach().flatten(), torch.tensor(r, dtype=torch.float32),
                                   rtol=1e-5, atol=1e-6)


def test_param_groups_and_params_without_grad():
    weights, grads = make_problem(7, steps=3)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Lamb([{"params": params[:2], "lr": 1e-2},
                {"params": [params[2]], "lr": 3e-2, "weight_decay": 0.2}])
    frozen = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    opt.add_param_group({"params": [frozen]})
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    assert frozen not in opt.state
    ref_a, _ = reference_lamb(as_lists(weights[:2]), [as_lists(s[:2]) for s in grads], lr=1e-2)
    ref_b, _ = reference_lamb(as_lists(weights[2:]), [as_lists(s[2:]) for s in grads],
                              lr=3e-2, weight_decay=0.2)
    for p, r in zip(params, ref_a + ref_b):
        torch.testing.assert_close(p.detach().flatten(), torch.tensor(r, dtype=p.dtype))
    assert len(opt.get_lamb_coeffs()) == 3


def test_state_dict_round_trip_resumes_identically():
    weights, grads = make_problem(8, steps=6)
    full, _, _ = run_lamb(weights, grads, lr=1e-2, weight_decay=0.01)

    first, _, opt = run_lamb(weights, grads[:3], lr=1e-2, weight_decay=0.01)
    saved = opt.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = Lamb(resumed, lr=0.5)  # hyperparameters come back from the state dict
    opt2.load_state_dict(saved)
    for step in grads[3:]:
        for p, g in zip(resumed, step):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(full, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(amsgrad=True), "amsgrad"),
    (dict(betas=(0.9, 1.0)), "betas[1]"),
    (dict(min_coeff=5.0, max_coeff=1.0), "min_coeff"),
    (dict(eps=-1.0), "eps"),
])
def test_invalid_options(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        Lamb([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_sparse_gradient_rejected():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        Lamb([p]).step()
