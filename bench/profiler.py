"""Observability costs and the flops profiler's counts (issue 17).

Part ``counts``: the GPT of examples/gpt. Its training step (forward + backward) as
terascale's flops profiler counts it, against the analytic formula (6·N per token plus the
attention terms and the logits: ``terascale.profiling.throughput.gpt_flops_per_token``),
with and without activation checkpointing (the recompute is counted as measured); and its
forward as ``terascale.profiling.get_model_profile`` counts it against DeepSpeed's
``get_model_profile`` on the same model and input, run in DeepSpeed's environment
(``--peers-python``, see ../shared/BENCHMARKING.md) in the same invocation.

Part ``overhead``: 2 ranks under ``terascale run``, one engine per configuration in one
process, each stepped in turn with the order rotated every step, so that whatever else
the machine does falls on all of them alike:
  off       steps_per_print null, no monitors
  monitors  steps_per_print 10, CSV monitor, wall_clock_breakdown (every 10 steps: the
            print line, every rank's memory, the monitors)
  comms     comms_logger on (every collective recorded)
  profiled  flops_profiler at step ``--profile-step`` (the profiled step's own cost, and
            none on the steps after it)
Ratios are of medians over the timed steps (the slower rank's time per step).

    .venv/bin/python bench/profiler.py [--quick] [--parts counts,overhead] [--peers-python /tmp/peers/bin/python]
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

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("off", "monitors", "comms", "profiled")


def gpt_config(a: argparse.Namespace) -> dict:
    return {"vocab_size": a.vocab, "block_size": a.seq, "n_layer": a.layers, "n_head": a.heads, "n_embd": a.hidden}


# -- part 1: counts -----------------------------------------------------------------------------


def count_ours(a: argparse.Namespace) -> dict:
    """Our counts of one training step (with and without checkpointed blocks) and of a forward."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from gpt import GPT, GPTConfig
    from torch.utils.checkpoint import checkpoint

    from terascale.profiling import FlopsProfiler, get_model_profile
    from terascale.profiling.throughput import gpt_flops_per_token

    torch.manual_seed(0)
    model = GPT(GPTConfig(**gpt_config(a)))
    ids = torch.randint(0, a.vocab, (a.batch, a.seq))
    out: dict = {"params": sum(p.numel() for p in model.parameters()), "tokens": a.batch * a.seq}
    for recompute in (False, True):
        blocks = model.blocks
        forwards = [b.forward for b in blocks]
        if recompute:  # checkpoint every block, as activation_checkpointing's "blocks" policy does
            for b, f in zip(blocks, forwards):
                b.forward = lambda x, f=f: checkpoint(f, x, use_reentrant=False)  # noqa: B023
        profiler = FlopsProfiler(model)
        profiler.start()
        model(ids, ids).backward()
        profiler.stop()
        for b, f in zip(blocks, forwards):
            b.forward = f
        model.zero_grad(set_to_none=True)
        counted = profiler.total_flops()
        analytic = gpt_flops_per_token(a.layers, a.hidden, a.vocab, a.seq, recompute=recompute) * a.batch * a.seq
        out["recompute" if recompute else "plain"] = {"counted": counted, "analytic": analytic}
    flops, macs, params = get_model_profile(model, args=(ids,), print_profile=False, warm_up=0)
    out["forward"] = {"flops": flops, "macs": macs, "params": params}
    return out


DS_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {examples!r})
from gpt import GPT, GPTConfig
from deepspeed.profiling.flops_profiler import get_model_profile
torch.manual_seed(0)
model = GPT(GPTConfig(**{cfg!r}))
ids = torch.randint(0, {vocab}, ({batch}, {seq}))
flops, macs, params = get_model_profile(model, args=[ids], print_profile=False, warm_up=0, as_string=False)
print("RESULT " + json.dumps({{"flops": flops, "macs": macs, "params": params}}))
"""


def count_deepspeed(a: argparse.Namespace) -> dict | str:
    """DeepSpeed's get_model_profile on the same model and input, in its own environment."""
    if not a.peers_python or not Path(a.peers_python).exists():
        return f"not run: no DeepSpeed environment at {a.peers_python!r}"
    script = DS_SCRIPT.format(examples=str(ROOT / "examples"), cfg=gpt_config(a), vocab=a.vocab, batch=a.batch,
                              seq=a.seq)  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([a.peers_python, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return f"failed: {(done.stderr or done.stdout)[-800:]}"


# -- part 2: overhead ---------------------------------------------------------------------------


def engine_config(name: str, a: argparse.Namespace, tmp: Path) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": None,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": a.stage},
    }
    if name == "monitors":
        config.update(steps_per_print=10, wall_clock_breakdown=True,
                      csv_monitor={"enabled": True, "output_path": str(tmp / "csv"), "job_name": "bench"})  # fmt: skip
    if name == "comms":
        config["comms_logger"] = {"enabled": True}
    if name == "profiled":
        config["flops_profiler"] = {"enabled": True, "profile_step": a.profile_step,
                                    "output_file": str(tmp / "flops_profile.txt")}  # fmt: skip
    return config


