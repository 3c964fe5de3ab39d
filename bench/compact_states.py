"""Compact optimizer states against fp32 Adam: the same training run of the demo GPT, once a variant.

    python bench/compact_states.py --n-layer 4 --n-embd 512 --steps 300
    python bench/compact_states.py --n-layer 12 --n-embd 768 --n-head 12 --steps 500   # 85M, long
    python bench/compact_states.py --n-layer 12 --n-embd 768 --n-head 12 --steps 500 --micro-batch 2 --block-size 64

    python bench/compact_states.py --bf16 --optimizers AdamW,AdamW+bf16,AdamW+bf16-nearest   # bf16 states
    python bench/compact_states.py --bf16 --zero '{"stage": 2, "offload_optimizer": {"device": "cpu"}}' \
        --optimizers AdamW,AdamW+overlap                                                     # the overlapped step

Runs ``examples/train_gpt.py`` (2 ranks, the demo's data, its config with warm-up and
decay) once for each of ``--optimizers``: an optimizer type (``AdamW``, ``AdamW8bit``:
[Note: compact optimizer states]), optionally with a suffix for bf16 masters and states
([Note: bf16 masters and optimizer states]; with ``--bf16``): ``+bf16`` (both, rounded
stochastically), ``+bf16-nearest`` (both, rounded to nearest), ``+bf16masters`` (bf16
masters, fp32 moments); ``+overlap`` runs the host step behind the next window ([Note: the
overlapped host step]; the optimizer on the host, with or without the others). The stage and
offload tier are ``--zero``'s. Compares the loss
curves: the final loss (mean of the last 10 steps) and the held-out loss. Prints a table,
writes JSON and a PNG of the curves to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bf16 section keys of each variant suffix ([Note: bf16 masters and optimizer states]).
VARIANTS = {
    "": {},
    "bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "bf16-nearest": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True, "stochastic_rounding": False},
    "bf16masters": {"bf16_master_weights_and_grads": True},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro-batch", type=int, default=None, help="micro-batch per rank (default: the demo config's 8)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per sequence (default: the demo's)")
    p.add_argument("--zero", default='{"stage": 2}', help="zero_optimization section (JSON)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default="runs/bench/compact_states")
    p.add_argument("--optimizers", default="AdamW,AdamW8bit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the demo config's)")
    p.add_argument("--flush-denormal", action="store_true",
                   help="both runs compute subnormal floats as zero (the forward and backward of a trained "
                        "model slow down 1.7x without it on x86)")
    p.add_argument("--bf16", action="store_true", help="the demo's bf16 (slow on CPUs without bf16 kernels); default fp32")
    return p.parse_args(argv)


def demo_config(args: argparse.Namespace) -> dict:
    """The demo's config for ``args``: its stage and offload, its steps (warm-up and decay
    over them), peak lr, micro-batch and precision; no profilers."""
    config = json.loads((ROOT / "examples/configs/gpt_demo.json").read_text())
    config["zero_optimization"] = json.loads(args.zero)
    config["scheduler"]["params"]["total_num_steps"] = args.steps
    if args.lr is not None:
        config["optimizer"]["params"]["lr"] = config["scheduler"]["params"]["warmup_max_lr"] = args.lr
    config["scheduler"]["params"]["warmup_num_steps"] = max(15, args.steps // 20)
    if args.micro_batch is not None:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
    if not args.bf16:
        config.pop("bf16", None)
    for key in ("flops_profiler", "comms_logger", "wall_clock_breakdown"):
        config.pop(key, None)
    return config


def run(args: argparse.Namespace, optimizer: str) -> dict:
    config = demo_config(args)
    kind, _, variant = optimizer.partition("+")
    overlap = variant == "overlap" or variant.endswith("+overlap")
    variant = variant.removesuffix("overlap").rstrip("+")
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r} of {optimizer!r}: one of {sorted(VARIANTS)[1:]}")
    if variant and not args.bf16:
        raise SystemExit(f"{optimizer}: bf16 masters and states need --bf16")
    config["optimizer"]["type"] = kind
    if args.bf16:
        config["bf16"] = {**config.get("bf16", {}), **VARIANTS[variant]}
    if overlap:
        offload = config["zero_optimization"].setdefault("offload_optimizer", {"device": "cpu"})
        offload["overlap_step"] = True
    return train_gpt(args, config, Path(args.out) / optimizer)


def train_gpt(args: argparse.Namespace, config: dict, out: Path) -> dict:
    """``examples/train_gpt.py`` on ``args.nproc`` ranks with ``config`` and ``args``' model
    shape, steps and seed, into ``out``; its metrics.json."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    cmd = [str(ROOT / ".venv/bin/terascale"), "run", "--nproc", str(args.nproc), str(ROOT / "examples/train_gpt.py"),
           "--config", str(out / "config.json"), "--out", str(out), "--steps", str(args.steps),
           "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
           "--sample-tokens", "0", "--seed", str(args.seed)]  # fmt: skip
    if args.flush_denormal:
        cmd.append("--flush-denormal")
    if args.block_size is not None:
        cmd += ["--block-size", str(args.block_size)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads((out / "metrics.json").read_text())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    names = [n.strip() for n in args.optimizers.split(",")]
    results = {name: run(args, name) for name in names}
    base = results[names[0]]
    micro = args.micro_batch or "8 (the demo's)"
    ftz = ", subnormals flushed" if args.flush_denormal else ""
    block = args.block_size or "the demo's"
    print(f"\nGPT {args.n_layer} x {args.n_embd}, {args.steps} steps, {args.nproc} ranks, micro-batch {micro} x "
          f"{block} tokens, zero {args.zero}, seed {args.seed}{ftz}\n")
    print("| optimizer | loss step 1 | final loss (last 10) | vs " + names[0] + " | held-out end | vs " + names[0]
          + " | tokens/s | memory/rank MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, m in results.items():
        print(f"| {name} | {m['first_loss']:.4f} | {m['final_loss']:.4f} | {m['final_loss'] / base['final_loss']:.4f} | "
              f"{m['held_out_loss_end']:.4f} | {m['held_out_loss_end'] / base['held_out_loss_end']:.4f} | "
              f"{m['tokens_per_s']:,.0f} | {'/'.join(f'{x:.0f}' for x in m.get('memory_mib_per_rank', []))} |")
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, m in results.items():
            ax.plot(range(1, len(m["loss_curve"]) + 1), m["loss_curve"], lw=1, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_title(f"GPT {args.n_layer} x {args.n_embd}: optimizer state variants")
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(args.out) / "loss.png", dpi=120)
        print(f"wrote {Path(args.out) / 'loss.png'}")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
