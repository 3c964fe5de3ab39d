"""DeepSpeed's ``MoE`` layer in one process, its optimizer-group helpers, and the errors for
expert layouts that cannot work ([Note: expert parameters])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distributed import run_ranks
from terascale.moe.experts import ExpertParameter, is_expert_param
from terascale.moe.layer import MoE
from terascale.moe.utils import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    return MoE(8, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), **{"num_experts": 4, **kw})


def test_state_dict_names_are_deepspeeds():
    names = set(_moe(ep_size=2, use_residual=True).state_dict())
    assert names == {
        "deepspeed_moe.gate.wg.weight",
        *(f"deepspeed_moe.experts.deepspeed_experts.{i}.{j}.{w}" for i in range(2) for j in (0, 2) for w in ("weight", "bias")),
        *(f"mlp.{j}.{w}" for j in (0, 2) for w in ("weight", "bias")),
        "coefficient.weight", "coefficient.bias",
    }  # fmt: skip
    assert _moe().deepspeed_moe.gate.wg.weight.dtype == torch.float32


def test_forward_is_the_routed_sum_of_its_experts():
    # Dropless top-2 without sampling: each token's output is its two experts' outputs
    # weighted by the renormalised softmax of the gate.
    moe = _moe(k=2, drop_tokens=False, top2_2nd_expert_sampling=False)
    with torch.no_grad():
        for i, e in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            for p in e.parameters():
                p.add_(0.1 * (i + 1))
    x = torch.randn(3, 5, 8)
    out, l_aux, counts = moe(x)
    tokens = x.reshape(-1, 8)
    probs = torch.softmax(tokens @ moe.deepspeed_moe.gate.wg.weight.t(), dim=1)
    top = probs.topk(2, dim=1)
    weights = top.values / top.values.sum(1, keepdim=True)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    want = torch.stack([
        sum(w * experts[int(e)](t) for w, e in zip(weights[s], top.indices[s])) for s, t in enumerate(tokens)
    ])  # fmt: skip
    torch.testing.assert_close(out.reshape(-1, 8), want, rtol=1e-5, atol=1e-6)
    assert counts.tolist() == torch.bincount(top.indices.reshape(-1), minlength=4).tolist()
    assert l_aux.requires_grad and out.shape == x.shape


def test_experts_are_expert_parameters_and_survive_copies():
    moe = _moe(ep_size=2)
    expert = [p for n, p in moe.named_parameters() if "deepspeed_experts" in n]
    dense = [p for n, p in moe.named_parameters() if "deepspeed_experts" not in n]
    assert all(is_moe_param(p) and p.group_name == "ep_size_2" and p.allreduce is False for p in expert)
    assert not any(is_moe_param(p) for p in dense)
    clone = copy.deepcopy(moe)
    assert all(isinstance(p, ExpertParameter) and p.ep_size == 2 for n, p in clone.named_parameters() if "experts" in n)
    assert has_moe_layers(nn.Sequential(nn.Linear(2, 2), moe)) == (True, 4)
    # Operations on an expert parameter give plain tensors.
    assert type(expert[0] * 2) is torch.Tensor and not is_expert_param(expert[0].detach() * 1)


def test_split_into_moe_groups_follows_deepspeed():
    moe = _moe(ep_size=2)
    params = list(moe.parameters())
    groups = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "parameters", "lr": 0.1})
    assert [(g["name"], g.get("moe", False), len(g["params"]), g["lr"]) for g in groups] == [
        ("parameters", False, 1, 0.1),  # the gate
        ("ep_size_2", True, 8, 0.1),
    ]
    # A size cap cuts the expert group into runs (each parameter whole).
    cut = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "p"}, max_group_size=200)
    assert [len(g["params"]) for g in cut[1:]] == [2, 2, 2, 2]
    assert configure_moe_param_groups(params)[0]["name"] == "dense-params"
    from_generator = split_params_into_different_moe_groups_for_optimizer({"params": moe.parameters(), "name": "p"})
    assert [len(g["params"]) for g in from_generator] == [1, 8]
    with pytest.raises(ValueError, match="needs a 'name'"):
        split_params_into_different_moe_groups_for_optimizer([{"params": params}])


def test_ep_size_must_divide_the_experts():
    with pytest.raises(ValueError, match="ep_size 3 does not divide num_experts 4"):
        _moe(ep_size=3)


def test_an_expert_parallel_layer_needs_its_group():
    with pytest.raises(RuntimeError, match="ep_size=2.*terascale.initialize"):
        _moe(ep_size=2)(torch.randn(4, 8))


def _bad_layout_rank(case: str) -> str:
    import terascale

    moe = _moe(ep_size=4 if case == "world" else 2)
    model = nn.Sequential(nn.Linear(8, 8), moe)
    config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}}  # fmt: skip
    try:
        if case == "world":
            terascale.initialize(model=model, config=config)
        else:  # the user's optimizer over every parameter in one group
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            terascale.initialize(model=model, optimizer=optimizer, config={**config, "optimizer": None})
    except ValueError as e:
        return str(e)
    return "no error"


def test_bad_expert_layouts_are_refused_with_the_numbers():
    world, mixed = run_ranks(_bad_layout_rank, 2, "world")[0], run_ranks(_bad_layout_rank, 2, "mixed")[0]
    assert "ep_size 4 does not divide the data-parallel world of 2 ranks" in world
    assert "optimizer param group 0 mixes 8 expert parameter(s) (ep_size_2) with 3 dense one(s)" in mixed
    assert "split_params_into_different_moe_groups_for_optimizer" in mixed


@pytest.mark.parametrize("k_dim", [8, 6])  # 6 fp32 elements: rows not 16-byte aligned, the loop runs
def test_grouped_linear_is_one_linear_per_expert(k_dim):
    from terascale.moe.grouped import grouped_linear, grouped_mm_fits

    torch.manual_seed(0)
    x = torch.randn(9, k_dim, requires_grad=True)
    w = torch.randn(3, 12, k_dim, requires_grad=True)
    counts = [4, 0, 5]  # an expert without rows still gets a (zero) gradient
    assert grouped_mm_fits(x, w) == (k_dim == 8)
    out = grouped_linear(x, w, counts)
    out.sum().backward()  # an expanded gradient: grouped_mm's backward needs it made contiguous
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    ref = torch.cat([x2[:4] @ w2[0].T, x2[4:4] @ w2[1].T, x2[4:] @ w2[2].T])
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    assert w.grad[1].abs().sum() == 0


def test_z_loss_coef_adds_the_router_z_loss_to_l_aux():
    x = torch.randn(10, 8)
    _, plain, _ = _moe(k=2, drop_tokens=False, top2_2nd_expert_sampling=False)(x)
    moe = _moe(k=2, drop_tokens=False, top2_2nd_expert_sampling=False, z_loss_coef=0.5)
    _, with_z, _ = moe(x)
    logits = x @ moe.deepspeed_moe.gate.wg.weight.t()
    torch.testing.assert_close(with_z - plain, 0.5 * torch.logsumexp(logits, dim=1).square().mean())


def test_expert_parallel_config_spellings():
    from terascale.config import Config, ConfigError

    base = {"train_batch_size": 2}
    short = Config.load({**base, "moe": {"ep_size": 4}}).expert_parallel
    assert short.active and short.autoep_size == 4
    # DeepSpeed's AutoEP section; its GPU kernel knobs are read loosely, as DeepSpeed reads them.
    ds = Config.load({**base, "expert_parallel": {"enabled": True, "autoep_size": 2, "comm_backend": "comm"}})
    assert ds.expert_parallel.active and ds.expert_parallel.autoep_size == 2
    assert not Config.load({**base, "expert_parallel": {"enabled": False, "autoep_size": 2}}).expert_parallel.active
    assert not Config.load(base).expert_parallel.active
    with pytest.raises(ConfigError, match="moe.ep_sise: unknown key; did you mean 'ep_size'"):
        Config.load({**base, "moe": {"ep_sise": 2}})
    for value in (0.01, 0, False, "1e-3"):  # every value, as DeepSpeed: the message names it and what to do
        with pytest.raises(ConfigError, match=rf"load_balance_coeff={value!r} is not supported.*null or omit it"):
            Config.load({**base, "expert_parallel": {"load_balance_coeff": value}})
    assert Config.load({**base, "expert_parallel": {"load_balance_coeff": None}}).expert_parallel.load_balance_coeff is None
