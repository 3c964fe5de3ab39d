"""Activation memory and step time: no checkpointing, torch.utils.checkpoint, terascale's
policies and CPU/NVMe checkpointing, and DeepSpeed's activation checkpointing, side by side.

    python bench/activations.py                          # GPT seq 1024, 2 ranks, 3 interleaved repeats
    python bench/activations.py --seq 2048 --systems none,blocks,cpu,deepspeed-cpu

Every system trains the same GPT (``examples/gpt``, fp32, ZeRO stage 0 on 2 ranks) on the
same tokens; only how activations are kept differs:

- ``none``: terascale, nothing checkpointed;
- ``torch-checkpoint``: every block wrapped in ``torch.utils.checkpoint`` (non-reentrant)
  inside the model, terascale around it;
- ``blocks`` / ``selective`` / ``every-2``: terascale's ``activation_checkpointing.policy``;
- ``cpu``: ``blocks`` with ``cpu_checkpointing``; on a CPU-only machine the device *is*
  host memory, so the inputs spill to ``--nvme`` (``nvme_path``) instead;
- ``deepspeed`` / ``deepspeed-cpu``: DeepSpeed 0.19's ``deepspeed.checkpointing.checkpoint``
  around every block (its engine at stage 0), ``checkpoint_in_cpu`` on for the second.

Each job times its steps, then measures one more step: the bytes autograd keeps from
forward to backward (saved-tensor hooks around the forward, once per storage, parameters
left out) plus, for terascale, the checkpoint inputs its store holds in memory, and the
largest single block's working set (what one recompute needs). The driver prints the
median ms/step, the ratio to ``none`` and to plain checkpointing, the activation bytes
kept, and - from the measured bytes per token - the longest sequence whose activations
fit in ``--budget-gib`` per rank (a projection, not a run). Losses must agree with
``none`` (checkpointing does not change the arithmetic).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import _engine_step, _has_cuda, _model, run_interleaved, timed_step  # noqa: E402

SYSTEMS = ("none", "torch-checkpoint", "blocks", "selective", "every-2", "cpu", "deepspeed", "deepspeed-cpu")
LR = 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    p.add_argument("--peers-python", default="/tmp/peers/bin/python")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--budget-gib", type=float, default=8.0, help="activation memory per rank for the projection")
    p.add_argument("--nvme", default="runs/bench/act_swap", help="nvme_path of the 'cpu' system off-GPU")
    p.add_argument("--json", default="runs/bench/activations.json")
    p.add_argument("--report", default=None, help="print the tables of an earlier run's JSON and exit")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- one job (under torchrun) -----------------------------------------------------------------


class _Wrapped:
    """A block called through a checkpoint function (torch's or DeepSpeed's)."""

    def __init__(self, block, checkpoint):
        self.block, self.checkpoint = block, checkpoint

    def __call__(self, x):
        return self.checkpoint(self.block, x)


def _wrap_blocks(model, checkpoint) -> None:
    for block in model.blocks:
        block.forward = _Wrapped(type(block).forward.__get__(block), checkpoint)


def _terascale(args, model, device, activation: dict):
    import terascale

    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 0},
        "activation_checkpointing": activation,
    }
    engine, *_ = terascale.initialize(model=model, config=config)
    return engine, engine


def _deepspeed(args, model, device, in_cpu: bool):
    import deepspeed
    import torch

    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=in_cpu, partition_activations=False)
    _wrap_blocks(model, deepspeed.checkpointing.checkpoint)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "zero_optimization": {"stage": 0}}  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine, None


def _build(system: str, args, model, device):
    import torch

    if system == "torch-checkpoint":
        _wrap_blocks(model, lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False))
        return _terascale(args, model, device, {})
    if system.startswith("deepspeed"):
        return _deepspeed(args, model, device, in_cpu=system == "deepspeed-cpu")
    activation = {
        "none": {},
        "blocks": {"policy": "blocks"},
        "selective": {"policy": "selective"},
        "every-2": {"policy": "every_n", "every_n": 2},
        "cpu": {"policy": "blocks", "cpu_checkpointing": True},
    }[system]
    if system == "cpu" and device.type == "cpu":
        Path(args.nvme).mkdir(parents=True, exist_ok=True)
        activation["nvme_path"] = args.nvme
    return _terascale(args, model, device, activation)


def _kept_bytes(model, engine, x, y) -> int:
    """Bytes autograd keeps from forward to backward in one step (hooks around the forward
    only: a reentrant recompute saves again inside backward), once per storage."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    kept = [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            kept[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return kept[0]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    if args.worker.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    else:
        from terascale.comm import init_distributed

        device = init_distributed().device
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(args)
    engine, ours = _build(args.worker, args, model, device)
    step = _engine_step(engine)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.steps + 1, world * args.micro_batch, args.seq + 1), generator=g)
    times, losses = [], []
    for s in range(args.steps + 1):
        rows = tokens[s, rank * args.micro_batch : (rank + 1) * args.micro_batch].to(device)
        if s == args.steps:  # the measured step, left out of the timing
            if ours is not None:
                ours.activations.checkpointing.reset_stats()
            kept = _kept_bytes(model, engine, rows[:, :-1], rows[:, 1:])
            resident = None
            if ours is not None:  # inputs in terascale's store (not autograd's tensors)
                resident = ours.activations.memory()["checkpoint_inputs"]
                kept += resident
            elif args.worker == "deepspeed":
                # DeepSpeed keeps its checkpoint inputs on ctx attributes, where saved-tensor
                # hooks do not see them: one block input per block, on the device.
                kept += args.layers * rows[:, :-1].numel() * args.width * 4
            break
        seconds, loss = timed_step(step, rows, device)
        times.append(seconds)
        losses.append(loss)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip
    if rank == 0:
        Path(args.result).write_text(json.dumps({"times": times, "losses": losses, "kept": kept, "peak": peak,
                                                 "checkpoint_inputs": resident, "device": device.type}))  # fmt: skip
    if ours is not None:
        ours.destroy()  # removes the 'cpu' system's swap files
    dist.barrier()
    dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------


