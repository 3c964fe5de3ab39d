"""The pipeline bubble measured against the theory, for 1F1B and interleaved 1F1B.

    python bench/pipeline_bubble.py                     # p=2; m = 4, 8; v = 1, 2; 3 repeats
    python bench/pipeline_bubble.py --micro-batches 4,8,16 --virtual 1,2 --repeats 5

Each configuration is one ``torchrun`` job of ``--stages`` ranks (pp = p, dp = tp = 1,
one torch thread per rank, so on this 2-core machine no rank waits for a core and
"busy" is compute, not scheduling), training the layered GPT (``examples/gpt/layers.py``)
with ``terascale.pipe.PipelineModule`` for ``--steps`` steps. Every stage reports
``engine.pipeline_stats()``: ``busy_s`` (its forward and backward compute) and
``step_s`` (the wall time of the schedule); the bubble of a step is ``1 - busy / step``
on the stage that waits the most (the first stage: it starts first and finishes last).
The theory: ``(p - 1) / (m + p - 1)`` for 1F1B with m micro-batches, ``(p - 1) / (v·m +
p - 1)`` interleaved over v chunks per rank (Narayanan et al. 2021), for stages of equal
cost. The table gives the median over timed steps and repeats and the ratio measured /
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
    p.add_argument("--virtual", default="1,2", help="comma-separated chunks per rank (v)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
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
    configs = [(int(m), int(v)) for m in args.micro_batches.split(",") for v in args.virtual.split(",")]
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
    print("| m | v | theory (p-1)/(v·m+p-1) | measured bubble (stage 0) | measured / theory | stage busy s (0 / last) | step s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (m, v), results in runs.items():
        first = [s for res in results for s in res["stages"][0]]
        last = [s for res in results for s in res["stages"][-1]]
        bubble = statistics.median(s["bubble"] for s in first)
        ideal = theory(args.stages, m, v)
        row = {"m": m, "v": v, "theory": ideal, "bubble": bubble, "ratio": bubble / ideal,
               "busy_first": statistics.median(s["busy_s"] for s in first),
               "busy_last": statistics.median(s["busy_s"] for s in last),
               "step_s": statistics.median(s["step_s"] for s in first)}  # fmt: skip
        rows.append(row)
        raw[f"m={m},v={v}"] = results
        print(f"| {m} | {v} | {ideal:.3f} | {bubble:.3f} | {bubble / ideal:.2f} | "
              f"{row['busy_first']:.2f} / {row['busy_last']:.2f} | {row['step_s']:.2f} |")  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "raw": raw}, indent=1))


if __name__ == "__main__":
    main()
