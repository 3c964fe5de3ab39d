"""Windows the caller shapes: ``engine.coalesce_grad_reduction()`` and
``managed_gradient_accumulation: false`` ([Note: deferred reduction] in terascale/zero/grads.py),
and ``gradient_allreduce_op: "sum"``, at every ZeRO stage against the plain PyTorch reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distributed import run_ranks
from parity import MICRO, STEPS, Case, assert_matches_reference, config
from toy import make_data, make_model

GAS = 4
WORLD = 2
STAGES = [0, 1, 2, 3]


def _reductions(engine) -> int:
    """Gradient collectives this rank has launched so far."""
    state = engine.model_state
    stats = state.grads.comm if hasattr(state, "grads") else state.comm_stats
    return stats.collectives


def _train_rank(world: int, case: Case, mode: str) -> tuple:
    """Train ``case`` with the windows shaped by ``mode``: ``managed`` (a step per micro-step),
    ``coalesce`` (the window's backwards in coalesce_grad_reduction, the boundary set by the
    caller), ``coalesce_exit`` (no boundary set: the block's exit reduces) or ``unmanaged``
    (every backward, then one step)."""
    import os

    from torch import nn

    import terascale
    from terascale.zero import WrapPolicy

    rank = int(os.environ["RANK"])
    model = make_model(seed=0 if rank == 0 else 100 + rank)
    engine, *_ = terascale.initialize(
        model=model, config=config(world, case), wrap_policy=WrapPolicy(module_classes=(nn.Linear,))
    )
    x, y = make_data(STEPS, MICRO * case.gas * world)
    losses, applied, collectives = [], [], []
    for s in range(STEPS):
        before = _reductions(engine)
        block = engine.coalesce_grad_reduction() if mode.startswith("coalesce") else _Null()
        with block:
            for m in range(case.gas):
                lo = (m * world + engine.dist.dp_rank) * MICRO
                if mode == "coalesce":
                    engine.set_gradient_accumulation_boundary(m == case.gas - 1)
                loss = engine(x[s, lo : lo + MICRO], y[s, lo : lo + MICRO])
                engine.backward(loss)
                losses.append(loss.item())
                if mode == "managed":
                    engine.step()
                    applied.append(engine.was_step_applied())
        if mode != "managed":
            if mode == "coalesce_exit":
                engine.set_gradient_accumulation_boundary(True)
            engine.step()
            if mode.startswith("coalesce"):
                engine.set_gradient_accumulation_boundary(None)
            applied.append(engine.was_step_applied())
        collectives.append(_reductions(engine) - before)
    counters = (engine.global_steps, engine.global_samples)
    state = engine.full_state_dict()
    engine.destroy()
    return losses, state, applied, collectives, counters


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("stage", [*STAGES, "3-nvme"])
def test_coalesced_and_unmanaged_windows_equal_the_reference(stage: int | str, tmp_path) -> None:
    """Every way of shaping the window trains as the plain PyTorch reference does, and at
    stages 2-3 a coalesced window reduces once where a managed one reduces every micro-step.
    With the optimizer on NVMe (no clipping: its managed windows step under backward)."""
    if stage == "3-nvme":
        nvme = {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
        stage, case = 3, Case(gas=GAS, stage=3, zero=nvme)
    else:
        case = Case(gas=GAS, clip=1.0, stage=stage)
    unmanaged = dataclasses.replace(case, extra={"managed_gradient_accumulation": False})
    runs = {
        mode: run_ranks(_train_rank, WORLD, WORLD, unmanaged if mode == "unmanaged" else case, mode)
        for mode in ("managed", "coalesce", "coalesce_exit", "unmanaged")
    }
    for mode, results in runs.items():
        assert_matches_reference(WORLD, case, results, zero_unused_grads=stage > 0)
        for _, _, applied, _, counters in results:
            assert counters == (STEPS, STEPS * MICRO * GAS * WORLD), mode
            expected = [m == GAS - 1 for m in range(GAS)] * STEPS if mode == "managed" else [True] * STEPS
            assert applied == expected, mode
    managed = runs["managed"][0][3][-1]
    for mode in ("coalesce", "coalesce_exit"):
        coalesced = runs[mode][0][3][-1]
        if stage >= 2:  # one reduction per group instead of one per group and micro-step
            # (managed: a group unused in the window is reduced once, at its end)
            assert coalesced * (GAS - 1) <= managed, (mode, coalesced, managed)
        else:
            assert coalesced == managed, (mode, coalesced, managed)


def _refusals_rank() -> dict:
    import terascale

    out: dict = {}
    x, y = make_data(1, 4)
    cfg = config(1, Case(gas=2, stage=1))  # stage 1: no_sync is allowed there, so the mixed blocks nest
    engine, *_ = terascale.initialize(model=make_model(), config=cfg)
    with engine.coalesce_grad_reduction():
        engine.backward(engine(x[0, :2], y[0, :2]))
        try:
            engine.step()
        except ValueError as exc:
            out["step_inside"] = str(exc)
        try:
            with engine.coalesce_grad_reduction():
                pass
        except ValueError as exc:
            out["nested"] = str(exc)
    for outer, inner in ((engine.no_sync, engine.coalesce_grad_reduction), (engine.coalesce_grad_reduction, engine.no_sync)):
        try:
            with outer(), inner():
                pass
        except AssertionError as exc:  # a UsageError: DeepSpeed asserts here
            out.setdefault("mixed", []).append(str(exc))
    engine.destroy()
    engine, *_ = terascale.initialize(model=make_model(), config={**cfg, "managed_gradient_accumulation": False})
    try:
        engine.set_gradient_accumulation_boundary(True)
    except ValueError as exc:
        out["boundary"] = str(exc)
    try:
        with engine.coalesce_grad_reduction():
            pass
    except ValueError as exc:
        out["coalesce_unmanaged"] = str(exc)
    # Two backwards, one step: the samples counted are the micro-batches trained.
    for m in range(2):
        engine.backward(engine(x[0, 2 * m : 2 * m + 2], y[0, 2 * m : 2 * m + 2]))
    engine.step()
    out["samples"] = engine.global_samples
    engine.destroy()
    return out


def test_refusals_and_counters() -> None:
    (out,) = run_ranks(_refusals_rank, 1)
    assert "call engine.step() after the with-block" in out["step_inside"]
    assert "nested in another one" in out["nested"]
    assert "every engine.step() ends the accumulation window already" in out["boundary"]
    assert len(out["mixed"]) == 2 and all("nested in" in m for m in out["mixed"]), out["mixed"]
    assert "managed_gradient_accumulation false" in out["coalesce_unmanaged"]
    assert out["samples"] == 2 * MICRO


def _sum_rank(stage: int, op: str) -> list[float]:
    import terascale

    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    cfg = {
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
        "gradient_allreduce_op": op, "zero_optimization": {"stage": stage},
    }  # fmt: skip
    engine, *_ = terascale.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=cfg)
    engine.backward(engine(torch.tensor([1.0, 2.0])).sum())
    engine.step()
    weight = engine.full_state_dict()["weight"].flatten().tolist()
    engine.destroy()
    return weight


@pytest.mark.parametrize("stage", STAGES)
def test_summed_gradient_reduction(stage: int) -> None:
    """``"sum"`` adds the ranks' gradients where ``"mean"`` averages them (one SGD step of lr 1)."""
    for op, scale in (("mean", 1.0), ("sum", float(WORLD))):
        for weight in run_ranks(_sum_rank, WORLD, stage, op):
            assert weight == pytest.approx([-1.0 * scale, -2.0 * scale]), (op, stage)
