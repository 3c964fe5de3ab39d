"""A small ZeRO-2 training run that learns where it sits only from terascale.initialize.

Started by ``terascale run``, by ``mpirun``, or by hand with OpenMPI's or SLURM's variables
(tests/test_launch_discovery.py): it reads no rank variable itself. Trains a few steps on
fixed data, then writes ``OUT/rank<R>.json`` (rank, world size, local rank, the
``--local_rank`` it was given, the launcher it was discovered from) and, from rank 0,
``OUT/final.pt`` (the full state dict) for a parity check between launchers.
Usage: discovered_train.py [--local_rank=N] --out OUT [--steps K]
"""

import argparse
import json
import os
from pathlib import Path

import torch

import terascale


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)  # terascale run passes it, as DeepSpeed's launcher
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 2, generator=g))
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}  # fmt: skip
    launched_by = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "other"
    engine, _, loader, _ = terascale.initialize(model=model, config=config, training_data=data)
    batches = iter(loader)
    while engine.global_steps < args.steps:
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    state = engine.full_state_dict()
    ctx = engine.dist
    out = Path(args.out)
    record = {"rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
              "local_rank_arg": args.local_rank, "launched_by": launched_by,
              "env_local_rank": os.environ.get("LOCAL_RANK")}  # fmt: skip
    if ctx.rank == 0:
        torch.save({k: v.detach().clone() for k, v in state.items()}, out / "final.pt")
    (out / f".rank{ctx.rank}.json.tmp").write_text(json.dumps(record))
    (out / f".rank{ctx.rank}.json.tmp").rename(out / f"rank{ctx.rank}.json")
    engine.destroy()


if __name__ == "__main__":
    main()
