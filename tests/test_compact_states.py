"""8-bit optimizer states ([Note: compact optimizer states], [Note: block-wise state codes]):
the codes' error bounds, the step against fp32 Adam, every tier, checkpoints and reshards."""

from __future__ import annotations

import pytest
import torch

import state_tiers
from distributed import run_ranks
from terascale.optim import CompactAdam, build_optimizer
from terascale.zero.estimate import optimizer_state_bytes
from terascale.optim.quantize import Code, blocks, decode, encode

# Largest error of one element, as a fraction of its block's maximum: half a step of the
# code where its steps are widest (power: k / 2Q; dynamic: the gap below 1.0).
BOUNDS = {("power", True): 2 / 254, ("power", False): 4 / 510, ("dynamic", True): 0.0106,
          ("dynamic", False): 0.0053, ("linear", True): 1 / 254, ("linear", False): 1 / 510}  # fmt: skip


@pytest.mark.parametrize("name,signed", sorted(BOUNDS))
def test_codes_are_within_their_bound_and_idempotent(name, signed):
    torch.manual_seed(0)
    n = 4096 * 3 + 77  # a short last block
    x = torch.randn(n) * torch.logspace(-7, 0, n)[torch.randperm(n)]
    x[256:512] = 0.0  # an all-zero block
    x = x if signed else x.abs()
    code = Code(name, signed)
    codes, scale = torch.empty(n, dtype=code.dtype), torch.empty(blocks(n, 256))
    encode(x, code, 256, codes, scale)
    assert torch.equal(scale[:-1], x[: n - n % 256].abs().view(-1, 256).amax(1))
    y = torch.empty(n)
    decode(codes, scale, code, 256, y, exact=True)
    per_element = scale.repeat_interleave(256)[:n]
    assert float(((y - x).abs() / per_element.clamp_min(1e-30)).max()) <= BOUNDS[(name, signed)]
    assert torch.equal(y[256:512], torch.zeros(256))
    again, again_scale = torch.empty_like(codes), torch.empty_like(scale)
    encode(y, code, 256, again, again_scale)
    assert torch.equal(again, codes) and torch.equal(again_scale, scale)  # decode -> encode is exact
    fast = torch.empty(n)
    decode(codes, scale, code, 256, fast)  # the step's folded decode: a few ulps from exact
    torch.testing.assert_close(fast, y, rtol=1e-6, atol=0)


def test_step_with_low_precision_gradients_equals_step():
    torch.manual_seed(0)
    w = torch.randn(3000)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    oa, ob = CompactAdam([a], lr=1e-2, weight_decay=0.1), CompactAdam([b], lr=1e-2, weight_decay=0.1)
    out = torch.empty(3000, dtype=torch.bfloat16)
    for _ in range(5):
        g = torch.randn(3000).bfloat16()
        a.grad = g.float() * 0.5
        oa.step()
        ob.step_with([b], [g], torch.tensor(0.5), [out])
        assert torch.equal(a, b) and torch.equal(out, b.detach().bfloat16())
    for key, value in oa.state[a].items():
        assert torch.equal(value, ob.state[b][key]), key


@pytest.mark.parametrize("code", ["power", "dynamic"])
def test_training_follows_fp32_adamw(code):
    torch.manual_seed(0)
    x, true_w = torch.randn(512, 64), torch.randn(64, 8)
    y = x @ true_w + 0.01 * torch.randn(512, 8)
    finals = {}
    for kind in ("fp32", code):
        torch.manual_seed(1)
        model = torch.nn.Linear(64, 8)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=3e-2) if kind == "fp32" else CompactAdam(params, lr=3e-2, code=code)
        curve = []
        for _ in range(300):
            loss = (model(x) - y).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        finals[kind] = curve
    # The whole curve (its mean) within 2%, and both at the noise floor (1e-4) at the end.
    mean = {k: sum(c) / len(c) for k, c in finals.items()}
    assert abs(mean[code] - mean["fp32"]) <= 0.02 * mean["fp32"], mean
    assert max(finals[code][-1], finals["fp32"][-1]) < 0.01


