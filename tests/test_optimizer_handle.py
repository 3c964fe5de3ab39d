"""The optimizer ``initialize`` returns ([Note: the optimizer initialize returns]): a loop that
steps it as DeepSpeed programs step DeepSpeed's optimizer (Ray Train's guide:
``engine.backward(loss); optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()``)
trains exactly as ``engine.backward(loss); engine.step()`` does, the schedule stepped once a
step either way (2 ranks, gloo, ZeRO-2 and ZeRO-3, with accumulation and clipping)."""

from __future__ import annotations

import os

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
