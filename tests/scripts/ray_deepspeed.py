"""A DeepSpeed training function written as Ray Train's DeepSpeed guide writes it
(``train_func(config)`` calling ``deepspeed.initialize`` with the training data and a collate
function, then ``model.backward``, ``optimizer.step``, ``lr_scheduler.step``,
``optimizer.zero_grad``, and each epoch ``model.save_checkpoint`` into a temporary directory of
the worker's own, reported to Ray), run with ``TERASCALE_AS_DEEPSPEED=1`` two ways by
tests/test_ray_train.py:

    python ray_deepspeed.py ray OUT_JSON STORAGE      # TorchTrainer, 2 CPU workers, local Ray
    terascale run --nproc 2 ray_deepspeed.py run OUT_JSON

Ray forms the gloo process group in its workers and terascale joins it; under ``terascale
run`` terascale forms it. Either way rank 0's losses (every step, both epochs) go to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

SAMPLES, FEATURES, EPOCHS = 48, 8, 2

DEEPSPEED_CONFIG = {
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"},
                          "stage3_param_persistence_threshold": 0},
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "train_micro_batch_size_per_gpu": 4,
    "wall_clock_breakdown": False,
}


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.body(x)).squeeze(-1), y)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x.sum(-1).sin()
    return [{"x": x[i], "y": y[i]} for i in range(SAMPLES)]


def collate_fn(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([b[k] for b in batch]) for k in batch[0]}


def train_func(config: dict) -> None:
    """Launched on each worker (Ray's guide's shape)."""
    torch.manual_seed(config["seed"])
    model = Regressor()
    model, optimizer, train_dataloader, lr_scheduler = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=dataset(),
        collate_fn=collate_fn,
        config=config["deepspeed_config"],
    )
    device = get_accelerator().device_name(model.local_rank)
    losses = []
    for epoch in range(config["num_epochs"]):
        model.train()
        for batch in train_dataloader:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = model(**batch)
            model.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / torch.distributed.get_world_size())
        metrics = {"epoch": epoch, "losses": list(losses)}
        with tempfile.TemporaryDirectory() as tmpdir:  # a different one on each worker
            model.save_checkpoint(tmpdir)
            torch.distributed.barrier()
            if config["under_ray"]:
                import ray.train

                ray.train.report(metrics=metrics, checkpoint=ray.train.Checkpoint.from_directory(tmpdir))
    if model.global_rank == 0 and config.get("out"):
        with open(config["out"], "w") as f:
            json.dump({"losses": losses, "world": torch.distributed.get_world_size(),
                       "launcher": "ray" if config["under_ray"] else "terascale run"}, f)


def main(argv: list[str]) -> None:
    argv = [a for a in argv if not a.startswith("--local_rank")]  # terascale run passes it, as DeepSpeed's launcher does
    mode, out = argv[0], argv[1]
    config = {"seed": 42, "num_epochs": EPOCHS, "deepspeed_config": DEEPSPEED_CONFIG, "out": out,
              "under_ray": mode == "ray"}
    if mode == "run":
        train_func(config)
        return
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # A local cluster on the loopback address (its services and the workers' gloo group).
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"TERASCALE_AS_DEEPSPEED": "1", "OMP_NUM_THREADS": "1"}})
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=argv[2], name="ray_deepspeed"),
    )
    result = trainer.fit()
    ray.shutdown()
    with open(out) as f:
        written = json.load(f)
    # What Ray reported last: the metrics, and the checkpoint it kept (in its storage).
    written.update(reported=result.metrics, checkpoint=result.checkpoint.path)
    with open(out, "w") as f:
        json.dump(written, f)


if __name__ == "__main__":
    main(sys.argv[1:])