def test_bad_settings_are_refused():
    p = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="unknown state code 'tree'"):
        CompactAdam(p, code="tree")
    with pytest.raises(ValueError, match="linear"):
        CompactAdam(p, code="linear")
    with pytest.raises(ValueError, match="block_size"):
        CompactAdam(p, block_size=100)
    with pytest.raises(ValueError, match="amsgrad"):
        build_optimizer("AdamW8bit", {"amsgrad": True}, p)
    assert isinstance(build_optimizer("adamw8bit", {"block_size": 128}, p), CompactAdam)
    assert optimizer_state_bytes("AdamW8bit", {}) == pytest.approx(2.03125)
    assert optimizer_state_bytes("AdamW", {}) == 8.0


# -- in the engine: every tier, checkpoints, reshards ---------------------------------------


def _config(stage: int, opt: str = "AdamW8bit", zero: dict | None = None, world: int = 2) -> dict:
    return {
        "train_batch_size": 4 * world,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": opt, "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "sub_group_size": 3000, "stage3_param_persistence_threshold": 0,
                              **(zero or {})},  # fmt: skip
    }


def test_every_tier_steps_the_same_and_resumes_exactly(tmp_path):
    (tmp_path / "swap").mkdir()
    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "swap"), "buffer_count": 2}
    configs = [
        _config(2),
        _config(2, zero={"offload_optimizer": {"device": "cpu"}}),
        _config(2, zero={"offload_optimizer": nvme}),
        _config(3, zero={"offload_optimizer": nvme, "offload_param": {**nvme, "buffer_count": 4}}),
        _config(2, opt="AdamW", zero={"offload_optimizer": nvme}),
        _config(2, opt="AdamW"),
    ]
    results = run_ranks(state_tiers.tiers_rank, 2, configs, str(tmp_path / "ckpt"))
    for rank in results:
        base = rank[0]
        for got in rank[1:4]:  # host and NVMe tiers, stage 3: the same bytes, the same steps
            assert got["losses"] == base["losses"]
            assert all(torch.equal(got["params"][n], base["params"][n]) for n in base["params"])
        for got in rank[:4]:
            assert got["resumed"] == got["losses"][3:] and got["resumed_equal"]
        fp32 = rank[4]
        assert all(abs(a - b) <= 0.02 * abs(b) + 1e-3 for a, b in zip(base["losses"], fp32["losses"])), (base, fp32)
        # State bytes: 2 + 8/256 an element against Adam's 8; on disk with the fp32 masters.
        assert base["opt_bytes"] == pytest.approx(rank[5]["opt_bytes"] * 2.03125 / 8, rel=0.05)
        assert rank[2]["disk"] <= 0.55 * fp32["disk"]


def _reshard_save_rank(save_dir: str) -> list[float]:
    import torch.distributed as dist

    import terascale

    engine, *_ = terascale.initialize(model=state_tiers.model(), config=_config(3))
    losses = state_tiers.train(engine, state_tiers.batches(dist.get_rank(), 4))
    engine.save_checkpoint(save_dir, tag="s")
    engine.destroy()
    return losses


def _reshard_load_rank(save_dir: str, opt: str, stage: int) -> dict:
    import terascale

    engine, *_ = terascale.initialize(model=state_tiers.model(), config=_config(stage, opt=opt, world=1))
    optimizer = engine.optimizer
    engine.load_checkpoint(save_dir, tag="s")
    state = [optimizer.logical_state(p) if isinstance(optimizer, CompactAdam) else dict(optimizer.state[p])
             for g in optimizer.param_groups for p in g["params"]]  # fmt: skip
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)
    out = {"state": state, "losses": [float((engine(x) - y).square().mean())]}
    engine.destroy()
    return out


def test_checkpoints_reshard_and_load_into_fp32_adam(tmp_path):
    run_ranks(_reshard_save_rank, 2, str(tmp_path))
    compact = run_ranks(_reshard_load_rank, 1, str(tmp_path), "AdamW8bit", 0)[0]
    fp32 = run_ranks(_reshard_load_rank, 1, str(tmp_path), "AdamW", 1)[0]
    assert compact["losses"] == fp32["losses"]  # the same masters
    # fp32 Adam reads the saved values; the 8-bit optimizer re-blocks them per parameter
    # (the ranks' pieces were cut elsewhere): one more rounding, within the code's bound.
    flat = lambda states, key: torch.cat([s[key].reshape(-1) for s in states])  # noqa: E731
    for key, bound in (("exp_avg", 2 / 254), ("exp_avg_sq", 4 / 510)):
        saved, reblocked = flat(fp32["state"], key), flat(compact["state"], key)
        assert saved.abs().sum() > 0
        assert float((saved - reblocked).abs().max()) <= bound * float(saved.abs().max())
