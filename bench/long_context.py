"""Long sequences on two ranks: the longest that trains, memory per rank, step time.

    python bench/long_context.py ladder                   # peak memory per rank vs sequence length
    python bench/long_context.py speed --seq 2048         # step time, interleaved repeats
    python bench/long_context.py plot                     # bench/long_context_memory.png from the ladder

A Llama-shaped causal LM of 112M parameters (Hugging Face ``LlamaForCausalLM``: hidden 768,
10 layers, 12 heads over 4 key/value heads, SwiGLU 2048, vocabulary 32000, fp32) trains on
two ranks at ZeRO-3, one sequence a step. Systems (``terascale run``-free: one torchrun job
per run):

- ``baseline``: both ranks train on whole sequences of their own (data parallel), no
  sequence parallelism, no tiling, no activation checkpointing;
- ``sp2``: each sequence split over both ranks (Ulysses), nothing else;
- ``sp2-tiled``: ``sp2`` with the MLPs and the loss in sequence tiles, every decoder layer
  recomputed in backward and its saved input offloaded (``cpu_checkpointing``; on this
  CPU-only machine the host *is* the device, so the offload moves nothing: on a GPU it moves
  the layer inputs to host memory);
- ``deepspeed-sp2``: DeepSpeed 0.19's Ulysses for Hugging Face models (ALST:
  ``UlyssesSPAttentionHF.register_with_transformers``, ``UlyssesSPDataLoaderAdapter``, the
  loss recipe of its tutorial), ZeRO-3, from the peers' environment (../shared/BENCHMARKING.md).

``ladder`` runs each system at doubling lengths until a run's resident memory passes the
per-rank budget (``--budget-gib``: a watchdog stops the rank there, so the machine never
swaps), recording each rank's peak (``VmHWM`` from the first step on) and the step time;
``speed`` interleaves repeats of a few steps at one length for the step-time ratios, per
token (the baseline's two ranks train a sequence each a step; ``--batch 2`` gives the split
systems the same two sequences a step, so the step's fixed costs, gathering and updating the
parameters, are spread over as many tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("baseline", "sp2", "sp2-tiled", "deepspeed-sp2")
VOCAB = 32000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("ladder", "speed", "plot", "worker"))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--peers-python", default="/tmp/peers/bin/python")
    p.add_argument("--seq", type=int, default=2048, help="speed: the sequence length")
    p.add_argument("--start", type=int, default=1024, help="ladder: the first length")
    p.add_argument("--stop", type=int, default=16384, help="ladder: the last length tried")
    p.add_argument("--budget-gib", type=float, default=3.0, help="resident memory a rank may use")
    p.add_argument("--steps", type=int, default=2, help="steps a run (ladder: the last is timed)")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences a step for the split systems (speed: 2, the baseline's two ranks' worth)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--json", default="runs/bench/long_context.json")
    p.add_argument("--system", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _config(layers: int):
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1 << 17)  # fmt: skip
    config._attn_implementation = "sdpa"
    return config


def _ds_config(system: str, batch: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1 if system == "baseline" else batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 1e9,  # norms, never clipped
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    if system.startswith("sp2") or system.startswith("deepspeed"):
        config["sequence_parallel_size"] = 2
    if system == "sp2-tiled":
        config["activation_checkpointing"] = {"policy": "blocks", "cpu_checkpointing": True}
        config["sequence_parallel"] = {"tiled_mlp": True, "tiled_loss": True}
    return config


# -- a rank -------------------------------------------------------------------------------------


def _watch(budget: int, result: Path, rank: int) -> None:
    """Stop this rank once its resident memory passes ``budget`` (it would not fit)."""
    import psutil

    proc = psutil.Process()
    while True:
        rss = proc.memory_info().rss
        if rss > budget:
            if rank == 0:
                result.write_text(json.dumps({"fits": False, "rss_mib": rss / 2**20}))
            os._exit(3)
        time.sleep(0.02)


def _hwm_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    result = Path(args.result)
    threading.Thread(target=_watch, args=(int(args.budget_gib * 2**30), result, rank), daemon=True).start()
    seq = args.seq
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (args.steps, max(2, args.batch), seq), generator=g)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(args.layers))
    times, losses = [], []
    if args.system.startswith("deepspeed"):
        step = _deepspeed_steps(args, model, tokens)
    else:
        step = _terascale_steps(args, model, tokens)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on: training's
    for s in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step(s))
        times.append(time.perf_counter() - t0)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, _hwm_mib())
    if rank == 0:
        result.write_text(json.dumps({"fits": True, "times": times, "losses": losses, "peak_mib": peaks, "norms": norms}))
    dist.barrier()
    dist.destroy_process_group()


norms: list[float] = []  # each step's global gradient norm (this process's)


def _terascale_steps(args, model, tokens):
    import terascale

    engine, *_ = terascale.initialize(model=model, config=_ds_config(args.system, args.batch))
    # The baseline's ranks train sequences of their own; a sequence group shares its batch.
    rows = slice(r := engine.get_data_parallel_rank(), r + 1) if args.system == "baseline" else slice(0, args.batch)

    def step(s: int) -> float:
        ids = tokens[s, rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        return loss.item()

    return step


def _deepspeed_steps(args, model, tokens):
    """DeepSpeed's ALST recipe as its tutorial writes it (register, initialize with the
    mpu, the data loader adapter, the per-rank loss combined over the group)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups

    seq = tokens.shape[-1]
    deepspeed.init_distributed(dist_backend="gloo")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=2,
        micro_batch_size=args.batch, seq_length=seq, seq_length_is_variable=True,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=_ds_config(args.system, args.batch), mpu=mpu)
    sp_group = groups._get_sequence_parallel_group()
    sp_rank, sp_world = groups._get_sequence_parallel_rank(), groups._get_sequence_parallel_world_size()
    rows = [{"input_ids": tokens[s, i], "labels": tokens[s, i], "position_ids": torch.arange(seq)}
            for s in range(args.steps) for i in range(args.batch)]  # fmt: skip
    # Each sp rank's loader yields its own batches; the adapter gathers them and runs rank
    # 0's, then rank 1's: the same sequence of batches as the other systems'.
    per_step = [rows[i : i + args.batch] for i in range(0, len(rows), args.batch)]
    mine = [row for batch in per_step[sp_rank::sp_world] for row in batch]
    loader = torch.utils.data.DataLoader(mine, batch_size=args.batch)
    batches = iter(UlyssesSPDataLoaderAdapter(loader, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world,
                                              device=torch.device("cpu")))  # fmt: skip

    def step(s: int) -> float:
        batch = next(batches)
        # DeepSpeed's adapter slices [b, S] rows without copying: with b > 1 the labels are
        # not contiguous and Hugging Face's loss cannot view them flat.
        shift = batch["shift_labels"] = batch["shift_labels"].contiguous()
        out = engine(**batch, labels=shift)  # as the Trainer's ALST loss does: labels reach the loss branch
        good = (shift != -100).sum()
        losses = torch.distributed.nn.functional.all_gather(out.loss, group=sp_group)
        goods = [torch.zeros_like(good) for _ in range(sp_world)]
        dist.all_gather(goods, good, group=sp_group)
        loss = sum(l * g for l, g in zip(losses, goods) if g > 0) / sum(goods)
        engine.backward(loss)
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        return loss.item()

    return step


