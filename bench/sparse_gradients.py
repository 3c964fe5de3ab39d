"""Sparse gradients: bytes communicated and step time for a large embedding, sparse vs dense.

    python bench/sparse_gradients.py                          # 1M x 256, stages 0 and 2, 2 ranks
    python bench/sparse_gradients.py --stages 0 --repeats 3 --steps 10
    python bench/sparse_gradients.py --rows 200000 --touched 0.05 --optimizer adam

The model is an ``nn.Embedding(rows, dim)`` (``sparse=True`` or not) and a small linear
head; each optimizer step's global batch looks up ``touched x rows`` distinct rows, split
over the ranks. Both variants run terascale with ``"sparse_gradients": true`` (a dense
embedding then simply has no sparse gradient), so the only difference is whether the
table's gradient is reduced as rows (see [Note: sparse gradients]) or as a dense
all-reduce / reduce-scatter.

The driver starts one ``torchrun`` job per (variant, stage, repeat), interleaved with the
order rotated each repeat (``bench/step_time.py``'s runner). Each job reports per-step
times, losses and the bytes its rank 0 sent reducing gradients in each step (from the
reducer's ``CommStats``: a ring all-reduce of n bytes counts 2 (w-1)/w n, a
reduce-scatter (w-1)/w n, an all-gather of k bytes (w-1) k). The driver prints a
markdown table: gradient bytes per step and rank, the dense/sparse byte ratio, median
ms/step with the spread of per-repeat medians, and the largest loss difference between
the two variants, which must stay within fp32 rounding (the run fails otherwise). Raw
numbers go to ``--json``. Stages 1-3 also all-gather the updated parameters after each
step (dense, and not changed by sparse gradients); those bytes are not counted here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import run_interleaved  # noqa: E402  (the same torchrun jobs, interleaved and rotated)

VARIANTS = ("dense", "sparse")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="0,2", help="comma-separated ZeRO stages to run")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--touched", type=float, default=0.01, help="fraction of rows one global batch looks up")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    p.add_argument("--json", default="runs/bench/sparse_gradients.json",
                   help="where to write every run's per-step times, bytes and losses")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: variant-stage to run
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # internal: JSON path
    return p.parse_args(argv)


# -- one training job (runs under torchrun) ------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import terascale

    variant, stage = args.worker.rsplit("-", 1)
    torch.set_num_threads(args.threads)
    world = int(os.environ["WORLD_SIZE"])

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(args.rows, args.dim, sparse=variant == "sparse")
            self.head = nn.Linear(args.dim, args.classes)

        def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.head(torch.tanh(self.emb(ids))), y)

    torch.manual_seed(0)
    model = Model()
    optimizer = ({"type": "SGD", "params": {"lr": 0.1}} if args.optimizer == "sgd"
                 else {"type": "Adam", "params": {"lr": 1e-3}})
    per_rank = max(1, int(args.touched * args.rows) // world)
    config = {
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": optimizer,
        "sparse_gradients": True,
        "zero_optimization": {"stage": int(stage)},
    }
    engine, *_ = terascale.initialize(model=model, config=config)
    rank = engine.dist.dp_rank
    stats = engine.model_state.comm_stats if int(stage) == 0 else engine.model_state.grads.comm

    # Distinct rows per global batch (a permutation's prefix), the same on every rank.
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(args.rows, generator=g)[: per_rank * world] for _ in range(args.steps)])
    y = torch.randint(0, args.classes, (args.steps, per_rank * world), generator=g)
    times, losses, sent = [], [], []
    for s in range(args.steps):
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        before = stats.bytes_sent
        t0 = time.perf_counter()
        loss = engine(ids[s, mine], y[s, mine])
        engine.backward(loss)
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        times.append(time.perf_counter() - t0)
        sent.append(stats.bytes_sent - before)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"times": times, "losses": losses, "bytes": sent,
                                                 "rows_per_rank": per_rank, "device": engine.device.type}))
    dist.barrier()  # every rank leaves its last collective before the group is torn down
    engine.destroy()


# -- the driver -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup")
    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    systems = [f"{v}-{s}" for s in stages for v in VARIANTS]
    runs = run_interleaved(args, systems, __file__)

    def median_ms(system: str) -> tuple[float, list[float]]:
        per_rep = [statistics.median(res["times"][args.warmup:]) * 1e3 for res in runs[system]]
        return statistics.median(t for res in runs[system] for t in res["times"][args.warmup:]) * 1e3, per_rep

    first = runs[systems[0]][0]
    touched = first["rows_per_rank"] * args.nproc
    print(f"\nEmbedding {args.rows:,} x {args.dim} + linear head ({args.classes} classes), fp32, "
          f"{args.optimizer}, {touched:,} distinct rows per step ({touched / args.rows:.2%}), "
          f"{args.nproc} ranks x {args.threads} thread(s), {first['device']}, "
          f"{args.repeats} interleaved repeats x {args.steps - args.warmup} timed steps\n")
    print("| stage | gradients | gradient bytes sent/step/rank | dense ÷ this | ms/step (median) "
          "| per-repeat medians | max Δloss vs dense |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for stage in stages:
        dense = runs[f"dense-{stage}"]
        dense_bytes = statistics.median(b for res in dense for b in res["bytes"])
        for variant in VARIANTS:
            system = f"{variant}-{stage}"
            nbytes = statistics.median(b for res in runs[system] for b in res["bytes"])
            ms, per_rep = median_ms(system)
            diff = max(abs(a - b) for res in runs[system] for a, b in zip(res["losses"], dense[0]["losses"]))
            worst = max(worst, diff)
            print(f"| {stage} | {variant} | {nbytes / 2**20:,.2f} MiB | {dense_bytes / max(nbytes, 1):,.1f}x | "
                  f"{ms:.1f} | {min(per_rep):.1f}–{max(per_rep):.1f} | {diff:.1e} |")
    if worst > 1e-4:
        raise SystemExit(f"loss curves disagree by {worst:.2e} (> 1e-4): sparse and dense train differently")


if __name__ == "__main__":
    main()
