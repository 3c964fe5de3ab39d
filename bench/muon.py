"""Muon against AdamW on the demo GPT, and how evenly the ranks share its orthogonalization.

    python bench/muon.py convergence --steps 1000 --muon-lrs 0.02,0.05     # loss curves, 2 ranks
    python bench/muon.py balance --nproc 4 --steps 12                       # seconds per rank
    python bench/muon.py nvme --nproc 2 --steps 6                           # NVMe bytes per step

``convergence`` trains ``examples/train_gpt.py`` (the demo's data, config, warm-up and
decay) with AdamW, then with Muon at each of ``--muon-lrs`` (AdamW's lr, betas and decay
for the embeddings, head and vectors; the schedule scales both lrs alike: per-group peaks).
It reports each run's final loss (mean of the last 10 steps) and, for Muon, the first step
at which its 10-step mean reaches AdamW's final loss.

``balance`` runs Muon at ZeRO-3 on ``--nproc`` ranks and reads, each step, the seconds
each rank spent orthogonalizing the matrices it owns ([Note: whole matrices on shards]);
it reports each rank's median and the largest over the mean.

``nvme`` runs Muon at ZeRO-3 with the optimizer on NVMe (``--nvme-path``, default under
``--out``), without and with ``save_muon_momentum_buffer_in_memory``, and reports the
bytes each rank read and wrote per step, its swap files and the optimizer state it holds
in host memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("convergence", "balance", "nvme", "rank"))
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--zero", default='{"stage": 2}')
    p.add_argument("--muon-lrs", default="0.02,0.05")
    p.add_argument("--lr", type=float, default=None, help="AdamW's peak lr (default: the demo config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--flush-denormal", action="store_true")
    p.add_argument("--out", default="runs/bench/muon")
    p.add_argument("--nvme-path", default=None, help="nvme: the swap folder (default: under --out)")
    p.add_argument("--momentum-in-memory", action="store_true", help="rank: save_muon_momentum_buffer_in_memory")
    p.add_argument("--local_rank", type=int, default=-1, help="passed by terascale run")
    return p.parse_args(argv)


def smoothed(curve: list[float], window: int = 10) -> list[float]:
    return [sum(curve[max(0, i - window + 1) : i + 1]) / len(curve[max(0, i - window + 1) : i + 1])
            for i in range(len(curve))]  # fmt: skip


def convergence(args: argparse.Namespace) -> None:
    from compact_states import demo_config, train_gpt

    runs = {}
    adam = demo_config(args)
    adam["optimizer"]["type"] = "AdamW"
    runs["AdamW"] = train_gpt(args, adam, Path(args.out) / "AdamW")
    adam_lr = adam["optimizer"]["params"]["lr"]
    for muon_lr in (float(x) for x in args.muon_lrs.split(",")):
        config = demo_config(args)
        config["optimizer"] = {"type": "Muon", "params": {**adam["optimizer"]["params"], "muon_lr": muon_lr}}
        config["scheduler"]["params"]["warmup_max_lr"] = [muon_lr, adam_lr]  # the groups: Muon's, then AdamW's
        runs[f"Muon {muon_lr:g}"] = train_gpt(args, config, Path(args.out) / f"muon-{muon_lr:g}")
    target = runs["AdamW"]["final_loss"]
    print(f"\nGPT {args.n_layer} x {args.n_embd}, {args.steps} steps, {args.nproc} ranks, zero {args.zero}, "
          f"AdamW lr {adam_lr:g}\n")
    print("| optimizer | final loss (last 10) | held-out end | steps to AdamW's final loss | tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, m in runs.items():
        reach = next((i + 1 for i, v in enumerate(smoothed(m["loss_curve"])) if v <= target), None)
        print(f"| {name} | {m['final_loss']:.4f} | {m['held_out_loss_end']:.4f} | "
              f"{reach if reach is not None else 'not within ' + str(args.steps)} | {m['tokens_per_s']:,.0f} |")
    (Path(args.out) / "convergence.json").write_text(json.dumps(runs, indent=1))


def run_ranks(args: argparse.Namespace, out: Path, *extra: str) -> list[dict]:
    """``rank`` on ``args.nproc`` ranks into ``out``: each rank's record."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(ROOT / ".venv/bin/terascale"), "run", "--nproc", str(args.nproc), __file__, "rank",
           "--steps", str(args.steps), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
           "--n-head", str(args.n_head), "--out", str(out), *extra]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.nproc)]


