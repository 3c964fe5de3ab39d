"""The Hugging Face Trainer on terascale against the same Trainer on DDP and on DeepSpeed.

    python bench/hf_trainer.py                          # 2 ranks x 1 thread, 3 interleaved repeats
    python bench/hf_trainer.py --systems ddp,terascale-3 --repeats 5
    python bench/hf_trainer.py --systems ddp,terascale-2,native-2,terascale-3,native-3   # the two terascale paths

Every system is ``transformers.Trainer`` fine-tuning the same Llama (random init, fp32,
the Trainer's own AdamW and linear schedule, clipping at 1.0) on the same tokens:

- ``ddp``: the plain Trainer (accelerate wraps the model in DDP);
- ``terascale-N``: ``terascale.integrations.transformers.Trainer`` with a ZeRO-N config
  whose every batch, clipping and bucket value is ``"auto"``;
- ``native-N``: the plain Trainer with ``TrainingArguments(deepspeed=...)`` and the same
  config, with terascale standing in for DeepSpeed (``TERASCALE_AS_DEEPSPEED=1``): the
  Trainer's own DeepSpeed integration driving terascale through accelerate;
- ``deepspeed-N``: the plain Trainer with ``TrainingArguments(deepspeed=...)`` and the same
  config, run from the peers' environment (``--peers-python``, set up as
  ../shared/BENCHMARKING.md says, with ``transformers`` and ``accelerate`` added); left out
  with a note when that environment lacks them.

Each job runs under ``torchrun``; a callback times every optimizer step (from one step's
end to the next) and the Trainer's logged losses are kept. The driver interleaves the
systems, rotating their order each repeat, and prints median ms/step, the ratio to DDP
(overall and the median of per-repeat ratios) and the largest difference of the loss
curves from DDP's, which must stay within fp32 rounding for terascale (the run fails
otherwise). Where both terascale paths ran at a stage, a second table compares them: the
native path's step time over the terascale Trainer's (overall and per repeat). Raw numbers
go to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step_time import chosen_systems, run_interleaved  # the same torchrun jobs, interleaved and rotated

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("ddp", "terascale-0", "terascale-2", "terascale-3", "native-0", "native-2", "native-3", "deepspeed-2",
           "deepspeed-3")
AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    p.add_argument("--peers-python", default="/tmp/peers/bin/python",
                   help="python of the environment with DeepSpeed, transformers and accelerate")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--json", default="runs/bench/hf_trainer.json", help="where to write every run's raw numbers")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: system to run
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # internal: JSON path
    return p.parse_args(argv)


def zero_config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    return {**AUTO, "zero_optimization": zero}


# -- one training job (runs under torchrun) ------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    system, stage = args.worker.rsplit("-", 1) if "-" in args.worker else (args.worker, "0")
    if system == "native":
        # What TERASCALE_AS_DEEPSPEED=1 does at start-up, done before transformers and
        # accelerate are imported (they look for DeepSpeed then); set for any child too.
        os.environ["TERASCALE_AS_DEEPSPEED"] = "1"
        from terascale.integrations.deepspeed import standin

        standin.install()
    import torch
    import transformers as hf

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = hf.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(2.6875 * args.hidden),
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq,
    )  # fmt: skip
    model = hf.LlamaForCausalLM(config)
    world = int(os.environ["WORLD_SIZE"])
    rows = args.steps * args.micro_batch * args.accumulation * world
    ids = torch.randint(0, args.vocab, (rows, args.seq), generator=torch.Generator().manual_seed(1))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return rows

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": ids[i], "labels": ids[i]}

    ends: list[float] = []

    class Clock(hf.TrainerCallback):
        def on_train_begin(self, *a, **k):
            ends.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    common = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=1e-3, warmup_steps=2,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True, dataloader_drop_last=True,
        use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    if system == "terascale":
        from terascale.integrations.transformers import Trainer

        trainer = Trainer(model=model, args=hf.TrainingArguments(**common), train_dataset=Tokens(),
                          config=zero_config(int(stage)), callbacks=[Clock()])  # fmt: skip
    elif system in ("deepspeed", "native"):
        trainer = hf.Trainer(model=model, args=hf.TrainingArguments(deepspeed=zero_config(int(stage)), **common),
                             train_dataset=Tokens(), callbacks=[Clock()])  # fmt: skip
    else:
        trainer = hf.Trainer(model=model, args=hf.TrainingArguments(**common), train_dataset=Tokens(), callbacks=[Clock()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    times = [b - a for a, b in zip(ends, ends[1:])]
    if int(os.environ["RANK"]) == 0:
        Path(args.result).write_text(json.dumps({"times": times, "losses": losses}))


# -- the driver -----------------------------------------------------------------------------


def _peers_have_the_trainer(python: str) -> bool:
    if not Path(python).exists():
        return False
    probe = subprocess.run([python, "-c", "import deepspeed, transformers, accelerate"], capture_output=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})  # fmt: skip
    return probe.returncode == 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    systems = chosen_systems(args, SYSTEMS)
    if any(s.startswith("deepspeed") for s in systems) and not _peers_have_the_trainer(args.peers_python):
        print(f"DeepSpeed left out: {args.peers_python} lacks deepspeed/transformers/accelerate", file=sys.stderr)
        systems = [s for s in systems if not s.startswith("deepspeed")]
    runs = run_interleaved(args, systems, __file__)

    base = "ddp" if "ddp" in runs else systems[0]
    base_ms = statistics.median(t for res in runs[base] for t in res["times"][args.warmup:]) * 1e3
    base_rep = [statistics.median(res["times"][args.warmup:]) * 1e3 for res in runs[base]]
    base_losses = runs[base][0]["losses"]
    print(f"\nLlama {args.layers} layers x {args.hidden}, vocab {args.vocab}, micro-batch {args.micro_batch} x {args.seq} "
          f"tokens, accumulation {args.accumulation}, {args.nproc} ranks x {args.threads} thread(s), fp32, "
          f"{args.repeats} interleaved repeats x {args.steps - args.warmup} timed steps\n")
    print(f"| system | ms/step (median) | per-repeat medians | ratio to {base} | per-repeat ratios (median) | "
          f"loss step 1 → last | max Δloss vs {base} |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for system in systems:
        ms = statistics.median(t for res in runs[system] for t in res["times"][args.warmup:]) * 1e3
        per_rep = [statistics.median(res["times"][args.warmup:]) * 1e3 for res in runs[system]]
        ratios = [a / b for a, b in zip(per_rep, base_rep)]
        losses = runs[system][0]["losses"]
        diff = max(abs(a - b) for res in runs[system] for a, b in zip(res["losses"], base_losses))
        if system.startswith(("terascale", "native")):
            worst = max(worst, diff)
        print(f"| {system} | {ms:.1f} | {min(per_rep):.1f}–{max(per_rep):.1f} | {ms / base_ms:.3f} | "
              f"{statistics.median(ratios):.3f} | {losses[0]:.5f} → {losses[-1]:.5f} | {diff:.1e} |")
    _compare_paths(args, runs, systems)
    if worst > 1e-4:
        raise SystemExit(f"terascale's loss curve differs from {base}'s by {worst:.2e} (> 1e-4)")


def _compare_paths(args: argparse.Namespace, runs: dict[str, list[dict]], systems: list[str]) -> None:
    """The native path (``native-N``) against the terascale Trainer (``terascale-N``) at each
    stage both ran: the ratio of their median step times, overall and per repeat (the runs
    of one repeat ran next to each other, so a repeat's ratio is the least noisy)."""
    stages = [s.split("-")[1] for s in systems if s.startswith("native-") and f"terascale-{s.split('-')[1]}" in runs]
    if not stages:
        return
    print("\n| stage | terascale Trainer ms/step | native Trainer ms/step | native / terascale | per-repeat ratios | "
          "median of per-repeat |")
    print("| --- | --- | --- | --- | --- | --- |")
    for stage in stages:
        ours, native = runs[f"terascale-{stage}"], runs[f"native-{stage}"]
        ms = [statistics.median(t for res in rs for t in res["times"][args.warmup:]) * 1e3 for rs in (ours, native)]
        per = [statistics.median(b["times"][args.warmup:]) / statistics.median(a["times"][args.warmup:])
               for a, b in zip(ours, native)]
        print(f"| {stage} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[1] / ms[0]:.3f} | {', '.join(f'{x:.3f}' for x in per)} | "
              f"{statistics.median(per):.3f} |")


if __name__ == "__main__":
    main()
