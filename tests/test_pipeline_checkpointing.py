"""``pipeline.use_reentrant``: a ``PipelineModule`` checkpoints with torch's reentrant form
by default (DeepSpeed's) and with the non-reentrant form for ``false``; both train as
without checkpointing, on two stages at ZeRO-0 and ZeRO-3, the first stage's inputs
requiring no gradient and the second stage starting with an in-place layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_ranks

DIM, MICRO, GAS, STEPS = 8, 2, 2, 3


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM),  # stage 0
            nn.ReLU(inplace=True), nn.Linear(DIM, DIM), nn.Linear(DIM, 1)]  # stage 1  # fmt: skip


def _rank(cases: list[tuple[int, int, bool | None]]) -> list[dict]:
    import terascale
    from terascale.checkpointing import non_reentrant_checkpoint, reentrant_checkpoint
    from terascale.pipe import PipelineModule

    out = []
    for stage, interval, use_reentrant in cases:
        model = PipelineModule(_layers(), num_stages=2, loss_fn=lambda y, t: ((y - t) ** 2).mean(),
                               partition_method="uniform")  # fmt: skip
        config = {
            "train_batch_size": MICRO * GAS,
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "pipeline": {"activation_checkpoint_interval": interval},
        }
        if use_reentrant is not None:
            config["pipeline"]["use_reentrant"] = use_reentrant
        engine, *_ = terascale.initialize(model=model, config=config)
        # The form that ran: a reentrant checkpoint runs its forward under no_grad.
        grad_modes: list[bool] = []
        for layer in engine.module.modules():
            if isinstance(layer, nn.Linear):
                layer.register_forward_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
                break
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(STEPS):
            batches = [(torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, 1, generator=g)) for _ in range(GAS)]
            losses.append(float(engine.train_batch(iter(batches))))
        func = engine.module.activation_checkpoint_func
        out.append({
            "losses": losses, "state": engine.full_state_dict(),
            "func": "non" if func is non_reentrant_checkpoint else "re" if func is reentrant_checkpoint else repr(func),
            "reentrant": engine._reentrant_activation_checkpointing(),
            "no_grad_forwards": grad_modes.count(False),
        })  # fmt: skip
        if interval == 0 and use_reentrant is False:  # turned on later, still in the configured form
            engine.module.set_checkpoint_interval(2)
            out[-1]["later"] = (engine.module.is_checkpointable_results, engine._reentrant_activation_checkpointing())
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_use_reentrant_picks_the_checkpoint_form_and_both_train_alike(stage: int) -> None:
    # Segments of two layers: the second stage's first starts with the in-place ReLU.
    cases = [(stage, 0, None), (stage, 2, None), (stage, 2, True), (stage, 2, False), (stage, 0, False)]
    for rank_results in run_ranks(_rank, 2, cases):
        by_case = dict(zip(cases, rank_results))
        ref = by_case[(stage, 0, None)]
        for case in cases[1:4]:
            got = by_case[case]
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), case
            for k, v in ref["state"].items():
                torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"{case}: {k}")
        assert ref["func"] == "re" and not ref["reentrant"] and ref["no_grad_forwards"] == 0
        for use_reentrant in (None, True):
            got = by_case[(stage, 2, use_reentrant)]
            assert got["func"] == "re" and got["reentrant"]
            assert got["no_grad_forwards"] == STEPS * GAS  # each micro-batch's forward, not its recompute
        non = by_case[(stage, 2, False)]
        assert non["func"] == "non" and not non["reentrant"] and non["no_grad_forwards"] == 0
        off = by_case[(stage, 0, False)]
        assert off["func"] == "non" and not off["reentrant"]
        # Each stage holds three layers: segments of two, the first with parameters.
        assert off["later"][1] is False and off["later"][0][0] is True