def _peers_ok(python: str) -> bool:
    import subprocess

    return Path(python).exists() and subprocess.run([python, "-c", "import deepspeed"], capture_output=True,
                                                    env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode == 0  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report(argparse.Namespace(**saved["args"]), saved["runs"])
        return
    systems = [s for s in args.systems.split(",") if s]
    if any(s.startswith("deepspeed") for s in systems) and not _peers_ok(args.peers_python):
        print(f"DeepSpeed not importable from {args.peers_python}: left out", file=sys.stderr)
        systems = [s for s in systems if not s.startswith("deepspeed")]
    if "deepspeed-cpu" in systems and not _has_cuda():
        # DeepSpeed 0.19.8 'copies' each input to the CPU (a no-op there), then empties the
        # input's .data to free the device copy - which empties its only copy: the recompute
        # fails with "got input of size []". Its CPU checkpointing needs a GPU.
        print("deepspeed-cpu left out: DeepSpeed's checkpoint_in_cpu destroys its inputs when the device is the "
              "CPU (see the comment above)", file=sys.stderr)  # fmt: skip
        systems.remove("deepspeed-cpu")
    runs = run_interleaved(args, systems, script=__file__)
    report(args, runs)


def report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    med = {s: statistics.median(statistics.median(r["times"][args.warmup:]) for r in rs) for s, rs in runs.items()}
    kept = {s: rs[0]["kept"] for s, rs in runs.items()}
    peak = {s: max(r["peak"] for r in rs) for s, rs in runs.items()}
    base = runs.get("none")
    tokens = args.seq * args.micro_batch
    block_set = kept["none"] / args.layers if "none" in kept else 0  # one block's working set (upper bound)
    plain = med.get("torch-checkpoint") or med.get("blocks")
    print(f"\nGPT {args.layers}x{args.width}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
          f"micro-batch {args.micro_batch}, {args.nproc} ranks x {args.threads} thread, fp32, "
          f"{args.repeats} interleaved repeats x {args.steps - args.warmup} timed steps\n")  # fmt: skip
    print("| system | ms/step | vs none | vs plain checkpointing | activations kept (MiB) | kept vs none "
          f"| longest seq in {args.budget_gib:g} GiB | peak RSS/alloc (MiB) | max loss diff vs none |")
    print("|---|---|---|---|---|---|---|---|---|")
    budget = args.budget_gib * 2**30
    for s, rs in runs.items():
        per_token = (kept[s] + (block_set if s != "none" else 0)) / tokens
        longest = int(budget / per_token) if per_token else 0
        diff = max(abs(a - b) for r in rs for a, b in zip(r["losses"], base[0]["losses"])) if base else float("nan")
        def ratio(a: float, b: float | None) -> str:
            return f"{a / b:.3f}" if b else "n/a"

        print(f"| {s} | {med[s] * 1e3:.0f} | {ratio(med[s], med.get('none'))} | {ratio(med[s], plain)} | "
              f"{kept[s] / 2**20:.1f} | {ratio(kept[s], kept.get('none'))} | {longest} | "
              f"{peak[s] / 2**20:.0f} | {diff:.2e} |")  # fmt: skip
    if "none" in kept and "blocks" in kept:
        # [Note: activation formulas]'s target for blocks: 1/L of the baseline plus one block's
        # working set, which the two runs measure: none - blocks = L x (block - its input).
        block_input = tokens * args.width * 4
        block_ws = (kept["none"] - kept["blocks"]) / args.layers + block_input
        bound = kept["none"] / args.layers + block_ws
        print(f"\nblocks keeps {kept['blocks'] / 2**20:.1f} MiB; target <= none/L + one block's working set = "
              f"{kept['none'] / args.layers / 2**20:.1f} + {block_ws / 2**20:.1f} = {bound / 2**20:.1f} MiB: "
              f"{'met' if kept['blocks'] <= bound else 'NOT met'}")  # fmt: skip
        resident = runs.get("cpu", [{}])[0].get("checkpoint_inputs")
        if resident is not None:
            print(f"cpu: checkpoint inputs held in device memory at most {resident / 2**20:.1f} MiB at once "
                  f"(one block's working set: {block_ws / 2**20:.1f} MiB); all {args.layers} inputs: "
                  f"{args.layers * block_input / 2**20:.1f} MiB")  # fmt: skip
    if base:
        spread = {s: [statistics.median(r["times"][args.warmup:]) * 1e3 for r in rs] for s, rs in runs.items()}
        print("\nper-repeat medians (ms): " + "; ".join(f"{s}: {', '.join(f'{v:.0f}' for v in vs)}"
                                                       for s, vs in spread.items()))  # fmt: skip


if __name__ == "__main__":
    main()
