"""Memory-centric tiling: the largest single linear layer ZeRO-3 + parameter offload trains
within a budget of gathered parameter memory, untiled vs TiledLinear.

    python bench/tiling.py                                   # budget 72 MiB, 2 ranks
    python bench/tiling.py --budget-mib 16 --layers untiled:2048,tiled:8192:8

Each layer (``untiled:D`` = ``nn.Linear(D, D)``, ``tiled:D:K`` = ``TiledLinear(D, D)`` with
K x K tiles) trains ``--steps`` steps in its own 2-rank job at ZeRO stage 3 with
parameters and optimizer state offloaded to host memory, prefetch and reuse distance 0
(DeepSpeed's knobs for the tightest working set). Every tile samples the parameter bytes
gathered on its rank when it runs in forward and in backward: the peak is the working set
a device must hold for this layer, the quantity ZeRO-Infinity's tiling bounds. A layer
fits the budget when its peak does. Also printed: peak RSS per rank (everything: the host
holds the offloaded state), ms/step and the loss (it must fall).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="untiled:2048,untiled:4096,untiled:8192,tiled:8192:4,tiled:16384:8",
                   help="comma-separated untiled:D or tiled:D:K")  # fmt: skip
    p.add_argument("--budget-mib", type=float, default=72.0, help="gathered parameter bytes allowed per rank")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16, help="rows per rank per step")
    p.add_argument("--json", default="runs/bench/tiling.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import terascale
    from terascale.zero import ShardState, TiledLinear

    torch.set_num_threads(args.threads)
    kind, d, *k = args.worker.split(":")
    d = int(d)
    samples: list[int] = []
    state_box: list = []

    def sample() -> None:
        state = state_box[0]
        samples.append(sum(fg.layout.padded_numel * fg.dtype.itemsize for fg in state.groups
                           if not fg.persistent and fg.state is not ShardState.SHARDED))  # fmt: skip

    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return y.view_as(y)

        @staticmethod
        def backward(ctx, grad):
            sample()
            return grad

    class ProbeLinear(nn.Linear):
        def forward(self, x):
            sample()
            return _Probe.apply(super().forward(x))

    torch.manual_seed(0)
    with torch.device("cpu"):
        if kind == "untiled":
            layer = ProbeLinear(d, d)
        else:
            layer = TiledLinear(d, d, in_splits=int(k[0]), out_splits=int(k[0]), linear_cls=ProbeLinear)
    config = {
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0,
        },
    }  # fmt: skip
    engine, *_ = terascale.initialize(model=layer, config=config)
    state_box.append(engine.model_state)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, d, generator=g)
    target = torch.randn(args.tokens, d, generator=g)
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = F.mse_loss(engine(x), target)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, {"gathered": max(samples), "rss": peak, "times": times, "losses": losses})
    if rank == 0:
        Path(args.result).write_text(json.dumps(out))
    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()


def run(args: argparse.Namespace, layer: str, result: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, f"--worker={layer}", f"--result={result}", f"--steps={args.steps}",
           f"--tokens={args.tokens}", f"--threads={args.threads}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if not result.exists():
        raise SystemExit(f"{layer} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    budget = args.budget_mib * 2**20
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for layer in args.layers.split(","):
            ranks = run(args, layer, Path(tmp) / f"{layer.replace(':', '_')}.json")
            raw[layer] = ranks
            _, d, *k = layer.split(":")
            d = int(d)
            gathered = max(r["gathered"] for r in ranks)
            tile = (d // int(k[0])) ** 2 * 4 if k else d * d * 4
            rows.append((layer, d, k[0] if k else "1", tile, gathered, max(r["rss"] for r in ranks),
                         statistics.median(ranks[0]["times"][1:] or ranks[0]["times"]), ranks[0]["losses"]))  # fmt: skip
            print(f"{layer}: peak gathered {gathered / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": raw}, indent=1) + "\n")
    print(f"\nZeRO-3, offload_param + offload_optimizer cpu, {args.nproc} ranks x {args.threads} thread, fp32, "
          f"{args.tokens} rows/rank, {args.steps} steps; budget {args.budget_mib:g} MiB of gathered parameters\n")
    print("| layer | parameters | tiles | one tile (MiB) | peak gathered (MiB) | peak/tile | within budget "
          "| peak RSS/rank (MiB) | ms/step | loss first → last |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layer, d, k, tile, gathered, rss, ms, losses in rows:
        print(f"| {layer} | {(d * d + d) / 1e6:.1f}M | {k}x{k} | {tile / 2**20:.1f} | {gathered / 2**20:.1f} | "
              f"{gathered / tile:.2f} | {'yes' if gathered <= budget else 'no'} | {rss / 2**20:.0f} | {ms * 1e3:.0f} "
              f"| {losses[0]:.4f} → {losses[-1]:.4f} |")  # fmt: skip
    fit = [(d * d + d, layer) for layer, d, k, tile, gathered, *_ in rows if gathered <= budget]
    untiled = max((n for n, layer in fit if layer.startswith("untiled")), default=0)
    tiled = max((n for n, layer in fit if layer.startswith("tiled")), default=0)
    if untiled and tiled:
        print(f"\nlargest layer within {args.budget_mib:g} MiB: untiled {untiled / 1e6:.1f}M parameters, tiled "
              f"{tiled / 1e6:.1f}M ({tiled / untiled:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
