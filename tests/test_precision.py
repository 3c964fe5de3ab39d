"""Loss scaling, clipping and low-precision training."""

from __future__ import annotations

import math

import torch

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
    for _ in range(2):
        s.update(False)
        assert s.scale == 4.0
    s.update(False)  # 3 clean steps since the overflow
    assert s.scale == 8.0
    for _ in range(3):
        s.update(False)
    assert s.scale == 16.0


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
    }
    engine, *_ = terascale.initialize(model=make_model(), config=config)
    assert next(engine.module.parameters()).dtype == torch.float16
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
    return record


def test_fp16_dynamic_scaling_skips_and_lowers_then_grows():
    record = run_ranks(_fp16_rank, 2, False)[0]
    scales = [r[0] for r in record]
    skipped = [r[1] for r in record]
    applied = [r[3] for r in record]
    changed = [r[2] for r in record]
    # No overflow yet counts as one at iteration -1, so the first growth (window 2) is at
    # iteration 1.
    assert scales[0] == 256.0 and scales[1] == 512.0
    # steps 2, 3, 4 overflow: first absorbed by hysteresis, then halved twice.
    assert scales[2] == 512.0 and scales[3] == 256.0 and scales[4] == 128.0
    assert skipped == [0, 0, 1, 2, 3, 3, 3, 3]
    assert applied == [True, True, False, False, False, True, True, True]
    assert changed == applied
    # After the overflow at iter 4, two clean steps (5, 6) grow the scale at iter 6.
    assert scales[5] == 128.0 and scales[6] == 256.0


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
