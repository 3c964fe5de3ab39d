"""ZeRO-Offload's delayed parameter update in plain PyTorch: how much one step of staleness
costs the demo GPT's loss, with no terascale in the loop (the reference for the
overlapped host step, [Note: the overlapped host step]).

    python bench/delayed_update.py --micro-batch 32 --steps 300      # the demo at 64 sequences a step

The demo GPT (``examples/gpt``) on the demo's stdlib corpus, one process per variant (both
run at once, one thread each): ``torch.optim.AdamW`` with the demo config's betas, eps,
weight decay, clipping at 1.0 and WarmupDecayLR (warm-up ``max(15, steps/20)`` steps, as
``bench/compact_states.py`` sets it), bf16 autocast; the same seeded sample order in both.
``sync``: the usual step. ``delayed``: after ``--warmup`` synchronous steps, the forward and
backward of each step run on the parameters from before the previous update (the update
computed from this step's gradients is applied one step later) — what ``overlap_step``
does on the host. Prints the final loss (mean of the last 10 steps) and the held-out loss
of each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(variant: str, steps: int, micro_batch: int, warmup: int, seed: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import DEMO_CONFIG, GPT, ByteBlocks, load_stdlib_corpus

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    torch.manual_seed(seed)
    model = GPT(DEMO_CONFIG)
    corpus = load_stdlib_corpus(max_bytes=4_000_000, seed=seed)
    data, held = ByteBlocks(corpus.train, DEMO_CONFIG.block_size), ByteBlocks(corpus.held_out, DEMO_CONFIG.block_size)
    batch = 2 * micro_batch  # the 2-rank run's global batch
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ramp = max(15, steps // 20)

    def lr_at(s: int) -> float:
        return 2e-3 * (s / ramp if s < ramp else max(0.0, (steps - s) / (steps - ramp)))

    params = list(model.parameters())  # the optimizer's values (ZeRO-Offload's masters)
    prev = None  # delayed: the values the step computes on, one update behind
    losses = []
    for s in range(steps):
        idx = order[(torch.arange(batch) + s * batch) % len(order)]
        x, y = zip(*(data[int(i)] for i in idx))
        stale = variant == "delayed" and s >= warmup
        with torch.no_grad():
            if stale and prev is None:
                prev = [p.detach().clone() for p in params]  # the first delayed step computes on M_s itself
            current = [p.detach().clone() for p in params] if stale else None
            if stale:
                for p, v in zip(params, prev):
                    p.copy_(v)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.stack(x), torch.stack(y))
        loss.backward()
        losses.append(loss.item())
        if stale:
            with torch.no_grad():
                for p, v in zip(params, current):
                    p.copy_(v)  # back to the optimizer's values for the update
            prev = current  # the next step computes on the values before this update
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(s)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        ids = torch.arange(0, min(len(held), 64))
        x, y = zip(*(held[int(i)] for i in ids))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            held_loss = model(torch.stack(x), torch.stack(y)).item()
    return {"final": sum(losses[-10:]) / len(losses[-10:]), "held_out": held_loss, "curve": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro-batch", type=int, default=8, help="per rank of the 2-rank run it stands for")
    p.add_argument("--warmup", type=int, default=40, help="synchronous steps first (overlap_step_warmup)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="runs/bench/delayed_update.json")
    args = p.parse_args()
    if args.variant:
        print(json.dumps(train(args.variant, args.steps, args.micro_batch, args.warmup, args.seed)))
        return
    base = [sys.executable, __file__, "--steps", str(args.steps), "--micro-batch", str(args.micro_batch),
            "--warmup", str(args.warmup), "--seed", str(args.seed)]  # fmt: skip
    procs = {v: subprocess.Popen(base + ["--variant", v], stdout=subprocess.PIPE, text=True) for v in ("sync", "delayed")}
    results = {v: json.loads(proc.communicate()[0].strip().splitlines()[-1]) for v, proc in procs.items()}
    s, d = results["sync"], results["delayed"]
    print(f"demo GPT, {args.steps} steps of {2 * args.micro_batch} sequences, delayed after {args.warmup}:")
    print(f"sync final {s['final']:.4f}, delayed {d['final']:.4f} = {d['final'] / s['final']:.3f}x; "
          f"held-out {s['held_out']:.4f} vs {d['held_out']:.4f} = {d['held_out'] / s['held_out']:.3f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
