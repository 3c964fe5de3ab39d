"""Loss scaling, clipping and low-precision training."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks
from terascale.engine.clipping import clip_grads_, global_grad_norm
from terascale.engine.loss_scaler import DynamicLossScaler, StaticLossScaler
from toy import make_data, make_model, reference_train


def test_dynamic_scaler_hysteresis_then_backoff():
    s = DynamicLossScaler(scale=2.0**16, scale_window=1000, hysteresis=2, min_scale=1.0)
    s.update(True)  # first overflow is absorbed by hysteresis
    assert s.scale == 2.0**16
    s.update(True)  # second one halves the scale
    assert s.scale == 2.0**15
    s.update(True)  # hysteresis stays used up until the scale grows again
    assert s.scale == 2.0**14


def test_dynamic_scaler_grows_after_window_of_clean_steps():
    s = DynamicLossScaler(scale=8.0, scale_window=3, hysteresis=1)
    s.update(True)  # iter 0 overflows -> 4
    assert s.scale == 4.0
    for _ in range(3):
        s.update(False)
        assert s.scale == 4.0
    s.update(False)  # a clean step after 3 clean steps since the overflow (DeepSpeed 0.19's rule)
    assert s.scale == 8.0
    for _ in range(3):
        s.update(False)
    assert s.scale == 16.0
    fresh = DynamicLossScaler(scale=8.0, scale_window=2, hysteresis=1)
    scales = []
    for _ in range(5):
        fresh.update(False)
        scales.append(fresh.cur_scale)
    assert scales == [8.0, 8.0, 16.0, 16.0, 32.0] and fresh.cur_iter == 5  # DeepSpeed's sequence


def test_dynamic_scaler_respects_min_scale_and_consecutive_hysteresis():
    s = DynamicLossScaler(scale=4.0, scale_window=100, hysteresis=1, min_scale=2.0)
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0
    c = DynamicLossScaler(scale=64.0, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    c.update(True)  # absorbed
    c.update(False)  # a clean step refills hysteresis
    c.update(True)  # absorbed again
    assert c.scale == 64.0
    c.update(True)
    assert c.scale == 32.0


def test_scaler_state_round_trip():
    s = DynamicLossScaler(scale=2.0**10, scale_window=2, hysteresis=2)
    for o in [True, False, True, True, False]:
        s.update(o)
    t = DynamicLossScaler(scale_window=2, hysteresis=2)  # the config rebuilds the policy
    t.load_state_dict(s.state_dict())
    for o in [False, False, True, False, False]:
        s.update(o)
        t.update(o)
        assert s.scale == t.scale
    st = StaticLossScaler(128.0)
    st.update(True)
    assert st.scale == 128.0


def test_clipping_equals_torch_clip_grad_norm():
    torch.manual_seed(0)
    grads = [torch.randn(7, 3) * 5, torch.randn(11), torch.randn(2, 2, 2)]
    ref = [g.clone().requires_grad_() for g in grads]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.5)
    norm = global_grad_norm(grads)
    clip_grads_(grads, 1.5, norm)
    torch.testing.assert_close(norm, ref_norm)
    for r, g in zip(ref, grads):
        torch.testing.assert_close(g, r.grad, rtol=0, atol=0)
    # Below the threshold nothing changes.
    small = [torch.full((3,), 0.1)]
    clip_grads_(small, 10.0, global_grad_norm(small))
    assert torch.equal(small[0], torch.full((3,), 0.1))


def _fp16_rank(static: bool):
    import terascale

    fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
    if static:
        fp16 = {"enabled": True, "loss_scale": 64.0}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 1000,
        "fp16": fp16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},  # ZeRO: the fp16 hysteresis applies (see the next test)
    }
    engine, handle, *_ = terascale.initialize(model=make_model(), config=config)
    assert next(engine.module.parameters()).dtype == torch.float16
    # DeepSpeed's names for the scaler, on the optimizer initialize returns.
    scaler = handle.loss_scale_config
    assert scaler is handle.loss_scaler and scaler.dynamic_loss_scale is (not static) and scaler.use_grad_scaling
    x, y = make_data(8, 8)
    record = []
    for s in range(8):
        lo = engine.dist.dp_rank * 4
        loss = engine(x[s, lo : lo + 4].half(), y[s, lo : lo + 4])
        if s in (2, 3, 4):
            loss = loss * 1e9  # the scaled fp16 gradients overflow on these steps
        before = engine.module.head.weight.detach().clone()
        engine.backward(loss)
        engine.step()
        changed = not torch.equal(before, engine.module.head.weight)
        record.append((engine.loss_scale, engine.skipped_steps, changed, engine.was_step_applied()))
        assert handle.cur_scale == scaler.cur_scale == engine.loss_scale
        assert scaler.cur_iter == (s + 1 if not static else 0)
    return record


def test_fp16_dynamic_scaling_skips_and_lowers_then_grows():
    record = run_ranks(_fp16_rank, 2, False)[0]
    scales = [r[0] for r in record]
    skipped = [r[1] for r in record]
    applied = [r[3] for r in record]
    changed = [r[2] for r in record]
    # DeepSpeed 0.19's rule (window 2): the scale grows at a clean step that follows two
    # clean ones, so not before step 2; steps 2, 3, 4 overflow: the first is absorbed by
    # hysteresis, then the scale halves twice; after the overflow at step 4, the clean
    # steps 5 and 6 let step 7 grow it.
    assert scales == [256.0, 256.0, 256.0, 128.0, 64.0, 64.0, 64.0, 128.0]
    assert skipped == [0, 0, 1, 2, 3, 3, 3, 3]
    assert applied == [True, True, False, False, False, True, True, True]
    assert changed == applied


def _bf16_overflow_rank(check: bool) -> list:
    import terascale

    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "bf16": {"enabled": True, "check_grad_overflow": check},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}  # fmt: skip
    engine, *_ = terascale.initialize(model=make_model(), config=config)
    x, y = make_data(4, 8)
    record = []
    for s in range(4):
        lo = engine.dist.dp_rank * 4
        loss = engine(x[s, lo : lo + 4].bfloat16(), y[s, lo : lo + 4])
        if s == 1:
            loss = loss * float("inf")  # every gradient becomes non-finite
        engine.backward(loss)
        engine.step()
        finite = all(torch.isfinite(p).all().item() for p in engine.module.parameters())
        record.append((engine.skipped_steps, engine.was_step_applied(), finite))
    return record


def test_bf16_check_grad_overflow_skips_non_finite_steps():
    checked = run_ranks(_bf16_overflow_rank, 2, True)[0]
    assert checked == [(0, True, True), (1, False, True), (1, True, True), (1, True, True)]
    unchecked = run_ranks(_bf16_overflow_rank, 2, False)[0]  # DeepSpeed's default: no check
    assert [r[:2] for r in unchecked] == [(0, True)] * 4 and not unchecked[1][2]


def test_without_zero_every_overflow_lowers_the_scale():
    """DeepSpeed's fp16 optimizer without ZeRO has no hysteresis (its ZeRO optimizers do)."""
    from terascale.config.precision import Fp16Config
    from terascale.engine.loss_scaler import build_loss_scaler

    fp16 = Fp16Config(enabled=True, initial_scale_power=4, hysteresis=2)
    for stage, after_two in ((0, 4.0), (1, 8.0)):
        scaler = build_loss_scaler(fp16, stage)
        scaler.update(True)
        scaler.update(True)
        assert scaler.cur_scale == after_two, stage


