"""The pipeline bubble measured against the theory, for 1F1B and interleaved 1F1B.

    python bench/pipeline_bubble.py                     # p=2; m = 4, 8; v = 1, 2; 3 repeats
    python bench/pipeline_bubble.py --micro-batches 4,8,16 --chunks 1,2 --repeats 5

Each configuration is one ``torchrun`` job of ``--stages`` ranks (pp = p, dp = tp = 1,
one torch thread per rank, so on this 2-core machine no rank waits for a core and
"busy" is compute, not scheduling), training the layered GPT (``examples/gpt/layers.py``)
with ``terascale.pipe.PipelineModule`` for ``--steps`` steps. Every stage reports
``engine.pipeline_stats()``: ``busy_s`` (its forward and backward compute) and
``step_s`` (the wall time of the schedule). The theory - ``(p - 1) / (m + p - 1)`` for
1F1B with m micro-batches, ``(p - 1) / (v·m + p - 1)`` interleaved over v chunks per rank
(Narayanan et al. 2021) - is for stages of equal cost; real stages differ a little (the
last one also computes the head and the loss), and every other stage then also waits for
the slowest one in the steady state, which is imbalance, not the schedule's bubble. So
the bubble of a step is measured on the critical path: ``1 - busy / step`` of the
busiest stage; the first stage's (which adds the waiting for the slowest) is shown too.
``--vocab`` is small by default so that the head costs little and the stages are close to
equal. The table gives medians over timed steps and repeats and the ratio measured /
theory; JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

from step_time import run_job  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", default="4,8", help="comma-separated m values")
    p.add_argument("--chunks", default="1,2", help="comma-separated virtual stages (chunks) per rank, v")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=8, help="blocks; with embedding and head, layers + 2 pipeline layers")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="runs/bench/pipeline_bubble.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: "m,v"
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def theory(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import terascale
    from gpt.layers import layer_specs, loss_fn
    from gpt.model import GPTConfig
    from terascale.parallel import Topology
    from terascale.pipe import LayerSpec, PipelineModule

    torch.set_num_threads(args.threads)
    m, v = (int(x) for x in args.worker.split(","))
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.hidden)
    topo = Topology(pp=args.stages)
    # Uniform partitioning of the blocks: the embedding and the head are light, so each
    # chunk costs about the same (the theory assumes equal stages).
    module = PipelineModule([LayerSpec(cls, *a) for cls, a in layer_specs(config, 0)], topology=topo, loss_fn=loss_fn,
                            partition_method="type:Block", virtual_stages=v)  # fmt: skip
    ts_config = {
        "train_batch_size": m * args.micro_batch, "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": m, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
    }  # fmt: skip
    engine, *_ = terascale.initialize(model=module, config=ts_config)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (m, args.micro_batch, args.seq + 1), generator=g)
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    stats = []
    for step in range(args.steps):
        dist.barrier()
        started = time.perf_counter()
        engine.train_batch(iter(batches))
        wall = time.perf_counter() - started
        if step >= args.warmup:
            stats.append({**engine.pipeline_stats(), "wall_s": wall})
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, stats)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"m": m, "v": v, "p": args.stages, "stages": everyone}))
    engine.destroy()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    args.nproc = args.stages  # run_job launches this many ranks
    configs = [(int(m), int(v)) for m in args.micro_batches.split(",") for v in args.chunks.split(",")]
    runs: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, (m, v) in enumerate(configs[r % len(configs):] + configs[: r % len(configs)]):
                result = Path(tmp) / f"{m}-{v}-{r}.json"
                runs[(m, v)].append(run_job(args, f"{m},{v}", result, script=__file__))
                print(f"repeat {r + 1}/{args.repeats}: m={m} v={v} done", file=sys.stderr)
    rows, raw = [], {}
    print(f"\npipeline bubble, p={args.stages} stages, GPT {args.layers} x {args.hidden}, micro-batch "
          f"{args.micro_batch} x {args.seq} tokens, {args.repeats} repeats x {args.steps - args.warmup} timed steps\n")  # fmt: skip
    print("| m | v | theory (p-1)/(v·m+p-1) | measured bubble (busiest stage) | measured / theory | "
          "first stage's idle | busy s per stage | step s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (m, v), results in runs.items():
        # One step of every stage at a time: the busiest stage's idle fraction is the bubble.
        steps = [[res["stages"][s][i] for s in range(args.stages)] for res in results for i in range(len(res["stages"][0]))]
        bubble = statistics.median(1 - max(st["busy_s"] for st in step) / step[0]["step_s"] for step in steps)
        first = statistics.median(step[0]["bubble"] for step in steps)
        ideal = theory(args.stages, m, v)
        busy = [statistics.median(step[s]["busy_s"] for step in steps) for s in range(args.stages)]
        row = {"m": m, "v": v, "theory": ideal, "bubble": bubble, "ratio": bubble / ideal, "first_stage_idle": first,
               "busy_s": busy, "step_s": statistics.median(step[0]["step_s"] for step in steps)}  # fmt: skip
        rows.append(row)
        raw[f"m={m},v={v}"] = results
        print(f"| {m} | {v} | {ideal:.3f} | {bubble:.3f} | {bubble / ideal:.2f} | {first:.3f} | "
              f"{' / '.join(f'{b:.2f}' for b in busy)} | {row['step_s']:.2f} |")  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "raw": raw}, indent=1))


if __name__ == "__main__":
    main()
