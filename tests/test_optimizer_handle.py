"""The optimizer ``initialize`` returns ([Note: the optimizer initialize returns]): a loop that
steps it as DeepSpeed programs step DeepSpeed's optimizer (Ray Train's guide:
``engine.backward(loss); optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()``)
trains exactly as ``engine.backward(loss); engine.step()`` does, the schedule stepped once a
step either way (2 ranks, gloo, ZeRO-2 and ZeRO-3, with accumulation and clipping)."""

from __future__ import annotations

import os

import pytest
import torch

from distributed import run_ranks
from toy import make_data, make_model

STEPS, MICRO, GAS = 4, 2, 2


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }


def _train(stage: int, through_handle: bool) -> dict:
    import terascale

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    engine, optimizer, _, scheduler = terascale.initialize(model=make_model(), config=_config(stage))
    x, y = make_data(STEPS * GAS, MICRO * world)
    losses, lrs = [], []
    for s in range(STEPS * GAS):
        loss = engine(x[s, rank * MICRO : (rank + 1) * MICRO], y[s, rank * MICRO : (rank + 1) * MICRO])
        engine.backward(loss)
        if through_handle:
            optimizer.step()
            if (s + 1) % GAS == 0:
                scheduler.step()  # once the window's update ran
            optimizer.zero_grad()
        else:
            engine.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
    out = {"losses": losses, "lrs": lrs, "steps": engine.global_steps, "state": engine.full_state_dict(),
           "handle": (isinstance(optimizer, torch.optim.Optimizer), optimizer.optimizer is engine.optimizer,
                      optimizer.param_groups is engine.optimizer.param_groups, optimizer.overflow,
                      sorted(optimizer.state_dict()) == sorted(engine.optimizer.state_dict()))}  # fmt: skip
    engine.destroy()
    return out


def _rank() -> list[tuple[dict, dict]]:
    return [(_train(stage, False), _train(stage, True)) for stage in (2, 3)]


def test_stepping_the_returned_optimizer_trains_as_engine_step():
    for rank_out in run_ranks(_rank, 2):
        for stage, (engine_step, handle_step) in zip((2, 3), rank_out):
            assert handle_step["losses"] == engine_step["losses"], stage
            assert handle_step["lrs"] == engine_step["lrs"], stage  # one schedule step per update
            assert handle_step["steps"] == engine_step["steps"] == STEPS
            for name, value in engine_step["state"].items():
                assert torch.equal(handle_step["state"][name], value), (stage, name)
            assert handle_step["handle"] == (True, True, True, False, True)
            assert len(set(engine_step["lrs"])) > 1  # the warm-up moved the rate


def test_the_handle_is_the_program_s_optimizer_to_equality_and_isinstance(own_process_group):
    """DeepSpeed hands a program back the optimizer it passed where it needs no wrapper: the
    handle compares equal to it and is an instance of its class (and of a config-built one's)."""
    import terascale

    model = make_model()
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, handle, _, _ = terascale.initialize(model=model, optimizer=mine, config={"train_batch_size": 1})
    assert handle == mine and mine == handle and handle != torch.optim.SGD(make_model().parameters(), lr=0.1)
    assert isinstance(handle, torch.optim.SGD) and not isinstance(handle, torch.optim.Adam)
    assert handle.param_groups is mine.param_groups and {handle: 1}[handle] == 1
    x, y = make_data(1, 1)
    engine.backward(engine(x[0], y[0]))
    before = [p.detach().clone() for p in model.parameters()]
    handle.step()  # the engine's step: the program's SGD updates the model
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    engine.destroy()
    model = make_model()
    engine, handle, _, _ = terascale.initialize(model=model, config={"train_batch_size": 1, "optimizer": {
        "type": "AdamW", "params": {"lr": 1e-3}}})  # fmt: skip
    assert isinstance(handle, torch.optim.AdamW) and handle == engine.optimizer
    engine.destroy()


def test_initialize_without_a_model_says_so():
    import terascale

    with pytest.raises(ValueError, match="requires a model, a torch.nn.Module; got NoneType"):
        terascale.initialize(model=None, config={"train_batch_size": 1})