def test_fp16_static_scale_skips_overflow_without_changing_scale():
    record = run_ranks(_fp16_rank, 1, True)[0]
    assert all(r[0] == 64.0 for r in record)
    assert [r[1] for r in record] == [0, 0, 1, 2, 3, 3, 3, 3]


def _bf16_rank(steps: int, micro: int = 4):
    import terascale

    config = {
        "train_micro_batch_size_per_gpu": micro,
        "steps_per_print": 1000,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    }
    engine, optimizer, *_ = terascale.initialize(model=make_model(), config=config)
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])
    x, y = make_data(steps, 8)
    losses = []
    for s in range(steps):
        lo = engine.dist.dp_rank * micro
        loss = engine(x[s, lo : lo + micro].bfloat16(), y[s, lo : lo + micro])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_state_dict()


def test_bf16_trains_close_to_fp32():
    steps = 12
    (l0, state), (l1, _) = run_ranks(_bf16_rank, 2, steps)
    check_bf16_close_to_fp32([(a + b) / 2 for a, b in zip(l0, l1)], state, steps)


def check_bf16_close_to_fp32(bf16_losses: list[float], state: dict, steps: int) -> None:
    ref_losses, ref_state = reference_train(steps, 8, lr=1e-2, weight_decay=0.01, clip=0.0)
    for a, b in zip(bf16_losses, ref_losses):
        assert math.isclose(a, b, rel_tol=0.05), (bf16_losses, ref_losses)
    # fp32 masters drift from the fp32 run only by bf16 rounding of the forward/backward.
    for k, v in ref_state.items():
        assert state[k].dtype == torch.float32
        assert (state[k] - v).abs().max() < 0.05, k