def balance(args: argparse.Namespace) -> None:
    seconds = [r["seconds"] for r in run_ranks(args, Path(args.out) / "balance")]
    medians = [statistics.median(s[2:]) for s in seconds]  # the first steps warm up
    mean = sum(medians) / len(medians)
    print(f"\nMuon at ZeRO-3, GPT {args.n_layer} x {args.n_embd}, {args.nproc} ranks, {args.steps} steps "
          f"(medians of steps 3-{args.steps})\n")
    print("| rank | orthogonalizing (ms/step) | vs mean |")
    print("| --- | --- | --- |")
    for r, m in enumerate(medians):
        print(f"| {r} | {1e3 * m:.1f} | {m / mean:.3f} |")
    print(f"\nlargest / mean: {max(medians) / mean:.3f}")


def nvme(args: argparse.Namespace) -> None:
    path = args.nvme_path or str(Path(args.out) / "swap")
    Path(path).mkdir(parents=True, exist_ok=True)
    rows = {}
    for in_memory in (False, True):
        extra = ["--nvme-path", path] + (["--momentum-in-memory"] if in_memory else [])
        rows[in_memory] = run_ranks(args, Path(args.out) / f"nvme-{int(in_memory)}", *extra)
    mib = 2**20
    print(f"\nMuon at ZeRO-3, optimizer on NVMe, GPT {args.n_layer} x {args.n_embd}, {args.nproc} ranks, "
          f"steps 2-{args.steps} (rank 0)\n")
    print("| momentum | read MiB/step | written MiB/step | swap files MiB | optimizer state in host memory MiB |")
    print("| --- | --- | --- | --- | --- |")
    for in_memory, (r0, *_) in rows.items():
        steps = args.steps - 1
        print(f"| {'in memory' if in_memory else 'on NVMe'} | {r0['read'] / steps / mib:.1f} | "
              f"{r0['written'] / steps / mib:.1f} | {r0['nvme'] / mib:.1f} | {r0['optimizer_state'] / mib:.1f} |")


def rank(args: argparse.Namespace) -> None:
    """One rank of ``balance`` and ``nvme``: Muon at ZeRO-3 on random tokens; writes its
    seconds orthogonalizing per step, and its NVMe traffic after the first step."""
    import torch

    import terascale
    from gpt import GPT, GPTConfig

    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=args.n_layer, n_head=args.n_head,
                          n_embd=args.n_embd))  # fmt: skip
    world = int(os.environ["WORLD_SIZE"])
    zero: dict = {"stage": 3}
    if args.nvme_path:
        zero |= {"offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path},
                 "save_muon_momentum_buffer_in_memory": args.momentum_in_memory}  # fmt: skip
    config = {"train_batch_size": 2 * world, "optimizer": {"type": "Muon", "params": {"lr": 0.02}},
              "zero_optimization": zero, "steps_per_print": 10**6}  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)
    ids = torch.randint(0, 256, (2, 129), generator=torch.Generator().manual_seed(engine.dist.rank))
    seconds, first = [], {}
    for step in range(args.steps):
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))  # the demo GPT's forward(input_ids, labels): the loss
        engine.step()
        seconds.append(engine.model_state.orthogonalize_seconds)
        if step == 0:  # the first step lays the swap files out with the new state
            first = engine.model_state.offload_io()
    io, memory = engine.model_state.offload_io(), engine.memory_breakdown()
    record = {"seconds": seconds, "read": io["read"] - first["read"], "written": io["written"] - first["written"],
              "nvme": memory["nvme"], "optimizer_state": memory["optimizer_state"]}  # fmt: skip
    (Path(args.out) / f"rank{engine.dist.rank}.json").write_text(json.dumps(record))
    engine.destroy()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    {"convergence": convergence, "balance": balance, "nvme": nvme, "rank": rank}[args.what](args)


if __name__ == "__main__":
    main()
