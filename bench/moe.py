"""Mixture-of-experts step time: expert parallelism against dense ZeRO-3, and against DeepSpeed-MoE.

    python bench/moe.py                       # 4 ranks x 1 thread, 3 interleaved repeats
    python bench/moe.py --nproc 2 --systems terascale-dense-3,terascale-ep-2,deepspeed-ep-2

A Mixtral-shaped causal LM (attention, then a top-2 mixture of SwiGLU experts in every
block) is written once against DeepSpeed's API (``deepspeed.moe.layer.MoE``, the optimizer
groups of ``split_params_into_different_moe_groups_for_optimizer``) and run by terascale
(``import terascale as deepspeed``) and by DeepSpeed (its own environment, ``--peers-python``,
as ../shared/BENCHMARKING.md sets it up), one ``torchrun`` job per (system, repeat),
interleaved and rotated (``bench/step_time.py``'s driver). Systems:

- ``*-dense-N``: every rank holds every expert (``ep_size=1``), ZeRO stage N shards them
  (DeepSpeed refuses its MoE layer at stage 3, so its dense run is stage 2);
- ``*-ep-N``: the experts split over all ranks (``ep_size = world``), ZeRO stage N for the rest;
- ``-capacity``: DeepSpeed's default token dropping (capacity factor 1.0 of the top-2 routes,
  ``min_capacity`` 4) instead of dropless routing; the table gives the share of routes dropped.

Every system starts from the same weights (experts made distinct by a seed per global
expert) and sees the same tokens; dropless systems must agree on the losses within fp32
rounding.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from step_time import chosen_systems, run_interleaved, timed_step  # noqa: E402  (torchrun jobs, interleaved)

SYSTEMS = (
    "terascale-dense-3",
    "terascale-dense-2",
    "terascale-ep-2",
    "terascale-ep-3",
    "terascale-ep-2-capacity",
    "deepspeed-dense-2",
    "deepspeed-ep-2",
    "deepspeed-ep-2-capacity",
)
LR = 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    p.add_argument("--peers-python", default="/tmp/peers/bin/python", help="python of the environment with DeepSpeed")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--expert-hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--json", default="runs/bench/moe.json", help="every run's per-step times, losses and drops")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the model, written against DeepSpeed's API -----------------------------------------------


def build_model(args: argparse.Namespace, ds, ep_size: int, drop_tokens: bool):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class SwiGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(args.width, args.expert_hidden, bias=False)
            self.w3 = nn.Linear(args.width, args.expert_hidden, bias=False)
            self.w2 = nn.Linear(args.expert_hidden, args.width, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(args.width), nn.RMSNorm(args.width)
            self.qkv = nn.Linear(args.width, 3 * args.width, bias=False)
            self.proj = nn.Linear(args.width, args.width, bias=False)
            self.moe = ds.moe.layer.MoE(
                hidden_size=args.width, expert=SwiGLU(), num_experts=args.experts, ep_size=ep_size, k=2,
                capacity_factor=1.0, min_capacity=4, drop_tokens=drop_tokens, top2_2nd_expert_sampling=False,
            )  # fmt: skip

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, args.heads, c // args.heads).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(att)
            out, l_aux, counts = self.moe(self.norm2(x))
            return x + out, l_aux, counts

    class MoELM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.width)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.norm = nn.RMSNorm(args.width)
            self.head = nn.Linear(args.width, args.vocab, bias=False)
            self.counts: list = []

        def forward(self, ids, targets):
            x, aux, self.counts = self.embed(ids), 0.0, []
            for block in self.blocks:
                x, l_aux, counts = block(x)
                aux = aux + l_aux
                self.counts.append(counts)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1)) + 0.01 * aux

    torch.manual_seed(0)
    model = MoELM()
    # Make the experts distinct (DeepSpeed's layer starts them as copies of one), by a seed
    # per global expert: rank r of an expert-parallel group holds experts r*n .. r*n+n-1.
    ep_rank, local = int(os.environ.get("RANK", "0")) % ep_size, args.experts // ep_size
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            for i, expert in enumerate(block.moe.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(1000 * layer + ep_rank * local + i)
                for p in expert.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


# -- one training job (runs under torchrun) ---------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    system = args.worker
    if system.startswith("deepspeed"):
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
    else:
        import terascale as ds

        ds.init_distributed()
    from importlib import import_module

    split = import_module(f"{ds.__name__}.moe.utils").split_params_into_different_moe_groups_for_optimizer
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = system.split("-")
    ep_size = world if parts[1] == "ep" else 1
    stage, capacity = int(parts[2]), system.endswith("-capacity")
    model = build_model(args, ds, ep_size, drop_tokens=capacity)
    groups = split({"params": list(model.parameters()), "name": "parameters"})
    optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=0.0, fused=True)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9, "zero_optimization": {"stage": stage}, "zero_force_ds_cpu_optimizer": False,
    }  # fmt: skip
    engine, *_ = ds.initialize(model=model, optimizer=optimizer, config=config)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.steps, world * args.micro_batch, args.seq + 1), generator=g)
    cap = max(math.ceil(args.micro_batch * args.seq / args.experts * 2 * 1.0), 4) if capacity else None
    times, losses, dropped = [], [], []
    for s in range(args.steps):
        rows = tokens[s, rank * args.micro_batch : (rank + 1) * args.micro_batch]
        seconds, loss = timed_step(step, rows, torch.device("cpu"))
        times.append(seconds)
        losses.append(loss)
        routes = sum(int(c.sum()) for c in model.counts)
        over = 0 if cap is None else sum(int((c - cap).clamp_min(0).sum()) for c in model.counts)
        dropped.append(over / routes)
    all_dropped: list = [None] * world
    dist.all_gather_object(all_dropped, statistics.mean(dropped))
    if rank == 0:
        params = sum(p.numel() for p in build_model(args, ds, 1, False).parameters())
        Path(args.result).write_text(json.dumps({"times": times, "losses": losses, "dropped": statistics.mean(all_dropped),
                                                 "params": params, "device": "cpu"}))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    systems = chosen_systems(args, SYSTEMS)
    if any(s.startswith("deepspeed") for s in systems) and not Path(args.peers_python).exists():
        print(f"DeepSpeed left out: {args.peers_python} not found (see ../shared/BENCHMARKING.md)", file=sys.stderr)
        systems = [s for s in systems if not s.startswith("deepspeed")]
    runs = run_interleaved(args, systems, script=__file__)
    base = "terascale-dense-3" if "terascale-dense-3" in runs else systems[0]
    reps = {s: [statistics.median(r["times"][args.warmup :]) * 1e3 for r in runs[s]] for s in systems}
    base_losses = runs[base][0]["losses"]
    first = runs[systems[0]][0]
    print(f"\nMoE LM: {args.layers} blocks x width {args.width}, {args.experts} SwiGLU experts x {args.expert_hidden} "
          f"(top-2), vocab {args.vocab}, {first['params'] / 1e6:.1f}M params; micro-batch {args.micro_batch} x "
          f"{args.seq} tokens, {args.nproc} ranks x {args.threads} thread(s), fp32, {first['device']}, "
          f"{args.repeats} interleaved repeats x {args.steps - args.warmup} timed steps\n")  # fmt: skip
    print(f"| system | ms/step (median) | per-repeat medians | ratio to {base} (median of per-repeat) | "
          f"routes dropped | loss step 1 → last | max Δloss vs {base} |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in systems:
        ms = statistics.median(t for r in runs[s] for t in r["times"][args.warmup :]) * 1e3
        ratio = statistics.median(a / b for a, b in zip(reps[s], reps[base]))
        losses = runs[s][0]["losses"]
        diff = max(abs(a - b) for r in runs[s] for a, b in zip(r["losses"], base_losses))
        print(f"| {s} | {ms:.1f} | {min(reps[s]):.1f}–{max(reps[s]):.1f} | {ratio:.3f} | "
              f"{100 * runs[s][0]['dropped']:.1f}% | {losses[0]:.5f} → {losses[-1]:.5f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
