"""Pipeline x tensor x data parallelism composed under one engine.

pp=2 x tp=2 (4 ranks) trains like the plain single-process model (losses within 1e-5,
weights within 1e-4) with ZeRO over data parallelism where the layout has it; and a
checkpoint saved at pp=2 x tp=2 loads at dp=4 ZeRO-3, whose checkpoint loads at
pp=2 x dp=2 ZeRO-2, continuing the uninterrupted trajectory.
"""

from __future__ import annotations

import torch

from distributed import run_ranks
from tp_model import TokenLoss, layer_specs, make_batches, reference_layers

MICRO, LR, WD, CLIP, ROWS = 2, 1e-2, 0.01, 0.05, 8  # ROWS: the global batch of every layout


def _config(stage: int, dp: int) -> dict:
    return {
        "train_batch_size": ROWS,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ROWS // (MICRO * dp),
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }


def _micro_batches(ids: torch.Tensor, labels: torch.Tensor, step: int, dp: int, dp_rank: int) -> list:
    gas = ROWS // (MICRO * dp)
    rows = [slice((k * dp + dp_rank) * MICRO, (k * dp + dp_rank + 1) * MICRO) for k in range(gas)]
    return [(ids[step, r], labels[step, r]) for r in rows]


def _engine(pp: int, tp: int, stage: int, seed: int = 1234, virtual: int = 1, checkpointed: bool = False):
    import terascale
    from terascale.parallel import Topology
    from terascale.pipe import PipelineModule

    topo = Topology(pp=pp, tp=tp)
    group = topo.group("tp") if tp > 1 else None
    model = PipelineModule(layer_specs(group), topology=topo, loss_fn=TokenLoss(group), partition_method="uniform",
                           seed_layers=True, base_seed=seed, virtual_stages=virtual,
                           activation_checkpoint_interval=1 if checkpointed else 0)  # fmt: skip
    config = _config(stage, topo.size("dp"))
    if checkpointed:  # each tp rank keeps half of every checkpointed input, all-gathered for the recompute
        config["activation_checkpointing"] = {"partition_activations": True}
    engine, *_ = terascale.initialize(model=model, config=config)
    return engine, topo


def _reference(steps: int, ids: torch.Tensor, labels: torch.Tensor) -> tuple[list[float], dict]:
    model = reference_layers()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = TokenLoss()(model(ids[step]), labels[step])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _parity_rank(layouts: list[tuple[int, int, int, int]]) -> list[dict]:
    out = []
    ids, labels = make_batches(3, ROWS)
    ref_losses, ref_state = _reference(3, ids, labels)
    for pp, tp, stage, virtual, *checkpointed in layouts:
        engine, topo = _engine(pp, tp, stage, virtual=virtual, checkpointed=bool(checkpointed))
        dp, dp_rank = topo.size("dp"), topo.rank("dp")
        losses = [float(engine.train_batch(iter(_micro_batches(ids, labels, s, dp, dp_rank)))) for s in range(3)]
        out.append({"layout": (pp, tp, stage, virtual, *checkpointed), "losses": losses, "state": engine.full_state_dict(),
                    "ref_losses": ref_losses, "ref_state": ref_state})  # fmt: skip
        engine.destroy()
    return out


def _check(results: list) -> None:
    for rank, per_layout in enumerate(results):
        for r in per_layout:
            where = f"rank {rank} (pp, tp, stage, v)={r['layout']}"
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=1e-6, msg=where)
            assert set(r["state"]) == set(r["ref_state"]), where
            for name, ref in r["ref_state"].items():
                torch.testing.assert_close(r["state"][name], ref, rtol=1e-4, atol=1e-5, msg=f"{where}: {name}")


def test_pp2_tp2_parity_with_plain_pytorch() -> None:
    # pp=2 x tp=2 (no data parallelism: ZeRO has one rank); interleaved; pp=2 x dp=2 x tp=1 is
    # tests/test_pipeline.py's, tp=2 x dp=2 tests/test_tensor_parallel_engine.py's.
    # The last: ZeRO-3 inside each stage, activation checkpointing with partitioned inputs.
    _check(run_ranks(_parity_rank, 4, [(2, 2, 0, 1), (2, 2, 1, 2), (2, 2, 3, 1, True)], timeout=400))


def _reshard_rank(folder: str) -> dict:
    ids, labels = make_batches(6, ROWS)
    losses, state = [], None
    for phase, (pp, tp, stage) in enumerate([(2, 2, 1), (1, 1, 3), (2, 1, 2)]):
        # Resumed phases start from other weights: loading must overwrite all of them.
        engine, topo = _engine(pp, tp, stage, seed=1234 if phase == 0 else 99)
        if phase:
            path, _ = engine.load_checkpoint(folder)
            assert path is not None and engine.global_steps == 2 * phase
        dp, dp_rank = topo.size("dp"), topo.rank("dp")
        for step in range(2 * phase, 2 * phase + 2):
            losses.append(float(engine.train_batch(iter(_micro_batches(ids, labels, step, dp, dp_rank)))))
        engine.save_checkpoint(folder)
        state = engine.full_state_dict()
        engine.destroy()
    ref_losses, ref_state = _reference(6, ids, labels)
    return {"layout": "reshard", "losses": losses, "state": state, "ref_losses": ref_losses, "ref_state": ref_state}


def test_checkpoint_reshards_from_pp2_tp2_to_zero3_dp4_to_pp2_dp2_and_continues_the_trajectory(tmp_path) -> None:
    from terascale.checkpoint import consolidated_state_dict

    results = run_ranks(_reshard_rank, 4, str(tmp_path / "ckpt"), timeout=400)
    _check([[r] for r in results])
    merged = consolidated_state_dict(tmp_path / "ckpt")
    for name, ref in results[0]["ref_state"].items():
        torch.testing.assert_close(merged[name], ref, rtol=1e-4, atol=1e-5, msg=name)