# -- the driver -----------------------------------------------------------------------------------


def run(args: argparse.Namespace, system: str, seq: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        python = args.peers_python if system.startswith("deepspeed") else sys.executable
        cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "worker",
               f"--system={system}", f"--result={result}", f"--seq={seq}", f"--steps={steps}",
               f"--budget-gib={args.budget_gib}", f"--layers={args.layers}", f"--batch={args.batch}"]  # fmt: skip
        # Blocks from 1 MiB up are mapped and returned when freed: glibc's heap would
        # otherwise keep each size of transient it served (its mapping threshold grows to
        # 32 MiB), and the resident size would count what training once used, not what it
        # holds (a GPU's caching allocator reuses blocks instead). The same for every system.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "1048576"}
        if system.startswith("deepspeed"):
            env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR="/tmp/peers-ext")
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if result.exists():
            out = json.loads(result.read_text())
        else:
            out = {"fits": False, "error": proc.stderr[-3000:]}
        out.update(system=system, seq=seq, wall_s=time.time() - t0)
        return out


def ladder(args: argparse.Namespace, systems: list[str]) -> list[dict]:
    rows = []
    for system in systems:
        seq = args.start
        while seq <= args.stop:
            out = run(args, system, seq, args.steps)
            rows.append(out)
            peak = max(out.get("peak_mib") or [out.get("rss_mib", 0)])
            step = out["times"][-1] if out.get("times") else None
            print(f"{system:14s} seq {seq:6d}  fits {out['fits']!s:5s}  peak/rank {peak:7.0f} MiB  "
                  f"step {step if step is None else round(step, 2)} s", file=sys.stderr, flush=True)  # fmt: skip
            if not out["fits"]:
                if "error" in out:
                    print(out["error"], file=sys.stderr)
                break
            seq *= 2
    return rows


def speed(args: argparse.Namespace, systems: list[str]) -> list[dict]:
    rows = []
    for r in range(args.repeats):
        for system in systems[r % len(systems):] + systems[: r % len(systems)]:
            out = run(args, system, args.seq, args.steps)
            rows.append(out)
            if not out.get("times"):
                print(f"{system}: {out.get('error', 'did not fit')}", file=sys.stderr)
                continue
            per_token = statistics.median(out["times"][1:]) / (args.seq * (2 if system == "baseline" else args.batch))
            print(f"repeat {r} {system:14s} {statistics.median(out['times'][1:]):7.2f} s/step "
                  f"{per_token * 1e6:8.1f} us/token  loss {out['losses'][-1]:.4f}", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(Path(args.json).read_text())["ladder"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in dict.fromkeys(r["system"] for r in rows):
        fit = [r for r in rows if r["system"] == system and r["fits"]]
        ax.plot([r["seq"] for r in fit], [max(r["peak_mib"]) / 1024 for r in fit], marker="o", label=system)
    ax.axhline(args.budget_gib, color="grey", linestyle="--", label=f"budget {args.budget_gib:g} GiB/rank")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak resident memory per rank (GiB)")
    ax.set_title("112M Llama, 2 ranks, ZeRO-3")
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "bench" / "long_context_memory.png", dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mode == "worker":
        worker(args)
        return
    if args.mode == "plot":
        plot(args)
        return
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {SYSTEMS}")
    out = Path(args.json)
    saved = json.loads(out.read_text()) if out.exists() else {}
    if args.mode == "ladder":  # merged with the lengths measured before
        rows = {(r["system"], r["seq"]): r for r in saved.get("ladder", []) + ladder(args, systems)}
        saved["ladder"] = sorted(rows.values(), key=lambda r: (SYSTEMS.index(r["system"]), r["seq"]))
    else:
        saved["speed"] = speed(args, systems)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
