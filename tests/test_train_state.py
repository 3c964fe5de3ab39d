"""The train state: counters and the accumulation window's states, alone and in an engine."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from terascale.engine.train_state import TrainState, WindowState
from toy import make_data, make_model


def test_window_moves_through_its_states_in_order() -> None:
    ts = TrainState(gradient_accumulation_steps=2, device=torch.device("cpu"))
    assert ts.window is WindowState.EMPTY and ts.at_window_start and not ts.is_boundary()
    ts.add_loss(torch.tensor(3.0), 1)
    ts.backward_ran(False)
    assert ts.window is WindowState.ACCUMULATING
    ts.count_micro_step()
    assert ts.is_boundary() and not ts.at_window_start
    ts.add_loss(torch.tensor(5.0), 1)
    ts.backward_ran(False)
    ts.finalize(torch.tensor(0.5))
    assert ts.window is WindowState.FINAL and float(ts.window_norm) == 0.5
    with pytest.raises(ValueError, match=r"call engine.step\(\) to end the window first"):
        ts.backward_ran(False)  # the norm would no longer describe the gradients
    ts.step_done(applied=True, grad_norm=0.5, samples=8)
    assert (ts.global_steps, ts.micro_steps, ts.global_samples, ts.skipped_steps) == (1, 2, 8, 0)
    assert ts.window is WindowState.EMPTY and ts.window_norm is None and ts.step_applied
    assert float(ts.window_loss) == 8.0  # the finished window's, until reported
    ts.reset_window_loss()
    assert float(ts.window_loss) == 0.0
    ts.step_done(applied=False, grad_norm=None, samples=8)
    assert ts.skipped_steps == 1 and not ts.step_applied and ts.last_grad_norm is None


def test_boundary_override_and_a_scheduled_window() -> None:
    ts = TrainState(gradient_accumulation_steps=4, device=torch.device("cpu"))
    ts.set_boundary(True)
    assert ts.is_boundary() and not ts.at_window_start  # an override: the window's length is the caller's
    ts.set_boundary(None)
    ts.window_ran(torch.tensor(2.0))  # a pipeline's whole window: mean loss 2 over 4 micro-steps
    assert ts.micro_steps == 3 and ts.is_boundary() and float(ts.window_loss) == 8.0
    with pytest.raises(AssertionError):
        ts.window_ran(torch.tensor(2.0))  # not at a window's start


def test_counters_round_trip_and_rederive_micro_steps() -> None:
    ts = TrainState(gradient_accumulation_steps=2, device=torch.device("cpu"))
    for applied in (True, False, True):
        ts.count_micro_step()
        ts.step_done(applied=applied, grad_norm=1.0, samples=6)
    saved = ts.state_dict()
    assert saved == {"global_steps": 3, "micro_steps": 6, "global_samples": 18, "skipped_steps": 1}
    other = TrainState(gradient_accumulation_steps=3, device=torch.device("cpu"))
    other.load_state_dict({**saved, "loss_scaler": {}})  # the manifest's record has other keys too
    assert other.state_dict() == {**saved, "micro_steps": 9}  # the resumed job's own windows
    other.set_counters(global_steps=40, global_samples=480)
    assert (other.global_steps, other.global_samples) == (40, 480)
    with pytest.raises(ValueError, match="non-negative int"):
        other.set_counters(global_steps=-1)
    with pytest.raises(AttributeError, match="no counter 'steps'"):
        other.set_counters(steps=1)


def _engine_rank() -> dict:
    import terascale

    x, y = make_data(2, 4)
    config = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "steps_per_print": 1000, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip
    engine, *_ = terascale.initialize(model=make_model(), config=config)
    out: dict = {"stage_state": type(engine.model_state).__name__}
    for m in range(2):
        engine.backward(engine(x[0, 2 * m : 2 * m + 2], y[0, 2 * m : 2 * m + 2]))
        if m == 1:
            norm = engine.window_grad_norm()
            out["window"] = engine.train_state.window.name
            try:
                engine.backward(engine(x[0, :2], y[0, :2]))
            except ValueError as exc:
                out["late_backward"] = str(exc)
        engine.step()
    out["norm"] = (float(norm), engine.get_global_grad_norm())
    out["counters"] = (engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps)
    engine.global_steps = 7  # what a script that resumes by itself does (DeepSpeed's attribute)
    out["set"] = (engine.global_steps, engine.train_state.global_steps)
    try:
        engine.train_batch()
    except ValueError as exc:
        out["train_batch"] = str(exc)
    engine.destroy()
    return out


def test_engine_counters_window_and_refusals() -> None:
    (out,) = run_ranks(_engine_rank, 1)
    assert out["stage_state"] == "ReplicatedState"
    assert out["window"] == "FINAL"
    assert "call engine.step() to end the window first" in out["late_backward"]
    assert out["norm"][0] == pytest.approx(out["norm"][1]) and out["norm"][0] > 0
    assert out["counters"] == (1, 2, 4, 0)
    assert out["set"] == (7, 7)
    assert "needs a terascale.pipe.PipelineModule" in out["train_batch"]