def worker(argv: list[str]) -> None:
    a = parse_args(argv)
    sys.path.insert(0, str(ROOT / "examples"))
    import logging

    import torch
    from gpt import GPT, GPTConfig

    import terascale

    rank = int(os.environ["RANK"])
    tmp = Path(a.out)
    logging.getLogger("terascale").addHandler(logging.FileHandler(tmp / f"log{rank}.txt"))
    engines = {}
    for name in CONFIGS:
        torch.manual_seed(0)
        engines[name], *_ = terascale.initialize(model=GPT(GPTConfig(**gpt_config(a))),
                                                 config=engine_config(name, a, tmp))  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in CONFIGS}
    for step in range(1, a.steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        k = step % len(CONFIGS)
        order = list(CONFIGS[k:] + CONFIGS[:k])
        for name in order if step % 2 else order[::-1]:
            engine = engines[name]
            started = time.perf_counter()
            engine.backward(engine(ids, ids))
            engine.step()
            times[name].append(time.perf_counter() - started)
    summary = engines["comms"].comms_summary() if rank == 0 else ""
    for e in engines.values():
        e.destroy()
    (tmp / f"times{rank}.json").write_text(json.dumps({"times": times, "comms_summary": summary}))


def overhead(a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        argv = [sys.executable, "-m", "terascale", "run", "--nproc", "2", "--no_local_rank", __file__, "worker",
                "--out", str(tmp),
                *[f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                  if k in ("steps", "batch", "seq", "layers", "hidden", "heads", "vocab", "stage", "profile_step")]]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        started = time.perf_counter()
        subprocess.run(argv, check=True, env=env, timeout=3600)
        wall = time.perf_counter() - started
        ranks = [json.loads((tmp / f"times{r}.json").read_text()) for r in range(2)]
        profile = (tmp / "flops_profile.txt").read_text() if (tmp / "flops_profile.txt").exists() else ""
    slow = {n: [max(t) for t in zip(*(r["times"][n] for r in ranks))] for n in CONFIGS}
    return {"per_step": slow, "wall_s": wall, "comms_summary": ranks[0]["comms_summary"], "profile": profile}


# -- report -------------------------------------------------------------------------------------


def report(a: argparse.Namespace, counts: dict | None, ds: dict | str | None, over: dict | None) -> None:
    print(f"\n## Observability (bench/profiler.py), {time.strftime('%Y-%m-%d')}\n")
    print(f"GPT of examples/gpt: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, vocabulary {a.vocab}, "
          f"sequence {a.seq}, batch {a.batch} per rank\n")
    if counts is not None:
        print(f"Parameters {counts['params']:,}; tokens per forward {counts['tokens']:,}\n")
        print("| what | counted FLOPs | analytic | counted / analytic (target within 2%) |")
        print("| --- | --- | --- | --- |")
        for key, label in (("plain", "training step"), ("recompute", "training step, checkpointed blocks")):
            c = counts[key]
            print(f"| {label} | {c['counted']:.4g} | {c['analytic']:.4g} | **{c['counted'] / c['analytic']:.4f}** |")
        fwd = counts["forward"]
        print(f"\nForward only, get_model_profile: terascale {fwd['flops']:.4g} FLOPs, {fwd['macs']:.4g} MACs, "
              f"{fwd['params']:,} params")
        if isinstance(ds, dict):
            print(f"DeepSpeed 0.19.8 get_model_profile on the same model and input: {ds['flops']:.4g} FLOPs, "
                  f"{ds['macs']:.4g} MACs, {ds['params']:,} params; terascale / DeepSpeed FLOPs "
                  f"**{fwd['flops'] / ds['flops']:.4f}**, MACs {fwd['macs'] / ds['macs']:.4f}")
        else:
            print(f"DeepSpeed: {ds}")
    if over is not None:
        per = over["per_step"]
        skip = a.warmup
        timed = {n: [t for i, t in enumerate(per[n], 1) if i > skip and i != a.profile_step] for n in CONFIGS}
        base = statistics.median(timed["off"])
        print(f"\nOverhead: 2 ranks, ZeRO-{a.stage}, {a.steps} steps of each engine in turn (first {skip} dropped), "
              f"the slower rank's time per step, medians; {over['wall_s']:.0f} s\n")
        print("| configuration | ms/step | / off | target |")
        print("| --- | --- | --- | --- |")
        targets = {"off": "", "monitors": "≤ 1.01", "comms": "≤ 1.03", "profiled": "1.00 (steps other than the profiled one)"}
        for n in CONFIGS:
            m = statistics.median(timed[n])
            print(f"| {n} | {m * 1e3:.1f} | **{m / base:.3f}** | {targets[n]} |")
        prof = per["profiled"][a.profile_step - 1]
        ref = statistics.median(timed["profiled"])
        print(f"\nThe profiled step (step {a.profile_step}): {prof * 1e3:.1f} ms against the same engine's median "
              f"{ref * 1e3:.1f} ms: **{prof / ref:.2f}×**")
        print("\n<details><summary>comms logger summary (rank 0)</summary>\n\n```\n" + over["comms_summary"]
              + "\n```\n</details>")
        print("\n<details><summary>flops profile of the profiled step</summary>\n\n```\n" + over["profile"]
              + "\n```\n</details>")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (about 2 minutes)")
    p.add_argument("--parts", default="counts,overhead")
    p.add_argument("--peers-python", default="/tmp/peers/bin/python")
    p.add_argument("--steps", type=int, default=None, help="steps of each engine (default 100; quick 25)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile-step", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps is None:
        a.steps = 25 if a.quick else 100
    return a


def main(argv: list[str]) -> None:
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    a = parse_args(argv)
    parts = set(a.parts.split(","))
    counts = ds = over = None
    if "counts" in parts:
        counts, ds = count_ours(a), count_deepspeed(a)
    if "overhead" in parts:
        over = overhead(a)
    report(a, counts, ds, over)


if __name__ == "__main__":
    main(sys.argv[1:])