# -- buffer dtypes ([Note: buffer dtypes]) and data_types.param_dtype -------------------------


class _Rotary(nn.Module):
    """A rotary-style model: its fp32 ``inv_freq`` buffer feeds the angles, and an fp32 step
    ``count`` starts at 256, where bf16 cannot count by ones (256 + 1 rounds back to 256). The
    model casts what it mixes, as Hugging Face models do; the engine casts neither buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
        self.register_buffer("count", torch.tensor(256.0))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))  # not floating: never cast

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.count += 1
        self.seen += 1
        positions = torch.arange(1, x.shape[0] + 1, dtype=self.inv_freq.dtype) * 1000
        angles = torch.outer(positions, self.inv_freq)
        h = self.proj(x.to(self.proj.weight.dtype))
        h = h * torch.cat([angles.cos(), angles.sin()], dim=-1).to(h.dtype)
        return F.mse_loss(self.head(h).float(), y)


def _buffers_config(stage: int, buffer_dtype: str | None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 1000,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }
    if buffer_dtype is not None:
        config["data_types"] = {"buffer_dtype": buffer_dtype}
    return config


def _buffers_rank(stage: int, buffer_dtype: str | None, out_dir: str) -> dict:
    import terascale

    torch.manual_seed(0)
    model = _Rotary()
    inv_freq = model.inv_freq.clone()
    # With training data the planner runs a forward before prepare_model: it casts as that does.
    data = [(torch.randn(8), torch.randn(1)) for _ in range(8)]
    engine, *_ = terascale.initialize(model=model, config=_buffers_config(stage, buffer_dtype), training_data=data)
    out: dict = {
        "params": sorted({str(p.dtype) for p in engine.module.parameters()}),
        "buffers": {n: str(b.dtype) for n, b in engine.module.named_buffers()},
    }
    before = engine.full_state_dict()
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)
        lo = engine.dist.dp_rank * 4
        loss = engine(x[lo : lo + 4].bfloat16(), y[lo : lo + 4])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    after = engine.full_state_dict()
    out["losses"] = losses
    out["trained"] = not torch.equal(before["proj.weight"], after["proj.weight"])
    # Values as the module holds them: the exact fp32 ones unless buffer_dtype rounded them.
    out["inv_freq_exact"] = torch.equal(engine.module.inv_freq.float(), inv_freq)
    out["inv_freq_rounded"] = torch.equal(engine.module.inv_freq, inv_freq.bfloat16())
    out["count"] = engine.module.count.item()
    out["saved"] = {n: (str(b.dtype), b.float().tolist()) for n, b in engine.module.named_buffers()}
    engine.save_checkpoint(out_dir, tag="t")
    engine.save_16bit_model(out_dir, "model.safetensors")
    engine.destroy()
    fresh, *_ = terascale.initialize(model=_Rotary(), config=_buffers_config(stage, buffer_dtype))
    fresh.load_checkpoint(out_dir, tag="t")
    out["loaded"] = {n: (str(b.dtype), b.float().tolist()) for n, b in fresh.module.named_buffers()}
    return out


@pytest.mark.parametrize("stage, world", [(0, 1), (3, 2)])
def test_bf16_keeps_fp32_buffers_and_trains(tmp_path, stage, world):
    from safetensors.torch import load_file

    r = run_ranks(_buffers_rank, world, stage, None, str(tmp_path))[0]
    assert r["params"] == ["torch.bfloat16"]
    assert r["buffers"] == {"inv_freq": "torch.float32", "count": "torch.float32", "seen": "torch.int64"}
    assert r["inv_freq_exact"] and r["trained"], r
    assert all(math.isfinite(v) for v in r["losses"])
    assert r["count"] == 259.0  # three forwards counted in fp32
    # The checkpoint keeps each buffer in its dtype and loads it back into a fresh model.
    assert r["loaded"] == r["saved"] and r["loaded"]["count"] == ("torch.float32", 259.0)
    weights = load_file(str(tmp_path / "model.safetensors"))  # parameters 16-bit, buffers their own
    assert {k: str(v.dtype) for k, v in weights.items()} == {
        "proj.weight": "torch.bfloat16", "proj.bias": "torch.bfloat16", "head.weight": "torch.bfloat16",
        "head.bias": "torch.bfloat16", "inv_freq": "torch.float32", "count": "torch.float32", "seen": "torch.int64",
    }  # fmt: skip


@pytest.mark.parametrize("stage, world", [(0, 1), (3, 2)])
def test_buffer_dtype_casts_floating_buffers(tmp_path, stage, world):
    from safetensors.torch import load_file

    r = run_ranks(_buffers_rank, world, stage, "bf16", str(tmp_path))[0]
    assert r["buffers"] == {"inv_freq": "torch.bfloat16", "count": "torch.bfloat16", "seen": "torch.int64"}
    assert r["inv_freq_rounded"] and r["trained"]
    assert r["count"] == 256.0  # bf16 cannot count by ones there: the cast the key asked for
    assert r["loaded"] == r["saved"]
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert weights["inv_freq"].dtype == torch.bfloat16 and weights["seen"].dtype == torch.int64


def test_param_dtype_must_agree_with_the_precision_flags():
    from terascale.config import Config, ConfigError, Given
    from terascale.config.auto import AutoContext

    base = {"train_batch_size": 1}
    for flags, asked in ([{"bf16": {"enabled": True}}, "fp16"], [{"fp16": {"enabled": True}}, "bfloat16"],
                         [{}, "bf16"], [{"bf16": {"enabled": True}}, "fp32"]):  # fmt: skip
        cfg = Config.load({**base, **flags, "data_types": {"param_dtype": asked}})
        assert cfg.unbuilt_settings() == []  # built: no longer refused as unbuilt
        with pytest.raises(ConfigError) as err:
            cfg.require_agreeing_precision()
        message = str(err.value)
        mode = next(iter(flags), "fp32")
        assert "data_types.param_dtype" in message and mode in message, message
        assert f"'{cfg.data_types.param_dtype}'" in message, message
    for flags, asked in ([{"bf16": {"enabled": True}}, "bf16"], [{"fp16": {"enabled": True}}, "half"], [{}, "fp32"]):
        Config.load({**base, **flags, "data_types": {"param_dtype": asked}}).require_agreeing_precision()
    # Lightning's precision gives bf16.enabled where the config has none: checked once resolved.
    cfg = Config.load({**base, "data_types": {"param_dtype": "bf16"}})
    given = {"bf16.enabled": Given(True, "Trainer(precision)", match=False, absent=True)}
    assert cfg.resolve(AutoContext(world_size=1, given=given)).require_agreeing_precision().bf16.enabled


def _conflict_rank() -> str:
    import terascale

    config = {**_buffers_config(0, None), "data_types": {"param_dtype": "fp16"}}
    try:
        terascale.initialize(model=_Rotary(), config=config)
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    return "initialized"


def test_initialize_refuses_a_conflicting_param_dtype():
    message = run_ranks(_conflict_rank, 1)[0]
    assert message.startswith("ConfigError") and "data_types.param_dtype is 'fp16' but bf16.enabled" in message, message
