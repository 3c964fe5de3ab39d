"""Lightning on terascale (``TerascaleStrategy``) against plain Lightning DDP, real ranks.

The same LightningModule (fp32, AdamW and a step schedule from ``configure_optimizers``,
``accumulate_grad_batches=2``, ``gradient_clip_val=0.5``, 2 epochs of 5 micro-batches per
rank, so each epoch ends in a short window) trained with ``strategy="ddp"`` and with
``TerascaleStrategy`` at ZeRO stages 0, 2, 3 and 3 with CPU offload: the per-batch losses,
the validation loss and the final weights agree within fp32 rounding. Then a config with
its own optimizer and schedule, save and exact resume, and manual optimization.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from distributed import run_ranks

pytest.importorskip("lightning")

BATCH, DIM = 2, 16


def _module_class():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self, manual: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3)])
            self.head = nn.Linear(DIM, 4)
            self.automatic_optimization = not manual
            self.seen: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.seen.append(loss.item())
            if not self.automatic_optimization:
                opt = self.optimizers()
                self.manual_backward(loss)
                opt.step()
                opt.zero_grad()
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}

    return Net


def _data(n: int, seed: int = 1) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, DIM, generator=g), torch.randint(0, 4, (n,), generator=g))


def _fit(out: str, strategy, *, manual: bool = False, epochs: int = 2, ckpt: str | None = None, save: str | None = None):
    import lightning.pytorch as pl

    net = _module_class()(manual=manual)
    trainer = pl.Trainer(
        accelerator="cpu" if os.environ.get("TERASCALE_DEVICE") == "cpu" or not torch.cuda.is_available() else "gpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=1, strategy=strategy, max_epochs=epochs, enable_progress_bar=False,
        logger=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=out,
        accumulate_grad_batches=1 if manual else 2, gradient_clip_val=None if manual else 0.5,
        num_sanity_val_steps=0,
    )  # fmt: skip
    loaders = dict(
        train_dataloaders=torch.utils.data.DataLoader(_data(20), batch_size=BATCH),  # 5 micro-batches per rank
        val_dataloaders=torch.utils.data.DataLoader(_data(8, seed=2), batch_size=BATCH),
    )
    trainer.fit(net, ckpt_path=ckpt, **loaders)
    if save:
        trainer.save_checkpoint(save)
    val = float(trainer.callback_metrics["val_loss"])
    weights = trainer.strategy.full_state_dict() if hasattr(trainer.strategy, "full_state_dict") else {
        k: v.detach().clone() for k, v in net.state_dict().items()}  # fmt: skip
    return net.seen, val, weights, trainer


def _zero(stage: int, **extra) -> dict:
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": 0, **extra}}  # fmt: skip


def _parity_rank(out: str, cases: list[tuple[str, dict]]) -> dict:
    from terascale.integrations.lightning import TerascaleStrategy

    result = {"ddp": _fit(f"{out}/ddp", "ddp")[:3]}
    for name, config in cases:
        seen, val, weights, trainer = _fit(f"{out}/{name}", TerascaleStrategy(config=config))
        result[name] = (seen, val, weights)
        result[name + "/resolved"] = {r.path: r.value for r in trainer.strategy.engine.config.resolved}
    return result


def test_strategy_matches_plain_ddp_at_every_stage(tmp_path):
    cases = [("stage0", _zero(0)), ("stage2", _zero(2)), ("stage3", _zero(3)),
             ("stage3_cpu", _zero(3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}))]  # fmt: skip
    results = run_ranks(_parity_rank, 2, str(tmp_path), cases, timeout=400)
    for rank_result in results:
        ref_seen, ref_val, ref_weights = rank_result["ddp"]
        assert len(ref_seen) == 10
        for name, _ in cases:
            seen, val, weights = rank_result[name]
            torch.testing.assert_close(torch.tensor(seen), torch.tensor(ref_seen), rtol=1e-5, atol=1e-6, msg=name)
            assert val == pytest.approx(ref_val, rel=1e-5), name
            for k, v in ref_weights.items():
                torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=2e-6, msg=f"{name}: {k}")
    resolved = results[0]["stage2/resolved"]
    assert resolved["gradient_accumulation_steps"] == 2 and resolved["gradient_clipping"] == 0.5
    assert resolved["train_micro_batch_size_per_gpu"] == BATCH


def _resume_rank(out: str) -> dict:
    from terascale.integrations.lightning import TerascaleStrategy

    config = {**_zero(3), "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}  # fmt: skip
    whole, *_ = _fit(f"{out}/whole", TerascaleStrategy(config=config), epochs=2)
    first, *_ = _fit(f"{out}/first", TerascaleStrategy(config=config), epochs=1, save=f"{out}/ckpt")
    rest, _, weights, _ = _fit(f"{out}/rest", TerascaleStrategy(config=config), epochs=2, ckpt=f"{out}/ckpt")
    manual, *_ = _fit(f"{out}/manual", TerascaleStrategy(config=_zero(2)), manual=True, epochs=1)
    ddp_manual, *_ = _fit(f"{out}/ddp_manual", "ddp", manual=True, epochs=1)
    files = sorted(os.listdir(f"{out}/ckpt")) if int(os.environ["RANK"]) == 0 else []
    return {"whole": whole, "first": first, "rest": rest, "manual": manual, "ddp_manual": ddp_manual, "files": files}


def test_config_optimizer_save_resume_and_manual_optimization(tmp_path):
    r = run_ranks(_resume_rank, 2, str(tmp_path), timeout=400)[0]
    assert len(r["whole"]) == 10 and len(r["first"]) == 5
    # A fresh fit from the checkpoint of epoch 1 continues on the uninterrupted run's losses.
    assert r["first"] + r["rest"] == r["whole"]
    assert "latest" in r["files"] and "checkpoint" in r["files"]
    torch.testing.assert_close(torch.tensor(r["manual"]), torch.tensor(r["ddp_manual"]), rtol=1e-5, atol=1e-6)


def test_a_tensor_parallel_group_is_one_data_parallel_replica():
    """With tensor parallelism the sampler shards over replicas (world / tp), not ranks:
    the ranks of one tensor-parallel group must see the same samples."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from terascale.integrations.lightning import TerascaleStrategy

    for tp, rank, expected in ((2, 3, {"num_replicas": 2, "rank": 1}), (4, 3, {"num_replicas": 1, "rank": 0}),
                               (1, 3, {"num_replicas": 4, "rank": 3})):  # fmt: skip
        env = LightningEnvironment()
        env.set_world_size(4)
        env.set_global_rank(rank)
        config = {"train_batch_size": 8, "tensor_parallel": {"autotp_size": tp}}
        assert TerascaleStrategy(config=config, cluster_environment=env).distributed_sampler_kwargs == expected
