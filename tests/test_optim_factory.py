"""build_optimizer / build_scheduler: DeepSpeed name mapping, defaults, numerics, errors."""

from __future__ import annotations

import pytest
import torch

from terascale.optim import (
    Lamb,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_optimizer,
    build_scheduler,
)


def make_params(seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device))
            for s in [(4, 3), (3,)]]


def train(opt, params, steps=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


def reference(cls, steps=4, **kwargs):
    params = make_params()
    return train(cls(params, foreach=False, **kwargs), params, steps)


def close(a, b):
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


# ---- name mapping and numerics --------------------------------------------------------

@pytest.mark.parametrize("name, params, expected_cls", [
    ("Adam", {}, torch.optim.AdamW),
    ("adam", {"adam_w_mode": True}, torch.optim.AdamW),
    ("ADAM", {"adam_w_mode": False}, torch.optim.Adam),
    ("AdamW", {}, torch.optim.AdamW),
    ("adamw", {"adam_w_mode": False}, torch.optim.AdamW),  # AdamW forces decoupled decay
    ("Lamb", {}, Lamb),
    ("sgd", {}, torch.optim.SGD),
])
def test_name_mapping(name, params, expected_cls):
    assert type(build_optimizer(name, params, make_params())) is expected_cls


def test_adam_default_is_decoupled_weight_decay():
    hp = {"lr": 1e-2, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.1}
    params = make_params()
    got = train(build_optimizer("Adam", hp, params), params)
    hp_t = {**hp, "betas": tuple(hp["betas"])}
    assert close(got, reference(torch.optim.AdamW, **hp_t))
    assert not close(got, reference(torch.optim.Adam, **hp_t))


def test_adam_w_mode_false_is_l2_weight_decay():
    hp = {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}
    params = make_params()
    got = train(build_optimizer("Adam", hp, params), params)
    assert close(got, reference(torch.optim.Adam, lr=1e-2, weight_decay=0.1))
    assert not close(got, reference(torch.optim.AdamW, lr=1e-2, weight_decay=0.1))


def test_deepspeed_defaults():
    opt = build_optimizer("Adam", None, make_params())
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"],
            group["amsgrad"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0, False)
    # torch's AdamW would decay by 0.01 by default; DeepSpeed's FusedAdam does not.
    params = make_params()
    got = train(build_optimizer("AdamW", {}, params), params)
    assert close(got, reference(torch.optim.AdamW, lr=1e-3, weight_decay=0.0))
    # With torch_adam DeepSpeed hands the params to torch, whose AdamW default applies.
    torch_adam = build_optimizer("Adam", {"torch_adam": True}, make_params())
    assert torch_adam.param_groups[0]["weight_decay"] == 0.01
    assert build_optimizer("sgd", {}, make_params()).param_groups[0]["lr"] == 1e-3


def test_amsgrad_passed_through():
    params = make_params()
    got = train(build_optimizer("AdamW", {"amsgrad": True, "lr": 0.05}, params), params)
    assert close(got, reference(torch.optim.AdamW, lr=0.05, weight_decay=0.0, amsgrad=True))


def test_sgd_params():
    hp = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    params = make_params()
    got = train(build_optimizer("SGD", hp, params), params)
    assert close(got, reference(torch.optim.SGD, **hp))


def test_lamb_params():
    hp = {"lr": 0.02, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.01,
          "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.02, "eps_inside_sqrt": True}
    params = make_params()
    opt = build_optimizer("lamb", hp, params)
    group = opt.param_groups[0]
    for key, value in hp.items():
        assert group[key] == (tuple(value) if key == "betas" else value)
    ref_params = make_params()
    ref = Lamb(ref_params, **{**hp, "betas": (0.8, 0.9)})
    assert close(train(opt, params), train(ref, ref_params))


def test_param_group_dicts_keep_their_options():
    a, b = make_params()
    groups = ({"params": (p for p in [a]), "lr": 0.5}, {"params": b})  # generator, bare tensor
    opt = build_optimizer("AdamW", {"lr": 1e-3}, (g for g in groups))
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1e-3]
    assert [g["params"] for g in opt.param_groups] == [[a], [b]]
    assert all(g["fused"] for g in opt.param_groups)


# ---- implementation choice ------------------------------------------------------------

@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_fused_on_cpu(name):
    opt = build_optimizer(name, {"adam_w_mode": False} if name == "Adam" else {}, make_params())
    assert opt.param_groups[0]["fused"] is True
    assert not opt.param_groups[0]["foreach"]


def test_foreach_where_fused_is_unsupported():
    params = [torch.nn.Parameter(torch.zeros(3, device="meta"))]  # no fused kernel on meta
    opt = build_optimizer("Adam", {}, params)
    assert opt.param_groups[0]["foreach"] is True
    assert not opt.param_groups[0]["fused"]


# ---- errors ---------------------------------------------------------------------------

def test_deepspeed_only_optimizer_names_rejected():
    with pytest.raises(ValueError) as err:
        build_optimizer("Adagrad", {}, make_params())
    msg = str(err.value)
    assert "DeepSpeed optimizer that terascale does not provide" in msg
    assert "Adam, AdamW, Adam8bit, AdamW8bit, Lamb, Lion, Muon, SGD, OneBitAdam, ZeroOneAdam, OneBitLamb" in msg
    with pytest.raises(ValueError, match="'MuAdam' is a DeepSpeed optimizer"):
        build_optimizer("MuAdam", {}, make_params())


def test_lion_and_muon_take_deepspeeds_names_and_defaults():
    from terascale.optim import Lion
    from terascale.optim.muon import Muon

    lion = build_optimizer("lion", {"set_grad_none": True}, make_params())
    assert isinstance(lion, Lion) and lion.defaults["betas"] == (0.9, 0.999) and lion.defaults["lr"] == 1e-3
    groups = [{"params": make_params()[:1], "use_muon": True}, {"params": make_params()[1:], "use_muon": False}]
    muon = build_optimizer("Muon", {"lr": 0.1, "adam_lr": 1e-3, "momentum": 0.9}, groups)
    assert isinstance(muon, Muon)
    assert [(g["lr"], g.get("momentum"), g.get("betas")) for g in muon.param_groups] == [(0.1, 0.9, None),
                                                                                         (1e-3, None, (0.9, 0.95))]
    with pytest.raises(ValueError, match="no parameter 'nesterov_steps'.*did you mean 'ns_steps'"):
        build_optimizer("Muon", {"nesterov_steps": 3}, groups)
    with pytest.raises(ValueError, match="use_muon"):
        build_optimizer("Muon", {}, make_params())


def test_typo_in_optimizer_name_suggests_nearest():
    with pytest.raises(ValueError, match=r"'Adamw8' is not a known optimizer.*nearest: 'AdamW'"):
        build_optimizer("Adamw8", {}, make_params())


def test_unknown_param_names_it_and_suggests():
    with pytest.raises(ValueError) as err:
        build_optimizer("AdamW", {"betass": [0.9, 0.99]}, make_params())
    msg = str(err.value)
    assert "'betass'" in msg and "did you mean 'betas'" in msg and "weight_decay" in msg
    with pytest.raises(ValueError, match="'momentum'"):
        build_optimizer("Adam", {"momentum": 0.9}, make_params())  # SGD-only param


def test_deepspeed_valid_harmless_params_accepted():
    opt = build_optimizer("Adam", {"torch_adam": False, "set_grad_none": True,
                                   "bias_correction": True}, make_params())
    assert type(opt) is torch.optim.AdamW


@pytest.mark.parametrize("name, params, needle", [
    ("Lamb", {"max_grad_norm": 1.0}, "gradient_clipping"),
    ("Adam", {"bias_correction": False}, "bias_correction"),
    ("Adam", {"betas": [0.9]}, "betas"),
    ("Lamb", {"amsgrad": True}, "amsgrad"),
])
def test_invalid_params(name, params, needle):
    with pytest.raises(ValueError, match=needle):
        build_optimizer(name, params, make_params())


# ---- schedulers -----------------------------------------------------------------------

@pytest.mark.parametrize("name, params, cls", [
    ("WarmupLR", {"warmup_num_steps": 10}, WarmupLR),
    ("warmupdecaylr", {"total_num_steps": 100, "warmup_num_steps": 10}, WarmupDecayLR),
    ("WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 10,
                        "warmup_min_ratio": 0.1}, WarmupCosineLR),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}, OneCycle),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4}, LRRangeTest),
])
def test_build_scheduler(name, params, cls):
    opt = build_optimizer("AdamW", {"lr": 0.1}, make_params())
    sched = build_scheduler(name, params, opt)
    assert type(sched) is cls and sched.optimizer is opt
    assert sched.last_batch_iteration == -1


def test_build_scheduler_passes_params():
    opt = build_optimizer("SGD", {"lr": 0.1}, make_params())
    build_scheduler("WarmupLR", {"warmup_min_lr": 0.2, "warmup_max_lr": 0.4,
                                 "warmup_num_steps": 4, "warmup_type": "linear"}, opt)
    assert opt.param_groups[0]["lr"] == 0.2


def test_build_scheduler_errors():
    opt = build_optimizer("SGD", {}, make_params())
    with pytest.raises(ValueError, match=r"'WarmupCosine' is not supported \(did you mean "
                                         r"'WarmupCosineLR'\?\).*LRRangeTest"):
        build_scheduler("WarmupCosine", {}, opt)
    with pytest.raises(ValueError, match=r"'warmup_max_lrr'.*did you mean 'warmup_max_lr'"):
        build_scheduler("WarmupLR", {"warmup_max_lrr": 0.1}, opt)
    with pytest.raises(ValueError, match="'total_num_steps'"):
        build_scheduler("WarmupDecayLR", {}, opt)
    with pytest.raises(ValueError, match="'cycle_min_lr', 'cycle_max_lr'"):
        build_scheduler("OneCycle", {}, opt)
